#!/usr/bin/env bash
# Generate from a checkpoint:  scripts/generate.sh --model ckpt --prompt "Once upon a time"
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc generate -c "$CONFIGS"/generate_sampling.yaml "$@"
