"""WikiText perplexity with the FleetX/Megatron protocol (see shared EVAL_PROTOCOLS.md).

Windows of ``seq_len`` inputs start every ``stride`` tokens; every window but the first scores
only its last ``stride`` positions (overlapping evaluation: each token scored once, with as
much context as the window allows). Reports token-level perplexity and word-level perplexity
adjusted by the token/word ratio, as FleetX does. Logits are taken only at the scored positions
(``scoring.score_positions``): an overlapping window's context costs the body, not the head.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from ..errors import DataError, InputError  # noqa: F401
from ..fileio import write_text_atomic
from .scoring import score_positions

INPUT_FORMATS = ("tokens", "raw", "raw-hf-rows")


def wikitext_detokenize(s: str) -> str:
    """Undo WikiText's tokenisation (``@-@``, spaced punctuation), as Megatron/FleetX do."""
    s = s.replace("s '", "s'")
    s = s.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    s = s.replace(" : ", ": ").replace(" ; ", "; ").replace(" . ", ". ").replace(" ! ", "! ")
    s = s.replace(" ? ", "? ").replace(" , ", ", ")
    s = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", s)
    s = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", s)
    s = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", s)
    s = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', s)
    s = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", s)
    s = s.replace("= = = =", "====").replace("= = =", "===").replace("= =", "==")
    s = s.replace(" " + chr(176) + " ", chr(176))
    s = s.replace(" \n", "\n").replace("\n ", "\n")
    s = s.replace(" N ", " 1 ").replace(" 's", "'s")
    return s


def write_text_prefix(src: str, max_chars: int, path: str) -> str:
    """The first ``max_chars`` characters of ``src``, cut after its last full line, written
    atomically to ``path`` (returned). ``max_chars`` 0: ``src`` itself, nothing written."""
    if not max_chars:
        return src
    with open(src, encoding="utf-8", newline="") as f:
        text = f.read(max_chars)
    cut = text.rfind("\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, text[: cut + 1] if cut > 0 else text, newline="")
    return path


def read_wikitext(path: str, input_format: str) -> tuple[str, int]:
    """(text to tokenize, number of original space-split words) for ``input_format``:
    ``tokens`` (wiki.test.tokens: detokenized first), ``raw`` (the file as one string) or
    ``raw-hf-rows`` (Hugging Face's rows joined with blank lines)."""
    if input_format not in INPUT_FORMATS:
        raise InputError(f"input format must be one of {INPUT_FORMATS}, got {input_format!r}")
    with open(path, encoding="utf-8", newline="") as f:
        if input_format == "raw-hf-rows":
            text = "\n\n".join("" if line == " \n" else line for line in f)
        else:
            text = f.read()
    n_words = len(text.strip().split(" "))
    if input_format == "tokens":
        text = wikitext_detokenize(text)
    return text, n_words


@dataclass
class WikitextResult:
    """Perplexity figures and the protocol that produced them."""

    protocol: str
    input_format: str
    seq_len: int
    stride: int
    num_windows: int
    num_original_tokens: int
    num_tokenized_tokens: int
    num_scored: int
    avg_loss: float
    ppl: float
    token_ratio: float
    adjusted_ppl: float

    def to_dict(self) -> dict:
        return asdict(self)


def window_count(num_tokens: int, stride: int) -> int:
    """FleetX: max(ceil(max(num_tokens - 1 - stride, 0) / stride) + 1, 1)."""
    return max(math.ceil(max(num_tokens - 1 - stride, 0) / stride) + 1, 1)


def build_windows(tokens: np.ndarray, seq_len: int, stride: int, pad_id: int):
    """Yield (inputs (seq_len,), labels (seq_len,), loss_mask (seq_len,)) per window."""
    for i in range(window_count(len(tokens), stride)):
        chunk = tokens[i * stride: i * stride + seq_len + 1]
        pad = seq_len + 1 - len(chunk)
        if pad > 0:
            chunk = np.concatenate([chunk, np.full(pad, pad_id, dtype=tokens.dtype)])
        inputs, labels = chunk[:-1], chunk[1:]
        mask = (inputs != pad_id).astype(np.float64)  # padding / EOS inputs are not scored
        if i > 0 and stride != seq_len:
            mask[:-stride] = 0.0  # earlier positions were scored by the previous window
        yield inputs, labels, mask


def evaluate_wikitext(backend, tokenizer, path: str, input_format: str = "raw", seq_len: int = 1024,
                      stride: int | None = None, batch_size: int = 4, progress: bool = True) -> WikitextResult:
    """Perplexity of ``backend`` on a WikiText file (see module docstring)."""
    stride = stride or seq_len
    if not 0 < stride <= seq_len:
        raise InputError(f"stride must be in (0, seq_len={seq_len}], got {stride}")
    text, n_words = read_wikitext(path, input_format)
    tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if len(tokens) < 2:
        raise DataError(f"{path}: fewer than two tokens to score")
    windows = list(build_windows(tokens, seq_len, stride, tokenizer.eod_id))
    total, scored = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc="wikitext", disable=not progress):
        group = windows[start:start + batch_size]
        ids = np.stack([w[0] for w in group])
        labels = np.stack([w[1] for w in group])
        mask = np.stack([w[2] for w in group])
        # Logits only at the scored positions: strided windows skip the masked context.
        lp, _ = score_positions(backend, ids, labels, mask > 0)
        total += float(-lp.sum())
        scored += len(lp)
    avg = total / (len(tokens) - 1)
    ratio = (len(tokens) - 1) / max(n_words - 1, 1)
    return WikitextResult(
        protocol="FleetX/Megatron LM_Eval_Dataset: sum of scored CE / (num_tokenized - 1); windows of seq_len "
                 "inputs every stride tokens, later windows score their last stride positions; EOS/pad inputs "
                 "unscored; adjusted_ppl = exp(avg_loss * token_ratio)",
        input_format=input_format, seq_len=seq_len, stride=stride, num_windows=len(windows),
        num_original_tokens=n_words, num_tokenized_tokens=len(tokens), num_scored=scored, avg_loss=avg,
        ppl=math.exp(min(avg, 700)), token_ratio=ratio, adjusted_ppl=math.exp(min(avg * ratio, 700)))
