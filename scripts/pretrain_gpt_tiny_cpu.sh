#!/usr/bin/env bash
# A tiny GPT that trains in minutes on 2 CPU cores. Needs a preprocessed dataset:
#   gptc train-tokenizer --input corpus.txt --vocab-size 4096 --output-dir data/tok
#   gptc preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer-dir data/tok
#   scripts/pretrain_gpt_tiny_cpu.sh -o Data.data_prefix=[data/corpus_text_document] -o Data.tokenizer_dir=data/tok
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc pretrain -c "$CONFIGS"/pretrain_gpt_tiny_cpu.yaml "$@"
