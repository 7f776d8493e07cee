#!/usr/bin/env bash
# FleetX name (auto-parallel engine): the 345M single-card recipe with the transformer body run
# as a static program (Engine.to_static), the one-process counterpart of FleetX's static engine.
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc pretrain -c "$CONFIGS"/pretrain_gpt_345M_single_card.yaml -o Engine.to_static=true "$@"
