#!/usr/bin/env bash
# Pretrain GPT-345M on one card (FleetX recipe). Extra arguments pass through, e.g.
#   scripts/pretrain_gpt_345M_single_card.sh -o Data.data_prefix=[data/my_corpus_text_document] \
#       -o Data.tokenizer_dir=data/gpt2_bpe
# On a CPU-only machine add -o Engine.mix_precision=fp32 (AMP needs a GPU).
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc pretrain -c "$CONFIGS"/pretrain_gpt_345M_single_card.yaml "$@"
