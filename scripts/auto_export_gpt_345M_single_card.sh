#!/usr/bin/env bash
# FleetX name (auto-parallel engine export): the same export as export_gpt_345M_single_card.sh.
set -euo pipefail
exec "$(dirname "$0")/export_gpt_345M_single_card.sh" "$@"
