"""The speculative-decoding options of `gptc infer` and `gptc generate` (``model/speculative.py``)."""
from __future__ import annotations

from ..errors import InputError
from ..model.speculative import DRAFT_TOKENS


def add_draft_arguments(parser) -> None:
    """--draft, --num-speculative-tokens, --fixed-k, --measure-speedup."""
    parser.add_argument("--draft", default=None,
                        help="speculative decoding: 'ngram' (prompt lookup, no model), 'auto' (the draft an "
                             "export's manifest records: gptc pipeline) or a model directory with the same "
                             "tokenizer, run on the same backend (greedy output unchanged; sampled output has "
                             "the same distribution)")
    parser.add_argument("--num-speculative-tokens", type=int, default=DRAFT_TOKENS,
                        help=f"draft tokens proposed per target step, at most (default {DRAFT_TOKENS})")
    parser.add_argument("--fixed-k", action="store_true",
                        help="always propose --num-speculative-tokens (default: fewer, or none for a while, "
                             "when proposals are rejected)")
    parser.add_argument("--measure-speedup", action="store_true",
                        help="with --draft: also generate without it and report the speed-up (and, greedy, "
                             "whether the outputs are equal)")


def check_draft_arguments(args) -> None:
    """One-line errors for bad values."""
    if args.num_speculative_tokens < 1:
        raise InputError(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if args.measure_speedup and not args.draft:
        raise InputError("--measure-speedup needs --draft")


def speedup_report(with_draft: tuple[list, float], without: tuple[list, float], greedy: bool) -> dict:
    """JSON figures of ``--measure-speedup``: (sequences, seconds) with and without the draft."""
    report = {"seconds_without_draft": round(without[1], 3),
              "speedup": round(without[1] / max(with_draft[1], 1e-9), 3)}
    if greedy:
        report["same_output"] = with_draft[0] == without[0]
    return report
