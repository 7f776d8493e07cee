#!/usr/bin/env bash
# ModelScope's poetry example on CPU: a byte-level BPE and a small GPT pretrained on modern
# Chinese text (chinese_fortunes.jsonl), finetuned on Tang poems (tang300.jsonl) with
# "《title》author" as the prompt and the poem as the response, then a poem generated from a title.
#   DATA=../shared/data/chinese OUT=output/poetry scripts/finetune_poetry.sh [-o Section.key=value ...]
# Extra arguments go to `gptc finetune`. PRETRAIN_STEPS / FINETUNE_STEPS / TITLE change the rest.
# The defaults are the recipe tests/test_finetune.py measures (configs/finetune_poetry.yaml:
# an 8,192-token BPE with --split-cjk, i.e. one token a Chinese character; gpt-tiny at width 32;
# 80 pretraining steps of 16 x 128; 600 finetuning steps of 1 packed row at LR 1e-2, prompts fixed
# at 24 tokens; 30 poems held out after a seeded shuffle; sampling at temperature 0.7, seed 0).
# $OUT/finetune/finetune_eval.json reports the held-out perplexity before/after and, for the
# generated poems, BLEU/chrF/ROUGE-L and the verse form rate (generation.form: clauses of 5 or 7
# characters ending in ，or 。; generation.reference_form: the same for the real poems).
# FINETUNE_STEPS=1500 is the longer run the README quotes.
# LoRA instead of a full finetune: add -o Finetune.lora.enabled=true -o Finetune.lora.rank=4
#   -o Finetune.lora.alpha=8 -o 'Finetune.lora.targets=["gpt.blocks.*","gpt.wte"]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then exec "$PY" -m gpt_compress finetune --help; fi
DATA="${DATA:-../shared/data/chinese}"
OUT="${OUT:-output/poetry}"
PRETRAIN_STEPS="${PRETRAIN_STEPS:-80}"
FINETUNE_STEPS="${FINETUNE_STEPS:-600}"
TITLE="${TITLE:-《春望》杜甫}"
CONF=configs/finetune_poetry.yaml
"$PY" -m gpt_compress train-tokenizer --input "$DATA/chinese_fortunes.jsonl" --vocab-size 8192 --split-cjk \
    --output-dir "$OUT/tokenizer" --overwrite
"$PY" -m gpt_compress preprocess --input "$DATA/chinese_fortunes.jsonl" --output-prefix "$OUT/fortunes" \
    --tokenizer-dir "$OUT/tokenizer"
"$PY" -m gpt_compress pretrain -c "$CONF" -o "Global.output_dir=$OUT/pretrain" -o Engine.resume=auto \
    -o "Data.data_prefix=[$OUT/fortunes_text_document]" -o "Data.tokenizer_dir=$OUT/tokenizer" \
    -o "Engine.max_steps=$PRETRAIN_STEPS"
"$PY" -m gpt_compress finetune -c "$CONF" --model "$(ls -d "$OUT"/pretrain/checkpoints/step_* | tail -1)" \
    -o "Global.output_dir=$OUT/finetune" -o "Finetune.train_file=$DATA/tang300.jsonl" \
    -o "Engine.max_steps=$FINETUNE_STEPS" -o Engine.resume=auto -o Engine.global_batch_size=1 \
    -o Engine.micro_batch_size=1 -o Optimizer.lr.max_lr=1e-2 -o Optimizer.lr.min_lr=1e-3 "$@"
# The finetuned model records Finetune.prompt_tokens (24): `gptc generate` fixes the text prompt to
# 24 tokens as finetuning did (finetune/data.py). The newline ends the prompt, as the template does.
"$PY" -m gpt_compress generate -c "$CONF" --model "$OUT/finetune/model" --no-stream --prompt "$TITLE"$'\n'
