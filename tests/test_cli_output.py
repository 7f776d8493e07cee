"""A command's terminal output is its own: Paddle's import-time OMP_NUM_THREADS advice and its
C++ extension loader's "using custom operator only" INFO line are hidden from `gptc` users and
shown with GPTC_VERBOSE=1; `gptc --help` shows no internal docstring."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OMP_NOTICE = "PLEASE USE OMP_NUM_THREADS WISELY"
OMP_WARNING = "WARNING: OMP_NUM_THREADS set to"
OPS_NOTICE = "using custom operator only"
# What `gptc <command>` does before its command runs (cli.main), then what a command that runs the
# fused Paddle program does: import paddle (the OMP advice) and load the operator library. The
# loader's INFO line goes through extension_utils.log_v (called directly as well, since whether
# load() logs it depends on the library's state); load() also runs a build step in a child process
# whose stderr is ours (kernels._stderr_into keeps it off the terminal).
ENTRY_AND_OPS = ("from gpt_compress import cli; cli._quiet_paddle(); import paddle; "
                 "from paddle.utils.cpp_extension import extension_utils; "
                 "from gpt_compress.kernels import load_ops; load_ops(); "
                 "extension_utils.log_v('using custom operator only'); print('ok')")
PADDLE_BUILD_NOTICES = ("No ccache found", "running build")


def _run(args: list[str], verbose: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    env.pop("GPTC_VERBOSE", None)
    if verbose:
        env["GPTC_VERBOSE"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_version_and_help_are_clean():
    for args in (["--version"], ["--help"]):
        proc = _run(["-m", "gpt_compress", *args])
        assert proc.returncode == 0, proc.stderr
        assert OMP_NOTICE not in proc.stderr and OPS_NOTICE not in proc.stderr
    out = _run(["-m", "gpt_compress", "--help"]).stdout
    assert "a table from command names" not in out and "gpt_compress.commands" not in out
    assert "pretrain" in out and "serve" in out


def test_a_command_that_imports_paddle_prints_no_paddle_notice(tmp_path):
    proc = _run(["-m", "gpt_compress", "init", "--output", str(tmp_path / "ckpt"), "-o", "Model.preset=gpt-tiny"])
    assert proc.returncode == 0, proc.stderr
    assert OMP_WARNING not in proc.stderr and OMP_NOTICE not in proc.stderr, proc.stderr


def test_paddle_notices_hidden_at_the_entry_point_and_shown_when_verbose():
    quiet = _run(["-c", ENTRY_AND_OPS])
    assert quiet.returncode == 0 and quiet.stdout.strip().endswith("ok"), quiet.stderr
    assert OMP_WARNING not in quiet.stderr and OMP_NOTICE not in quiet.stderr, quiet.stderr
    assert OPS_NOTICE not in quiet.stderr, quiet.stderr
    assert not any(n in quiet.stderr for n in PADDLE_BUILD_NOTICES), quiet.stderr
    # The control: the same process with GPTC_VERBOSE=1 shows both, so the test can fail.
    loud = _run(["-c", ENTRY_AND_OPS], verbose=True)
    assert loud.returncode == 0, loud.stderr
    assert OMP_NOTICE in loud.stderr and OPS_NOTICE in loud.stderr, loud.stderr
    assert all(n in loud.stderr for n in PADDLE_BUILD_NOTICES), loud.stderr


# A command's body replaced by a probe of the malloc policy cli.main left in place: a 64 MB block
# touched, freed, and the resident size before and after the free (MB). glibc's own policy maps a
# block that large (above its largest dynamic mmap threshold, 32 MB) and unmaps it on free; the
# heap-only policy of runtime.tune_cpu keeps it resident (1 GB trim threshold).
MALLOC_PROBE = """
import ctypes, importlib, sys
from gpt_compress import cli, memory
def probe(args):
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    n = 64 << 20
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    before = memory.status_bytes("VmRSS")
    libc.free(ctypes.c_void_p(p))
    print("freed_mb", (before - memory.status_bytes("VmRSS")) >> 20)
    return 0
name, module = sys.argv[1], importlib.import_module("gpt_compress.commands." + cli.COMMANDS[sys.argv[1]][0])
module.run = probe
cli.main(sys.argv[1:])
"""


def test_serve_keeps_glibc_malloc_policy_and_training_commands_the_heap(tmp_path):
    """`gptc serve` runs for hours on shapes that keep changing: under the heap-only policy its
    RSS grew for as long as it served (bench/serve.py --soak). It keeps glibc's policy, so freed
    large blocks go back to the OS; every other command keeps freed memory for reuse."""
    served = _run(["-c", MALLOC_PROBE, "serve", "--model-dir", str(tmp_path)])
    exported = _run(["-c", MALLOC_PROBE, "export", "--model", str(tmp_path), "--output", str(tmp_path / "x")])
    assert served.returncode == 0 and exported.returncode == 0, served.stderr + exported.stderr
    freed = {name: int(proc.stdout.split("freed_mb")[1]) for name, proc in (("serve", served), ("export", exported))}
    assert freed["serve"] >= 60 and freed["export"] <= 4, freed
