#!/usr/bin/env bash
# FleetX name: GPT-1.3B on one card: the dp8 recipe without data parallelism (global batch 8).
# Extra arguments pass through (-o Data.data_prefix=[...] -o Data.tokenizer_dir=...).
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc pretrain -c "$CONFIGS"/pretrain_gpt_1.3B_dp8.yaml -o Parallel.dp_degree=1 -o Engine.global_batch_size=8 \
    -o Global.output_dir=output/gpt_1.3B_single_card "$@"
