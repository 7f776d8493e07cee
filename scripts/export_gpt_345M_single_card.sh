#!/usr/bin/env bash
# FleetX name: export a trained checkpoint for inference (Paddle Inference + ONNX). E.g.
#   scripts/export_gpt_345M_single_card.sh --model output/gpt_345M/checkpoints/step_00500000 --output gpt_345M_export
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc export "$@"
