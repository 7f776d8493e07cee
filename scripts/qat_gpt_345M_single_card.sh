#!/usr/bin/env bash
# QAT of a pretrained GPT-345M on one card (FleetX recipe), then int8 export. Extra arguments pass
# through, e.g.
#   scripts/qat_gpt_345M_single_card.sh --model CKPT -o Data.data_prefix=[data/my_corpus_text_document] \
#       --eval-wikitext ../shared/data/wikitext-2/wiki.test.raw --skip-list output/sens/skip_list.txt
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc qat -c "$CONFIGS"/qat_gpt_345M_single_card.yaml "$@"
