#!/usr/bin/env bash
# Tokenize a JSONL/text corpus into a Megatron indexed dataset with the GPT-2 vocabulary.
#   scripts/preprocess_corpus.sh --input corpus.jsonl --output-prefix data/corpus --tokenizer-dir path/to/gpt2_bpe
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc preprocess --append-eod --workers "${WORKERS:-1}" "$@"
