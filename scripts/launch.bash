# Sourced by the parallel pretraining scripts (pretrain_gpt_*_{dp,mp,pp,sharding}*.sh).
# Paddle's launcher starts one process per device (or --nproc_per_node CPU processes) and runs an
# executable or a .py file in each: here the `gptc` console script next to $PYTHON.
source "$(dirname "${BASH_SOURCE[0]}")/_env.bash"
# The launcher runs an executable in each process: a `gptc` beside $PYTHON, else a two-line shim.
if [ -z "${GPTC:-}" ]; then
    GPTC="$(dirname "$(command -v "$PYTHON")")/gptc"
    if [ ! -x "$GPTC" ]; then
        GPTC="$(mktemp -d)/gptc"
        printf '#!/usr/bin/env bash\nexec "%s" -m gpt_compress "$@"\n' "$PYTHON" > "$GPTC"
        chmod +x "$GPTC"
    fi
fi
case " $* " in *" --help "*|*" -h "*) exec "$PYTHON" -m gpt_compress pretrain --help;; esac

# launch_pretrain CONFIG [launcher flags ...] -- [gptc pretrain arguments ...]; CONFIG is a file
# name in the clone's configs/ (or a path).
launch_pretrain() {
    local config=$1 launcher=()
    shift
    [ -f "$config" ] || config="$CONFIGS/${config#configs/}"
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do launcher+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    exec "$PYTHON" -m paddle.distributed.launch "${launcher[@]}" "$GPTC" pretrain -c "$config" "$@"
}
