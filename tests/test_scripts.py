"""Fence the surface: every script in scripts/ reaches its command (with --help)."""
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The command each script runs, by the start of its name (FleetX's script names; the longest
# prefix wins): a script wired to another command fails.
COMMANDS = {"auto_export": "export", "auto_gpt": "pretrain", "convert": "convert", "distill": "distill",
            "eval_qat": "eval", "evaluate": "eval", "export": "export", "finetune_glue": "finetune-glue",
            "finetune_gpt_345M": "finetune-glue", "finetune_poetry": "finetune", "generate": "generate",
            "inference": "infer", "preprocess": "preprocess", "pretrain": "pretrain", "prune": "prune",
            "ptq": "ptq", "qat": "qat"}


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(ROOT, "scripts", "*.sh"))),
                         ids=os.path.basename)
def test_script_runs_its_command_help(script):
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-1500:]
    name = os.path.basename(script)
    command = COMMANDS[max((p for p in COMMANDS if name.startswith(p)), key=len)]
    assert re.search(rf"^usage: gptc {re.escape(command)}(\s|$)", res.stdout, re.M), (command, res.stdout[:300])


def test_cli_lists_commands_and_rejects_unknown():
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "pretrain" in res.stdout and "generate" in res.stdout
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "pretrian"], capture_output=True, text=True)
    assert res.returncode != 0 and "unknown command 'pretrian'" in res.stderr


# The FleetX recipe names users know (projects/gpt/*.sh), each a thin wrapper here.
FLEETX_NAMES = [
    "pretrain_gpt_345M_single_card.sh", "pretrain_gpt_1.3B_single_card.sh", "pretrain_gpt_1.3B_dp8.sh",
    "pretrain_gpt_6.7B_sharding16.sh", "pretrain_gpt_175B_mp8_pp16.sh", "export_gpt_345M_single_card.sh",
    "inference_gpt_345M_single_card.sh", "evaluate_gpt_345M_single_card.sh", "finetune_gpt_345M_single_card.sh",
    "qat_gpt_345M_single_card.sh", "qat_gpt_345M_mp8.sh", "qat_gpt_6.7B_sharding16.sh",
    "eval_qat_gpt_345M_single_card.sh", "export_qat_gpt_345M_single_card.sh", "prune_gpt_345M_single_card.sh",
    "auto_gpt_345M_single_card.sh", "auto_gpt_1.3B_single_card.sh", "auto_gpt_1.3B_dp8.sh",
    "auto_gpt_6.7B_sharding16.sh", "auto_export_gpt_345M_single_card.sh",
]


def test_fleetx_script_names_exist():
    missing = [n for n in FLEETX_NAMES if not os.path.isfile(os.path.join(ROOT, "scripts", n))]
    assert not missing


def test_scripts_resolve_paths_against_the_callers_directory(tmp_path):
    """No `cd` into the clone: a relative --output names a path in the caller's directory."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "export_gpt_345M_single_card.sh"),
                          "--model", "ckpt", "--output", "notes"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 1
    assert f"--output {tmp_path / 'notes'} is a non-empty directory" in res.stderr, res.stderr
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
