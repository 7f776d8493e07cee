#!/usr/bin/env bash
# Import a local Hugging Face GPT-2 directory:  scripts/convert_hf_gpt2.sh --from-hf hf_dir --output ckpt
# Export ours to Hugging Face format:           scripts/convert_hf_gpt2.sh --to-hf ckpt --output hf_dir
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc convert "$@"
