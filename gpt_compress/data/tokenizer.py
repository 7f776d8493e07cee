"""GPT-2 byte-level BPE tokenizer on top of the Hugging Face `tokenizers` library.

Ids are exactly those of OpenAI's GPT-2 encoder (tiktoken "gpt2"); tests check this on the
whole WikiText-2 test split. ``<|endoftext|>`` is the end-of-document (EOD) token and also the
padding token.

``<|endoftext|>`` written *inside* a text is plain text by default: it encodes to the pieces
``<``, ``|``, ``end``, ... exactly like tiktoken's ``encode(text, disallowed_special=())`` and
Megatron's GPT-2 tokenizer, so a corpus can never forge a document boundary; EOD ids only come
from ``append_eod`` in preprocessing. Pass ``allow_special=True`` to map the literal to the EOD
id instead (Hugging Face ``GPT2TokenizerFast`` behaviour, tiktoken ``allowed_special="all"``).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Sequence, Union

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from ..fileio import write_text_atomic
from .errors import DataError

EOD_TOKEN = "<|endoftext|>"

# Texts longer than this are cut into pieces encoded in parallel (see _split_long).
_PIECE_CHARS = 16384
# An ASCII space/tab/newline right after a non-space character always starts a GPT-2 pre-token:
# no pre-token pattern puts whitespace after a non-space character, and the pattern has no
# look-behind, so encoding the pieces separately gives exactly the ids of the whole text.
# (Python's \S excludes every Unicode space the library's \s knows, and a few more.)
_SAFE_CUT = re.compile(r"(?<=\S)[ \t\n\r]")

PathLike = Union[str, os.PathLike]

# CJK ideographs (Unified, Extension A, Compatibility). ``Tokenizer.train(split_cjk=True)`` makes
# each one its own pre-token before the byte-level step, so merges stay inside one character's
# bytes: a character is one token (or, if rare, a few byte tokens), never part of a multi-character
# token. Chinese verse then has a fixed token period (5 characters + ，= 6 tokens).
CJK_CHARS = "[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"


def _pre_tokenizer(split_cjk: bool):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if not split_cjk:
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(CJK_CHARS), "isolated"), byte_level])


def _is_gpt2_byte_level(pre: dict) -> bool:
    return pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space") and pre.get("use_regex", True)


def _cuttable(pre: dict) -> bool:
    """True for the GPT-2 pre-tokenizer, alone or after isolating CJK characters: for both, a
    text cut before an ASCII whitespace that follows a non-space encodes to the same ids."""
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        return (len(steps) == 2 and _is_gpt2_byte_level(steps[1]) and steps[0].get("type") == "Split"
                and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"))
    return _is_gpt2_byte_level(pre)


def _split_long(text: str) -> list[str]:
    """Cut ``text`` into pieces of about _PIECE_CHARS at pre-token boundaries."""
    if len(text) <= _PIECE_CHARS:
        return [text]
    pieces, start = [], 0
    while len(text) - start > _PIECE_CHARS:
        m = _SAFE_CUT.search(text, start + _PIECE_CHARS)
        if m is None:
            break
        pieces.append(text[start:m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def _batch_encode(hf: tokenizers.Tokenizer, texts: list[str]) -> list:
    # encode_batch_fast (tokenizers >= 0.20) skips offset tracking, which ids do not need.
    fast = getattr(hf, "encode_batch_fast", None) or hf.encode_batch
    return fast(texts, add_special_tokens=False)


def _read_vocab(path: PathLike) -> dict[str, int]:
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except FileNotFoundError:
        raise DataError(f"vocabulary file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a JSON vocabulary ({e})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise DataError(f"{path}: expected a JSON object mapping token -> integer id")
    return vocab


def _read_merges(path: PathLike, vocab: dict[str, int]) -> list[tuple[str, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise DataError(f"merges file not found: {path}") from None
    merges = []
    for lineno, line in enumerate(lines, start=1):
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise DataError(f"{path}, line {lineno}: expected two tokens separated by one space, "
                            f"got {line!r}")
        for token in (parts[0], parts[1], parts[0] + parts[1]):
            if token not in vocab:
                raise DataError(f"{path}, line {lineno}: token {token!r} is not in the vocabulary; "
                                "are the vocabulary and merges files from the same tokenizer?")
        merges.append((parts[0], parts[1]))
    return merges


class Tokenizer:
    """Byte-level BPE with GPT-2 semantics; ``<|endoftext|>`` is EOD and padding."""

    def __init__(self, backend: tokenizers.Tokenizer):
        if backend.token_to_id(EOD_TOKEN) is None:
            raise DataError(f"the tokenizer has no {EOD_TOKEN} token, which gpt-compress uses as "
                            "the end-of-document token; add it as a special token")
        self._special = backend
        # A twin that encodes special-token literals as plain text (see module docstring).
        text = backend.to_str()
        self._plain = tokenizers.Tokenizer.from_str(text)
        self._plain.encode_special_tokens = True
        spec = json.loads(text)
        pre = spec.get("pre_tokenizer") or {}
        # Cutting long texts is exact only for the GPT-2 pre-tokenizer (optionally after isolating
        # CJK characters) with no normalizer.
        self._cut_long = spec.get("normalizer") is None and _cuttable(pre)

    # ------------------------------------------------------------------ construction
    @classmethod
    def _from_vocab_merges(cls, vocab: dict[str, int], merges: list[tuple[str, str]]) -> "Tokenizer":
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([EOD_TOKEN])
        return cls(backend)

    @classmethod
    def from_files(cls, vocab_json: PathLike, merges_txt: PathLike) -> "Tokenizer":
        """Load the Hugging Face layout: ``vocab.json`` + ``merges.txt``."""
        vocab = _read_vocab(vocab_json)
        if EOD_TOKEN not in vocab:
            raise DataError(f"{vocab_json}: no {EOD_TOKEN} entry; gpt-compress needs it as the "
                            "end-of-document token")
        return cls._from_vocab_merges(vocab, _read_merges(merges_txt, vocab))

    @classmethod
    def from_openai_files(cls, encoder_json: PathLike, vocab_bpe: PathLike) -> "Tokenizer":
        """Load OpenAI's layout: ``encoder.json`` + ``vocab.bpe`` (first line ``#version``)."""
        # Same content as the HF layout under other names; the #version line is skipped there too.
        return cls.from_files(encoder_json, vocab_bpe)

    @classmethod
    def from_tokenizer_json(cls, path: PathLike) -> "Tokenizer":
        """Load a Hugging Face ``tokenizer.json`` holding a BPE model."""
        try:
            text = Path(path).read_text(encoding="utf-8")
            spec = json.loads(text)
            backend = tokenizers.Tokenizer.from_str(text)
        except FileNotFoundError:
            raise DataError(f"tokenizer file not found: {path}") from None
        except Exception as e:  # the library raises bare Exception subclasses on bad JSON
            raise DataError(f"{path}: not a valid tokenizer.json ({e})") from None
        if (spec.get("model") or {}).get("type") != "BPE":
            raise DataError(f"{path}: model type is {(spec.get('model') or {}).get('type')!r}, "
                            "expected a byte-level 'BPE' model")
        return cls(backend)

    @classmethod
    def load(cls, directory: PathLike) -> "Tokenizer":
        """Load from a directory: ``tokenizer.json``, or vocab.json+merges.txt, or encoder.json+vocab.bpe."""
        d = Path(directory)
        if (d / "tokenizer.json").is_file():
            return cls.from_tokenizer_json(d / "tokenizer.json")
        if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
            return cls.from_files(d / "vocab.json", d / "merges.txt")
        if (d / "encoder.json").is_file() and (d / "vocab.bpe").is_file():
            return cls.from_openai_files(d / "encoder.json", d / "vocab.bpe")
        what = "is not a directory" if not d.is_dir() else "has no tokenizer files"
        raise DataError(f"tokenizer directory {d} {what}: looked for tokenizer.json, "
                        "vocab.json + merges.txt (Hugging Face) or encoder.json + vocab.bpe "
                        "(OpenAI); train one with `gptc train-tokenizer` or point to the files")

    @classmethod
    def train(cls, files_or_iterator: Union[Sequence[PathLike], Iterable[str]], vocab_size: int,
              min_frequency: int = 2, show_progress: bool = False, split_cjk: bool = False) -> "Tokenizer":
        """Train a new GPT-2-style byte-level BPE (with ``<|endoftext|>``) on files or strings.
        ``split_cjk``: each CJK character is its own pre-token (see CJK_CHARS), so for Chinese a
        token is one character (a rare one: a few byte tokens), the unit the text is written in; the
        BPE stays byte-level and round-trips every character either way."""
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + 1:
            raise DataError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
                            f"{len(alphabet) + 1} tokens (256 bytes + {EOD_TOKEN})")
        backend = tokenizers.Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer(split_cjk)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=[EOD_TOKEN], initial_alphabet=alphabet,
                                      show_progress=show_progress)
        items = files_or_iterator
        if isinstance(items, (str, os.PathLike)):
            items = [items]
        # A list of paths (Path objects, or strings naming existing files) means files;
        # anything else is an iterable of texts.
        if isinstance(items, (list, tuple)) and items and all(
                isinstance(p, os.PathLike) or (isinstance(p, str) and os.path.isfile(p)) for p in items):
            missing = [os.fspath(p) for p in items if not os.path.isfile(p)]
            if missing:
                raise DataError(f"training file(s) not found: {', '.join(missing)}")
            backend.train([os.fspath(p) for p in items], trainer)
        else:
            backend.train_from_iterator(items, trainer)
        return cls(backend)

    # ------------------------------------------------------------------ saving
    def save(self, directory: PathLike) -> list[Path]:
        """Write ``tokenizer.json`` plus ``vocab.json`` + ``merges.txt``, each atomically."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        spec = json.loads(self._special.to_str())
        merges = []
        for m in spec["model"]["merges"]:
            # tokenizers >= 0.20 stores pairs as lists, older versions as "a b" strings.
            a, b = m if isinstance(m, list) else m.split(" ")
            if " " in a or " " in b:
                raise DataError("cannot write merges.txt: a merge contains a space, which the "
                                "byte-level format cannot represent")
            merges.append(f"{a} {b}")
        vocab = dict(sorted(self._special.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]))
        paths = [d / "vocab.json", d / "merges.txt", d / "tokenizer.json"]
        write_text_atomic(paths[0], json.dumps(vocab, ensure_ascii=False), newline="\n")
        write_text_atomic(paths[1], "#version: 0.2\n" + "".join(m + "\n" for m in merges), newline="\n")
        # Last, because load() prefers it: its presence means the other two are complete.
        write_text_atomic(paths[2], self._special.to_str(pretty=True), newline="\n")
        return paths

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (used to ship the tokenizer to worker processes)."""
        return self._special.to_str()

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        """Inverse of :meth:`to_json`."""
        return cls(tokenizers.Tokenizer.from_str(text))

    # ------------------------------------------------------------------ use
    @property
    def eod_id(self) -> int:
        """Id of ``<|endoftext|>``, the end-of-document token."""
        return self._special.token_to_id(EOD_TOKEN)

    @property
    def pad_id(self) -> int:
        """Padding id; GPT-2 has no pad token, so it is the EOD id."""
        return self.eod_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (50,257 for GPT-2)."""
        return self._special.get_vocab_size(with_added_tokens=True)

    @property
    def concatenates(self) -> bool:
        """Whether the text of ids a + b is the text of a followed by that of b wherever a's text
        ends in a whole character (no trailing U+FFFD): true of byte-level decoders (GPT-2's), whose
        text is the UTF-8 of the tokens' bytes laid end to end; a server then decodes only the
        tokens after the last such point (``serve/text.py``)."""
        return isinstance(self._special.decoder, decoders.ByteLevel)

    def _backend(self, allow_special: bool) -> tokenizers.Tokenizer:
        return self._special if allow_special else self._plain

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        pieces = _split_long(text) if self._cut_long else [text]
        backend = self._backend(allow_special)
        if len(pieces) == 1:
            return backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for enc in _batch_encode(backend, pieces):
            ids.extend(enc.ids)
        return ids

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the library's thread pool."""
        pieces, owner = [], []
        for i, text in enumerate(texts):
            for piece in (_split_long(text) if self._cut_long else [text]):
                pieces.append(piece)
                owner.append(i)
        out: list[list[int]] = [[] for _ in texts]
        encs = _batch_encode(self._backend(allow_special), pieces)
        for i, enc in zip(owner, encs):
            out[i].extend(enc.ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; the EOD id decodes to ``<|endoftext|>``."""
        return self._special.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def find_tokenizer(*dirs: str):
    """The tokenizer stored in the first of ``dirs`` that has one, or None."""
    for d in dirs:
        if d and os.path.isdir(d) and any(os.path.isfile(os.path.join(d, f))
                                         for f in ("tokenizer.json", "vocab.json", "encoder.json")):
            return Tokenizer.load(d)
    return None


def fixed_prompt(ids: list[int], length: int, eod: int) -> list[int]:
    """``ids`` left-filled with ``eod`` or cut at the start to ``length`` tokens (0: unchanged)."""
    if length <= 0:
        return list(ids)
    return [eod] * (length - len(ids)) + list(ids[-length:])


def encode_prompts(tokenizer, prompts: Sequence[str], prompt_tokens: int = 0) -> list[list[int]]:
    """Token ids of ``prompts`` as finetuning sees them (``fixed_prompt`` when ``prompt_tokens``): the
    one encoding of text prompts for a model finetuned with ``Finetune.prompt_tokens``,
    used by `gptc finetune`, `gptc generate`, ``Generator`` and serve."""
    return [fixed_prompt(p, prompt_tokens, tokenizer.eod_id) for p in tokenizer.encode_batch(list(prompts))]
