#!/usr/bin/env bash
# Finetune a pretrained checkpoint on a GLUE task (FleetX single_finetune recipe), e.g.
#   scripts/finetune_glue.sh --task SST-2 --data-dir glue/SST-2 --model ckpt --epochs 3
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc finetune-glue \
    -o Engine.global_batch_size=32 -o Engine.micro_batch_size=32 -o Engine.eval_freq=0 \
    -o Engine.save_steps=0 -o Optimizer.lr.max_lr=2e-5 -o Optimizer.lr.min_lr=0 \
    -o Optimizer.lr.warmup_rate=0.1 -o Optimizer.lr.decay_style=linear -o Global.output_dir=output/glue "$@"
