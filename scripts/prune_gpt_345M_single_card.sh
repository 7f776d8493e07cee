#!/usr/bin/env bash
# Prune 25% of the heads and FFN channels of a GPT-345M checkpoint (Taylor importance), e.g.
#   scripts/prune_gpt_345M_single_card.sh --model ckpt --output pruned \
#       -o Data.data_prefix=[data/my_corpus_text_document]
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc prune -c "$CONFIGS"/prune_distill_gpt_345M_single_card.yaml "$@"
