# Sourced by the parallel pretraining scripts (pretrain_gpt_*_{dp,mp,pp,sharding}*.sh).
# Paddle's launcher starts one process per device (or --nproc_per_node CPU processes) and runs an
# executable or a .py file in each: here the `gptc` console script next to $PYTHON.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
GPTC=${GPTC:-$(dirname "$(command -v "$PYTHON")")/gptc}
case " $* " in *" --help "*|*" -h "*) exec "$PYTHON" -m gpt_compress pretrain --help;; esac

# launch_pretrain CONFIG [launcher flags ...] -- [gptc pretrain arguments ...]
launch_pretrain() {
    local config=$1 launcher=()
    shift
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do launcher+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    exec "$PYTHON" -m paddle.distributed.launch "${launcher[@]}" "$GPTC" pretrain -c "$config" "$@"
}
