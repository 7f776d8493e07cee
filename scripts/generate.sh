#!/usr/bin/env bash
# Generate from a checkpoint:  scripts/generate.sh --model ckpt --prompt "Once upon a time"
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m gpt_compress generate -c configs/generate_sampling.yaml "$@"
