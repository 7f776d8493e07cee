#!/usr/bin/env bash
# FleetX name: export a QAT checkpoint (OUTPUT/quantized) as int8 programs. E.g.
#   scripts/export_qat_gpt_345M_single_card.sh --model output/qat_gpt_345M_single_card/quantized --output qat_export
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc export "$@"
