"""Order independence: what one test leaves in the process (a Paddle Inference predictor's math
thread count, a `gptc` command's CPU settings and seeds) does not change what a later test
trains, and every test starts from the session's process-wide state (tests/conftest.py)."""
import hashlib
import os
import random
from pathlib import Path

import numpy as np
import paddle
import pytest

from _compress_helpers import gptc
from _export_helpers import model_dirs, train_tiny
from _parity_helpers import PROMPTS
from gpt_compress.inference.runner import Generator

# Enough steps for a different summation order to show in the weights (a 1-thread vs a 2-thread
# math library changes the sha256 from the first steps on), few enough to stay cheap.
STEPS = 20


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)


def _sha256(ckpt: str) -> str:
    return hashlib.sha256((Path(ckpt) / "model.safetensors").read_bytes()).hexdigest()


def _state() -> tuple:
    return (paddle.get_flags(["FLAGS_use_stride_kernel"])["FLAGS_use_stride_kernel"],
            os.environ.get("MKL_DEBUG_CPU_TYPE"), random.random(), float(np.random.random()),
            float(paddle.rand([1]).item()))


def test_training_is_bitwise_the_same_after_predictors_and_gptc_ran(dirs, shakespeare, tmp_path):
    """The shared export fixture's recipe (tests/_export_helpers.train_tiny) trained before and
    after what the suite's tests do in this process: an in-process `gptc` command, the fused
    program and the Paddle Inference programs (the decode program runs on 1 thread). The weights are
    bitwise the same (before the backends restored the math library's thread count after each run,
    a model trained after an export's validation differed)."""
    tok_dir, prefix = shakespeare
    before = _sha256(train_tiny(tok_dir, prefix, tmp_path / "before", steps=STEPS))
    gptc("init", "-o", "Model.preset=gpt-tiny", "--output", str(tmp_path / "init"))
    for fused in (True, False):  # the unfused decode program last: it runs on 1 thread
        gen = Generator.from_dir(dirs["export"], backend="paddle", fused=fused)
        assert gen.generate(PROMPTS, max_new_tokens=4).sequences
    after = _sha256(train_tiny(tok_dir, prefix, tmp_path / "after", steps=STEPS))
    assert after == before


def test_each_test_starts_from_the_sessions_process_state_a(tmp_path):
    """This and the next test change the process-wide state the same way and see the same state at
    their start: neither sees what the other (or any earlier test) left."""
    _assert_fresh_state_then_disturb(tmp_path)


def test_each_test_starts_from_the_sessions_process_state_b(tmp_path):
    _assert_fresh_state_then_disturb(tmp_path)


_FIRST = []


def _assert_fresh_state_then_disturb(tmp_path):
    state = _state()
    _FIRST.append(state)
    assert state == _FIRST[0]
    assert state[0] is False  # strided views off, as `gptc` runs
    gptc("init", "-o", "Model.preset=gpt-tiny", "--output", str(tmp_path / "init"))  # seeds everything
    paddle.set_flags({"FLAGS_use_stride_kernel": True})
    paddle.seed(123)
    np.random.seed(123)
    random.seed(123)
