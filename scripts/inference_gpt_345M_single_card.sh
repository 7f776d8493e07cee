#!/usr/bin/env bash
# FleetX name: generate with an exported model (scripts/export_gpt_345M_single_card.sh). E.g.
#   scripts/inference_gpt_345M_single_card.sh --model-dir gpt_345M_export --prompt "Hi, GPT2. Tell me who Jack Ma is."
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc infer "$@"
