"""`gptc generate`: generate text from a checkpoint (dygraph backend). Text prompts of a model
finetuned with ``Finetune.prompt_tokens`` are fixed to that length (``data/tokenizer.py:encode_prompts``);
``--prompt-ids`` are used as given."""
from __future__ import annotations

import sys
import time

from ..errors import DataError, InputError
from ..fileio import jsonl_strings
from ._common import add_config_arguments, fail, find_tokenizer, generation_config, print_json
from ._speculative import add_draft_arguments, check_draft_arguments, speedup_report


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=[],
                        help="prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--input-file", help="JSONL file with one {\"prompt\": ...} per line")
    parser.add_argument("--tokenizer-dir", default="", help="tokenizer directory (default: the checkpoint's)")
    parser.add_argument("--no-stream", action="store_true", help="print only the final text")
    add_draft_arguments(parser)


def read_prompts_jsonl(path: str) -> list[str]:
    """Prompts from a JSONL file; a bad line is reported with file and line number."""
    try:
        prompts = [prompt for _, prompt in jsonl_strings(path, "prompt")]
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"--input-file {path}: {e.strerror}") from None
    if not prompts:
        raise DataError(f"--input-file {path} holds no prompts")
    return prompts


def parse_prompt_ids(text: str) -> list[int]:
    """``"464,3290"`` -> ``[464, 3290]``; the error names the bad item (an empty one too: ``1,,2``
    is a typo, not the prompt ``1,2``)."""
    ids = []
    for n, item in enumerate(text.split(","), 1):
        if not item.strip():
            raise InputError(f"--prompt-ids {text!r}: item {n} is empty; give comma-separated token ids "
                             "like 464,3290")
        try:
            ids.append(int(item))
        except ValueError:
            raise InputError(f"--prompt-ids {text!r}: {item.strip()!r} is not an integer token id") from None
    return ids


def run(args) -> int:
    from ..checkpoint import load_model, read_prompt_tokens
    from ..data.tokenizer import encode_prompts
    from ..inference.dygraph import DygraphBackend
    from ..inference.runner import special_ids
    from ..model.generation import check_logit_bias, generate

    cfg = generation_config(args)
    gen = cfg.generation
    check_draft_arguments(args)
    model = load_model(args.model)
    if not hasattr(model, "logits"):
        raise InputError(f"{args.model} holds a sequence classifier (finetune-glue output); it cannot generate text")
    tok = find_tokenizer(args.tokenizer_dir, args.model)
    texts = list(args.prompt) + (read_prompts_jsonl(args.input_file) if args.input_file else [])
    if texts and tok is None:
        return fail(f"{args.model} has no tokenizer; pass --tokenizer-dir or use --prompt-ids")
    fixed = read_prompt_tokens(args.model) if texts else 0  # finetuned with fixed-length prompts
    if fixed:
        print(f"generate: text prompts fixed to {fixed} tokens as in finetuning (config.json prompt_tokens)",
              file=sys.stderr)
    prompts = [parse_prompt_ids(p) for p in args.prompt_ids]  # checked before the text is encoded
    if texts:  # a checkpoint without a tokenizer (`gptc init` writes one) still takes token ids
        prompts = encode_prompts(tok, texts, fixed) + prompts
    if not prompts:
        return fail("give --prompt, --prompt-ids or --input-file")
    limit = model.config.max_position_embeddings
    for p in prompts:
        if len(p) + gen.max_new_tokens > limit:
            return fail(f"prompt of {len(p)} tokens + {gen.max_new_tokens} new tokens exceeds the model's "
                        f"context of {limit}")
        if not p:
            return fail("empty prompt")
        if max(p) >= model.config.vocab_size or min(p) < 0:
            return fail(f"prompt token ids must be in [0, {model.config.vocab_size})")
    check_logit_bias(gen.logit_bias, model.config.vocab_size)
    eos, pad = special_ids(gen, model.config.eos_token_id, model.config.pad_token_id, model.config.vocab_size)
    stream = (len(prompts) == 1 and tok is not None and not args.no_stream and gen.decode_strategy != "beam_search"
              and gen.best_of == 1)
    emitted: list[int] = []

    def on_tokens(step):
        emitted.append(int(step[0]))
        if stream:
            sys.stdout.write(tok.decode([emitted[-1]]))
            sys.stdout.flush()

    if stream:
        sys.stdout.write(texts[0] if texts else tok.decode(prompts[0]))
    backend, spec = DygraphBackend(model), None
    t0 = time.perf_counter()
    if args.draft:
        from ..model.speculative import ModelDraft, NgramDraft, speculative_generate

        draft = NgramDraft() if args.draft == "ngram" else ModelDraft(DygraphBackend(_draft_model(args.draft, model)))
        t0 = time.perf_counter()
        out, stats = speculative_generate(backend, draft, prompts, gen, eos, pad, args.num_speculative_tokens,
                                          not args.fixed_k, on_tokens)
        spec = {"draft": args.draft, **stats.as_dict()}
    else:
        out = generate(backend, prompts, gen, eos, pad, on_tokens=on_tokens)
    seconds = time.perf_counter() - t0
    if spec is not None and args.measure_speedup:
        t1 = time.perf_counter()
        plain = generate(backend, prompts, gen, eos, pad)
        spec.update(speedup_report((out.sequences, seconds), (plain.sequences, time.perf_counter() - t1),
                                   gen.decode_strategy == "greedy"))
    if stream:
        sys.stdout.write("\n")
    results = []
    for i, seq in enumerate(out.sequences):
        item = {"prompt_tokens": len(prompts[i]), "new_tokens": seq}
        if tok is not None:
            item["text"] = tok.decode(seq)
            if not stream:
                print((texts[i] if i < len(texts) else "") + item["text"])
        results.append(item)
    n_new = sum(len(s) for s in out.sequences)
    summary = {"results": results, "seconds": round(seconds, 3), "tokens_per_s": round(n_new / seconds, 1)}
    if spec is not None:
        summary["speculation"] = spec
    print_json(summary)
    return 0


def _draft_model(path: str, model):
    """The checkpoint at ``path`` as a draft of ``model``: a causal LM of the same vocabulary."""
    from ..checkpoint import load_model

    draft = load_model(path)
    if not hasattr(draft, "logits"):
        raise InputError(f"--draft {path} holds a sequence classifier; a draft must generate text")
    if draft.config.vocab_size != model.config.vocab_size:
        raise InputError(f"--draft {path} has a vocabulary of {draft.config.vocab_size} tokens, the model "
                         f"{model.config.vocab_size}: a draft needs the same tokenizer")
    return draft
