#!/usr/bin/env bash
# Post-training quantization of a pretrained GPT-345M (calibration, no training), then int8 export.
# Extra arguments pass through, e.g.
#   scripts/ptq_gpt_345M_single_card.sh --model CKPT -o Data.data_prefix=[data/my_corpus_text_document] \
#       -o Quant.observer=percentile --eval-wikitext ../shared/data/wikitext-2/wiki.test.raw
# Weight-only int4 for the decode path: -o 'Quant.targets=[]' -o 'Quant.weight_only=["*"]' -o Quant.weight_bits=4
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc ptq -c "$CONFIGS"/qat_gpt_345M_single_card.yaml \
    -o Global.output_dir=output/ptq_gpt_345M_single_card "$@"
