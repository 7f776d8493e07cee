#!/usr/bin/env bash
# FleetX name: LAMBADA accuracy or WikiText perplexity of a checkpoint or an export. E.g.
#   scripts/evaluate_gpt_345M_single_card.sh --model CKPT --task wikitext --data wiki.test.tokens --input-format tokens
set -euo pipefail
source "$(dirname "$0")/_env.bash"
gptc eval "$@"
