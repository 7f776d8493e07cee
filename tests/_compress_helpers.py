"""Shared by test_prune.py and test_distill.py: a gpt-tiny teacher pretrained with `gptc pretrain`
on the train split of the tinyshakespeare fixture (the valid split stays held out), built once per
pytest session, and an in-process `gptc` runner that returns a command's JSON summary."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

TEACHER_STEPS = 600
SEQ = 64
BATCH = 16


def data_overrides(shakespeare, out, **engine) -> list[str]:
    """`-o` pairs for gpt-tiny runs on the fixture: seq 64, split 95/5, batch 16, no dropout."""
    tok_dir, prefix = shakespeare
    eng = {"global_batch_size": BATCH, "micro_batch_size": BATCH, "eval_freq": 0, "eval_iters": 4,
           "save_steps": 0, "logging_freq": 0, **engine}
    pairs = [f"Data.seq_length={SEQ}", f"Data.data_prefix=[{prefix}]", f"Data.tokenizer_dir={tok_dir}",
             "Data.split=[95,5,0]", f"Global.output_dir={out}", *[f"Engine.{k}={v}" for k, v in eng.items()]]
    return [x for p in pairs for x in ("-o", p)]


def gptc(*argv: str) -> dict:
    """Run `gptc ARGV` in this process (no second Paddle start-up); its JSON summary line."""
    from gpt_compress.cli import main

    buf = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buf):
        try:
            main(list(argv))
        except SystemExit as e:
            code = e.code or 0
    out = buf.getvalue().strip().splitlines()
    assert code == 0 and out, f"gptc {' '.join(argv)} exited {code}: {out[-5:]}"
    return json.loads(out[-1])


def teacher_ckpt(tmp_path_factory, shakespeare) -> str:
    """Checkpoint of a gpt-tiny pretrained for ``TEACHER_STEPS`` steps (cached per session)."""
    base = tmp_path_factory.getbasetemp() / "gptc_compress_teacher"
    ckpt = base / "checkpoints" / f"step_{TEACHER_STEPS:08d}"
    if not (base / "DONE").exists():
        gptc("pretrain", "--no-progress", "-o", "Model.preset=gpt-tiny", "-o", "Model.hidden_dropout_prob=0.0",
             "-o", "Model.attention_probs_dropout_prob=0.0", "-o", "Optimizer.lr.max_lr=3e-3",
             "-o", "Optimizer.lr.min_lr=3e-4", "-o", "Optimizer.lr.warmup_rate=0.05",
             *data_overrides(shakespeare, base, max_steps=TEACHER_STEPS))
        (base / "DONE").write_text("ok")
    assert Path(ckpt).is_dir()
    return str(ckpt)
