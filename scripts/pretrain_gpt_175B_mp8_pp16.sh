#!/usr/bin/env bash
# GPT-175B, tensor parallel 8 within each node x pipeline 16 across nodes: 16 nodes x 8 GPUs.
# Run the same command on all 16 nodes with MASTER=IP:PORT of node 0, e.g.
#   MASTER=10.0.0.1:36789 scripts/pretrain_gpt_175B_mp8_pp16.sh -o Data.data_prefix=[data/corpus_text_document]
set -euo pipefail
source "$(dirname "$0")/launch.bash"
launch_pretrain pretrain_gpt_175B_mp8_pp16.yaml --master "${MASTER:?set MASTER=IP:PORT of node 0}" \
    --nnodes "${NNODES:-16}" --devices 0,1,2,3,4,5,6,7 --log_dir output/gpt_175B_mp8_pp16/logs -- "$@"
