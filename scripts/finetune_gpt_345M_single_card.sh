#!/usr/bin/env bash
# FleetX name: finetune a pretrained checkpoint on a GLUE task (same settings as finetune_glue.sh). E.g.
#   scripts/finetune_gpt_345M_single_card.sh --task SST-2 --data-dir glue/SST-2 --model CKPT
set -euo pipefail
exec "$(dirname "$0")/finetune_glue.sh" "$@"
