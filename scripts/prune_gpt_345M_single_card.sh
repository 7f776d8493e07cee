#!/usr/bin/env bash
# Prune 25% of the heads and FFN channels of a GPT-345M checkpoint (Taylor importance), e.g.
#   scripts/prune_gpt_345M_single_card.sh --model ckpt --output pruned \
#       -o Data.data_prefix=[data/my_corpus_text_document]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m gpt_compress prune -c configs/prune_distill_gpt_345M_single_card.yaml "$@"
