"""Fence the surface: every script in scripts/ reaches its command (with --help)."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(ROOT, "scripts", "*.sh"))),
                         ids=os.path.basename)
def test_script_runs_its_command_help(script):
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-1500:]
    assert "usage: gptc" in res.stdout


def test_cli_lists_commands_and_rejects_unknown():
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "pretrain" in res.stdout and "generate" in res.stdout
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "pretrian"], capture_output=True, text=True)
    assert res.returncode != 0 and "unknown command 'pretrian'" in res.stderr
