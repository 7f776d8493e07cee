#!/usr/bin/env bash
# Distill a pruned GPT-345M from the unpruned one on one card, e.g.
#   scripts/distill_gpt_345M_single_card.sh -o Distill.teacher=ckpt -o Distill.student=pruned \
#       -o Data.data_prefix=[data/my_corpus_text_document]
# On a CPU-only machine add -o Engine.mix_precision=fp32 (AMP needs a GPU).
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc distill -c "$CONFIGS"/prune_distill_gpt_345M_single_card.yaml "$@"
