#!/usr/bin/env bash
# Import a local Hugging Face GPT-2 directory:  scripts/convert_hf_gpt2.sh --from-hf hf_dir --output ckpt
# Export ours to Hugging Face format:           scripts/convert_hf_gpt2.sh --to-hf ckpt --output hf_dir
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m gpt_compress convert "$@"
