#!/usr/bin/env bash
# FleetX name (auto-parallel engine): GPT-1.3B on one card with a static transformer body.
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc pretrain -c "$CONFIGS"/pretrain_gpt_1.3B_dp8.yaml -o Parallel.dp_degree=1 -o Engine.global_batch_size=8 \
    -o Engine.to_static=true -o Global.output_dir=output/auto_gpt_1.3B_single_card "$@"
