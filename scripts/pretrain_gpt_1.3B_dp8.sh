#!/usr/bin/env bash
# GPT-1.3B, data parallel on the 8 GPUs of one node (FleetX recipe). Extra arguments pass through:
#   scripts/pretrain_gpt_1.3B_dp8.sh -o Data.data_prefix=[data/corpus_text_document] -o Data.tokenizer_dir=data/gpt2_bpe
set -euo pipefail
source "$(dirname "$0")/launch.bash"
launch_pretrain pretrain_gpt_1.3B_dp8.yaml --devices 0,1,2,3,4,5,6,7 --log_dir output/gpt_1.3B_dp8/logs -- "$@"
