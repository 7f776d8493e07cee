#!/usr/bin/env bash
# FleetX name: evaluate the int8 export of a QAT run (OUTPUT/int8 of qat_gpt_345M_single_card.sh). E.g.
#   scripts/eval_qat_gpt_345M_single_card.sh --model output/qat_gpt_345M_single_card/int8 --task lambada --data lambada_test.jsonl
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc eval "$@"
