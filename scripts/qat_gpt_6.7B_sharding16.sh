#!/usr/bin/env bash
# FleetX name. gpt-compress QAT runs in one process (FleetX shards it over 16 GPUs): the 345M QAT
# recipe on a GPT-6.7B checkpoint (--model), with a smaller micro batch. Needs the memory for
# 6.7B parameters + Adam state on one machine.
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc qat -c "$CONFIGS"/qat_gpt_345M_single_card.yaml -o Engine.micro_batch_size=1 \
    -o Global.output_dir=output/qat_gpt_6.7B "$@"
