"""`gptc infer`: generate with an exported model (Paddle Inference / onnxruntime) or a checkpoint
(dygraph), reporting tokens/s."""
from __future__ import annotations

import sys

from ._common import add_config_arguments, fail, generation_config, print_json
from ._speculative import add_draft_arguments, check_draft_arguments, speedup_report
from .generate import parse_prompt_ids, read_prompts_jsonl


def add_arguments(parser) -> None:
    add_config_arguments(parser)  # Generation.* settings: -o Generation.decode_strategy=beam_search
    parser.add_argument("--model-dir", required=True,
                        help="exported directory (paddle/onnx) or checkpoint directory (dygraph)")
    parser.add_argument("--backend", choices=("paddle", "onnx", "dygraph"), default="paddle")
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=[],
                        help="prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--input-file", help="JSONL file with one {\"prompt\": ...} per line")
    parser.add_argument("--tokenizer-dir", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--truncate", action="store_true",
                        help="keep the last tokens of a prompt longer than the context instead of failing")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads of every program (0: the backend's measured defaults)")
    parser.add_argument("--no-fused", action="store_true",
                        help="paddle: run the unfused programs, not the fused CPU operators (kernels/)")
    parser.add_argument("--no-stream", action="store_true", help="print only the final text")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the model files")
    add_draft_arguments(parser)


def backend_options(args) -> dict:
    """The ``Generator.from_dir`` options of ``--backend``, ``--threads`` and ``--no-fused``."""
    if args.backend == "onnx":
        return {"threads": args.threads}
    out = {"fused": False} if args.backend == "paddle" and args.no_fused else {}
    if args.backend == "paddle" and args.threads:
        from ..inference.predictor import ProgramOptions, default_options

        out["threads"] = args.threads  # the fused program's
        out["options"] = {role: ProgramOptions(**{**opts.__dict__, "threads": args.threads})
                          for role, opts in default_options().items()}
    return out


def run(args) -> int:
    from ..inference.manifest import InputError, ModelDirError
    from ..inference.runner import Generator

    cfg = generation_config(args)
    gen_cfg = cfg.generation
    try:
        texts = list(args.prompt) + (read_prompts_jsonl(args.input_file) if args.input_file else [])
    except (OSError, ValueError) as e:
        return fail(str(e))
    ids = [parse_prompt_ids(p) for p in args.prompt_ids]
    check_draft_arguments(args)
    if not texts and not ids:
        return fail("give --prompt, --prompt-ids or --input-file")
    from ..memory import check_fits, model_config_of

    sized = model_config_of(args.model_dir)
    if sized is not None:
        check_fits("infer", sized, batch=len(texts) + len(ids), seq=1, what=args.model_dir)
    try:
        gen = Generator.from_dir(args.model_dir, backend=args.backend, tokenizer=args.tokenizer_dir,
                                 verify=not args.no_verify, **backend_options(args))
        prompts = gen.encode(texts) + ids if texts else ids  # text: fixed as in finetuning (Generator.encode)
        if texts and gen.prompt_tokens:
            print(f"infer: text prompts fixed to {gen.prompt_tokens} tokens as in finetuning", file=sys.stderr)
        stream = (len(prompts) == 1 and gen.tokenizer is not None and not args.no_stream
                  and gen_cfg.decode_strategy != "beam_search")
        if stream:
            sys.stdout.write(texts[0] if texts else gen.tokenizer.decode(prompts[0]))
            emitted: list[int] = []
            shown = [""]

            def on_tokens(step):
                emitted.append(int(step[0]))
                text = gen.tokenizer.decode(emitted)
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    sys.stdout.write(text[len(shown[0]):])
                    sys.stdout.flush()
                    shown[0] = text
        else:
            on_tokens = None
        draft, path = None, gen.recorded_draft if args.draft == "auto" else args.draft
        if args.draft != "ngram" and path:  # loaded like the model: same backend and options
            draft = Generator.from_dir(path, backend=args.backend, verify=not args.no_verify,
                                       **backend_options(args))
        spec = dict(draft=draft or args.draft, draft_tokens=args.num_speculative_tokens,
                    adaptive=not args.fixed_k) if args.draft else {}
        out = gen.generate(prompts, config=gen_cfg, truncate=args.truncate, on_tokens=on_tokens, **spec)
        if args.measure_speedup:
            plain = gen.generate(prompts, config=gen_cfg, truncate=args.truncate)
    except (InputError, ModelDirError) as e:
        return fail(str(e))
    if stream:
        sys.stdout.write("\n")
    results = []
    for i, seq in enumerate(out.sequences):
        item = {"prompt_tokens": out.prompt_tokens[i], "new_tokens": seq}
        if out.texts is not None:
            item["text"] = out.texts[i]
            if not stream:
                print((texts[i] if i < len(texts) else "") + out.texts[i])
        if out.scores is not None:
            item["score"] = out.scores[i]
        results.append(item)
    summary = {"backend": args.backend, "results": results, "seconds": round(out.seconds, 3),
               "new_tokens": sum(len(s) for s in out.sequences), "tokens_per_s": round(out.tokens_per_s, 1)}
    if out.speculation is not None:
        summary["speculation"] = {"draft": args.draft, **out.speculation}
        if args.measure_speedup:
            summary["speculation"].update(speedup_report((out.sequences, out.seconds), (plain.sequences, plain.seconds),
                                                         gen_cfg.decode_strategy == "greedy"))
    print_json(summary)
    return 0
