#!/usr/bin/env bash
# GPT-6.7B, ZeRO stage 2 over 16 GPUs: 2 nodes x 8. Run the same command on both nodes with
# MASTER=IP:PORT of node 0 (any free port), e.g.
#   MASTER=10.0.0.1:36789 scripts/pretrain_gpt_6.7B_sharding16.sh -o Data.data_prefix=[data/corpus_text_document]
set -euo pipefail
source "$(dirname "$0")/launch.bash"
launch_pretrain pretrain_gpt_6.7B_sharding16.yaml --master "${MASTER:?set MASTER=IP:PORT of node 0}" \
    --nnodes "${NNODES:-2}" --devices 0,1,2,3,4,5,6,7 --log_dir output/gpt_6.7B_sharding16/logs -- "$@"
