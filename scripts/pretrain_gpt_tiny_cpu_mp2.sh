#!/usr/bin/env bash
# pretrain_gpt_tiny_cpu.sh as 2 CPU processes (mp2 over gloo, one thread each): the same training as one
# process. Needs a preprocessed dataset (see pretrain_gpt_tiny_cpu.sh):
#   scripts/pretrain_gpt_tiny_cpu_mp2.sh -o Data.data_prefix=[data/corpus_text_document] -o Data.tokenizer_dir=data/tok
set -euo pipefail
source "$(dirname "$0")/launch.bash"
export OMP_NUM_THREADS=${OMP_NUM_THREADS_PER_RANK:-1}
launch_pretrain pretrain_gpt_tiny_cpu_mp2.yaml --nproc_per_node 2 --log_dir output/gpt_tiny_cpu_mp2/logs -- "$@"
