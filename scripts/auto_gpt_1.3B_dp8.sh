#!/usr/bin/env bash
# FleetX name (auto-parallel engine). Paddle's static distributed path does not run here, so this is
# the dynamic-graph dp8 recipe (pretrain_gpt_1.3B_dp8.sh).
set -euo pipefail
exec "$(dirname "$0")/pretrain_gpt_1.3B_dp8.sh" "$@"
