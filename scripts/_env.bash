# Sourced by every script in scripts/: run gpt-compress from this clone, from any directory.
# * No `cd`: relative paths you pass (checkpoints, data, --output) resolve against YOUR current
#   directory, and default outputs (Global.output_dir: output/...) land there too.
# * No activated venv needed: $PYTHON if set, else the clone's .venv (made by `make test` /
#   `make demo`), else python3; the clone is put on PYTHONPATH so its gpt_compress is imported.
GPTC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIGS="$GPTC_ROOT/configs"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$GPTC_ROOT/.venv/bin/python" ]; then PYTHON="$GPTC_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$GPTC_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# gptc COMMAND ARGS...: replace this shell with `python -m gpt_compress COMMAND ARGS...`.
gptc() { exec "$PYTHON" -m gpt_compress "$@"; }
