#!/usr/bin/env bash
# FleetX name (auto-parallel engine). Paddle's static distributed path does not run here, so this is
# the dynamic-graph sharding recipe (pretrain_gpt_6.7B_sharding16.sh; set MASTER and NNODES).
set -euo pipefail
exec "$(dirname "$0")/pretrain_gpt_6.7B_sharding16.sh" "$@"
