#!/usr/bin/env bash
# FleetX name. gpt-compress QAT runs in one process (FleetX spreads it over 8 model-parallel GPUs):
# this is the 345M QAT recipe of qat_gpt_345M_single_card.sh; partition the int8 export afterwards
# with `gptc partition` if you need tensor-parallel serving.
set -euo pipefail
exec "$(dirname "$0")/qat_gpt_345M_single_card.sh" "$@"
