"""Hybrid parallel training under ``paddle.distributed.launch`` equals one process.

Every layout trains gpt-tiny on tinyshakespeare for 10 steps through the real CLI
(``gptc pretrain`` started by Paddle's launcher, gloo, one thread per process) on the same
global batch as a single-process reference computed once per model (pp4 x vpp2 needs 8 layers):
each step's loss must match within LOSS_RTOL relative and every parameter after 10 steps within
PARAM_ATOL, the key biases within KEY_BIAS_ATOL (``_assert_close``). Checkpoints written under mp2, pp2 and pp2 x mp2 (single-process layout,
gathered by the ranks) load into one process and, resharded back into the layout, give the same
logits, and an mp2 inference export generates the tokens of the single-card export.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from _grad_helpers import assert_grads_close
from gpt_compress.config import ConfigError, ModelConfig, ParallelConfig
from gpt_compress.parallel.launch import log_tail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
GPTC = os.path.join(os.path.dirname(sys.executable), "gptc")
STEPS = 10
HEADS = ModelConfig.from_preset("gpt-tiny").num_attention_heads  # every layout trains gpt-tiny's heads
# Measured over every layout and seeds 1234, 1, 2 (-o Global.seed, 33 runs; the test runs 1234),
# each tolerance about 4x the largest:
# per-step loss, relative: <= 1.6e-7 (about 2 float32 ulps of a loss near 7).
LOSS_RTOL = 1e-6
# Parameters after STEPS steps, absolute: the same AdamW steps on gradients summed in another
# order. Every parameter but the key bias: <= 9.6e-7 (pp2 x mp2; 1.2e-7, 1 ulp of the LayerNorm
# gains near 1, in most layouts). The key bias's gradient is zero in exact arithmetic (a shift
# shared by all keys of a query leaves its softmax unchanged), so AdamW steps it on float32
# rounding noise, normalized to a fraction of the learning rate, a different walk for every
# summation order: <= 5.5e-6 (dp2, seed 2).
PARAM_ATOL = 4e-6  # every parameter but the key bias
KEY_BIAS_ATOL = 2.5e-5  # the key third of each qkv bias
# Logits of a checkpoint in one process vs resharded into the layout. mp2 splits the K-term sums
# of the row-parallel linears (attention output K = 64, FFN output K = 256) into two partial sums
# added by the all-reduce: a reordering, off by at most gamma_K sum |a b| each, a few ulps of the
# logit. pp2 runs the same ops, but the ranks on one thread and this process on OMP_NUM_THREADS:
# the GEMMs block their sums differently, so it is not bitwise either. Measured <= 4.2e-7 at
# |logit| <= 1.44 (mp2, pp2 x mp2; pp2 4.17e-7 with this process on 2 threads, exact on 1):
# 3.5 ulps of float32 there; 2e-6 is 4.8x that.
LOGIT_ATOL = 2e-6

# name -> (processes, Parallel overrides, Engine.micro_batch_size per rank). Global batch 8 everywhere:
# the reference takes micro-batches of 4 with 2 accumulation steps; data-parallel ranks split each
# micro-batch of 4, tensor/pipeline ranks see all of it.
LAYOUTS = {
    "dp2": (2, ["Parallel.dp_degree=2"], 2),
    "mp2": (2, ["Parallel.mp_degree=2"], 4),
    "pp2": (2, ["Parallel.pp_degree=2"], 4),
    "sharding2_stage1": (2, ["Parallel.sharding_degree=2", "Parallel.sharding_stage=1"], 2),
    "sharding2_stage2": (2, ["Parallel.sharding_degree=2", "Parallel.sharding_stage=2"], 2),
    "sharding2_stage3": (2, ["Parallel.sharding_degree=2", "Parallel.sharding_stage=3"], 2),
    "dp2_mp2": (4, ["Parallel.dp_degree=2", "Parallel.mp_degree=2"], 2),
    "pp2_mp2": (4, ["Parallel.pp_degree=2", "Parallel.mp_degree=2"], 4),
    "pp2_dp2": (4, ["Parallel.pp_degree=2", "Parallel.dp_degree=2"], 2),
    # fleet's interleaved schedule needs >= 2 x pp micro-batches: 8 of 1 sample; 8 layers make 8 chunks.
    "pp4_vpp2": (4, ["Parallel.pp_degree=4", "Parallel.virtual_pp_degree=2", "Model.num_layers=8"], 1),
    "mp2_sequence_parallel": (2, ["Parallel.mp_degree=2", "Parallel.sequence_parallel=true"], 4),
}


def _overrides(tok_dir, prefix, out, micro, parallel=()):
    eng = {"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": micro, "eval_freq": 0,
           "save_steps": STEPS // 2, "logging_freq": 0}
    return ["-o", "Model.preset=gpt-tiny", "-o", "Model.hidden_dropout_prob=0.0",
            "-o", "Model.attention_probs_dropout_prob=0.0", "-o", "Data.seq_length=64",
            "-o", f"Data.data_prefix=[{prefix}]", "-o", f"Data.tokenizer_dir={tok_dir}",
            "-o", "Data.split=[95,5,0]", "-o", f"Global.output_dir={out}",
            "-o", "Optimizer.lr.max_lr=3e-3", "-o", "Optimizer.lr.warmup_rate=0.2",
            "-o", f"Optimizer.lr.decay_steps={STEPS}",
            *[x for k, v in eng.items() for x in ("-o", f"Engine.{k}={v}")],
            *[x for p in parallel for x in ("-o", p)]]


def _run_launch(cmd, nproc, log_dir, out=None, timeout=600):
    """Run a ``paddle.distributed.launch`` command; fails with the rank logs.

    Four gloo processes: a rank killed by a signal inside Paddle (a segfault seen in about one
    4-process launch in ten, while fleet broadcasts the mp parameters; an open defect) is
    launched again from scratch (``out`` removed first), up to three attempts; any other
    failure fails the test at once."""
    for attempt in (1, 2, 3):
        res = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        crashed = re.search(r"(?:status failed cmd .* |Exit )(code -\d+)", res.stderr)
        if res.returncode == 0 or not (nproc == 4 and crashed and attempt < 3 and out is not None):
            break
        print(f"retrying after a rank crashed ({crashed.group(1)})", file=sys.stderr)
        if os.path.isdir(out):
            shutil.rmtree(out, ignore_errors=True)
        elif os.path.exists(out):
            os.remove(out)
        shutil.rmtree(log_dir, ignore_errors=True)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))}\n{res.stderr[-2000:]}\n{log_tail(log_dir)}"
    return res


def _launch(nproc, args, log_dir, timeout=600, out=None):
    """``python -m paddle.distributed.launch --nproc_per_node N gptc ...`` (``_run_launch``)."""
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", str(log_dir), GPTC, *args]
    return _run_launch(cmd, nproc, log_dir, out=out, timeout=timeout)


def _losses(out):
    recs = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl")) if x.strip()]
    return np.array([r["loss"] for r in sorted(recs, key=lambda r: r["step"]) if "loss" in r])


def _final_checkpoint(out):
    from gpt_compress.train.checkpoint import list_checkpoints

    ckpts = list_checkpoints(out)
    assert ckpts, f"no checkpoint under {out}"
    return ckpts[-1]


def _assert_close(got_losses, ref_losses, got_w, ref_w):
    assert len(got_losses) == STEPS == len(ref_losses)
    rel = np.abs(got_losses - ref_losses) / np.abs(ref_losses)
    assert rel.max() <= LOSS_RTOL, (rel, got_losses, ref_losses)
    assert sorted(got_w) == sorted(ref_w)
    worst = {"other": (0.0, ""), "key_bias": (0.0, "")}
    for k, ref in ref_w.items():
        diff = np.abs(got_w[k] - ref)
        if re.fullmatch(r"gpt\.blocks\.\d+\.attn\.qkv\.bias", k):  # head-major (H, 3, D): q, k, v
            split = diff.reshape(HEADS, 3, -1)
            worst["key_bias"] = max(worst["key_bias"], (float(split[:, 1].max()), k))
            diff = np.concatenate([split[:, 0], split[:, 2]])
        worst["other"] = max(worst["other"], (float(diff.max()), k))
    assert worst["other"][0] <= PARAM_ATOL and worst["key_bias"][0] <= KEY_BIAS_ATOL, worst


def _model_overrides(par):
    """The ``Model.*`` overrides among a layout's (the reference trains the same model)."""
    return tuple(p for p in par if p.startswith("Model."))


@pytest.fixture(scope="module")
def references(shakespeare, tmp_path_factory):
    """One process, same global batch (micro 4 x 2 accumulation steps), per set of model overrides
    (lazily, once each): losses, weights, checkpoint."""
    from gpt_compress.checkpoint import load_weights

    tok_dir, prefix = shakespeare
    done = {}

    def run(model=()):
        if model not in done:
            out = str(tmp_path_factory.mktemp("parallel_ref"))
            res = subprocess.run([sys.executable, "-m", "gpt_compress", "pretrain", "--no-progress",
                                  *_overrides(tok_dir, prefix, out, 4, model)],
                                 env=ENV, cwd=ROOT, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-3000:]
            ckpt = _final_checkpoint(out)
            done[model] = {"losses": _losses(out), "weights": load_weights(ckpt), "ckpt": ckpt}
        return done[model]

    return run


@pytest.fixture(scope="module")
def parallel_runs(shakespeare, tmp_path_factory):
    """Each layout launched once (lazily); name -> output dir."""
    tok_dir, prefix = shakespeare
    done = {}

    def run(name):
        if name not in done:
            nproc, par, micro = LAYOUTS[name]
            out = tmp_path_factory.mktemp(f"parallel_{name}")
            _launch(nproc, ["pretrain", "--no-progress", *_overrides(tok_dir, prefix, str(out / "run"), micro, par)],
                    out / "logs", out=out / "run")
            done[name] = str(out / "run")
        return done[name]

    return run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references, parallel_runs):
    from gpt_compress.checkpoint import load_weights

    reference = references(_model_overrides(LAYOUTS[layout][1]))
    out = parallel_runs(layout)
    # Rank 0 alone logged and wrote checkpoints, in the single-process layout.
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [f"step_{s:08d}" for s in (STEPS // 2, STEPS)]
    _assert_close(_losses(out), reference["losses"], load_weights(_final_checkpoint(out)), reference["weights"])


@pytest.mark.parametrize("layout", ["mp2", "pp2", "sharding2_stage2", "pp2_mp2"])
def test_resume_in_layout_continues_exactly(layout, shakespeare, parallel_runs, tmp_path):
    """Resume the layout's step-5 checkpoint (single-process layout) in the same layout: every
    rank takes its blocks of the weights and (sharded) optimizer moments; steps 6-10 and the final
    weights are bitwise those of the uninterrupted run."""
    from gpt_compress.checkpoint import load_weights

    tok_dir, prefix = shakespeare
    base = parallel_runs(layout)
    nproc, par, micro = LAYOUTS[layout]
    out = str(tmp_path / "run")
    mid = os.path.join(base, "checkpoints", f"step_{STEPS // 2:08d}")
    _launch(nproc, ["pretrain", "--no-progress", *_overrides(tok_dir, prefix, out, micro, par), "--resume", mid],
            tmp_path / "logs", out=out)
    # The same layout and reduction order from the same state: bitwise the same run (measured for
    # these four layouts with seeds 1234, 1, 2: every loss and weight equal).
    np.testing.assert_array_equal(_losses(out), _losses(base)[STEPS // 2:])
    got, want = load_weights(_final_checkpoint(out)), load_weights(_final_checkpoint(base))
    assert all(np.array_equal(got[k], want[k]) for k in want), [k for k in want if not np.array_equal(got[k], want[k])]


def test_parallel_config_checks_the_launch():
    ParallelConfig(dp_degree=2, mp_degree=2).validate(4)
    with pytest.raises(ConfigError, match=r"dp 2 x mp 2 x pp 2 = 8 but 4 processes were launched"):
        ParallelConfig(dp_degree=2, mp_degree=2, pp_degree=2).validate(4)
    with pytest.raises(ConfigError, match=r"--nproc_per_node 2"):
        ParallelConfig(mp_degree=2).validate(1)
    with pytest.raises(ConfigError, match="sharding_stage"):
        ParallelConfig(sharding_stage=4)


def test_wrong_world_size_fails_before_training(shakespeare, tmp_path):
    tok_dir, prefix = shakespeare
    res = subprocess.run([sys.executable, "-m", "gpt_compress", "pretrain", "--no-progress",
                          *_overrides(tok_dir, prefix, str(tmp_path), 4, ["Parallel.mp_degree=2"])],
                         env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2
    assert "dp 1 x mp 2 x pp 1 = 2 but 1 process was launched" in res.stderr


def _logits_in_layout(nproc, par_flags, ckpt, ids_path, out_path, log_dir):
    """Load ``ckpt`` into the parallel layout (every rank reads its shards), run the batch, gather."""
    args = [os.path.join(ROOT, "tests", "_parallel_worker.py"), "--ckpt", ckpt, "--ids", ids_path,
            "--out", out_path, *par_flags]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", str(log_dir), *args]
    _run_launch(cmd, nproc, log_dir, out=out_path)
    return np.load(out_path)


@pytest.mark.parametrize("layout,flags", [("mp2", ["--mp", "2"]), ("pp2", ["--pp", "2"]),
                                          ("pp2_mp2", ["--pp", "2", "--mp", "2"])])
def test_checkpoint_from_layout_loads_in_one_process(layout, flags, parallel_runs, tmp_path):
    """The layout's checkpoint (single-process layout) gives one process the logits that the same
    checkpoint resharded back into the layout gives."""
    import paddle

    from gpt_compress.checkpoint import load_model

    ckpt = _final_checkpoint(parallel_runs(layout))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1024, size=(2, 24)).astype(np.int64)
    np.save(tmp_path / "ids.npy", ids)
    got = _logits_in_layout(LAYOUTS[layout][0], flags, ckpt, str(tmp_path / "ids.npy"), str(tmp_path / "logits.npy"),
                            tmp_path / "logs")
    with paddle.no_grad():
        single = load_model(ckpt)(paddle.to_tensor(ids)).numpy()
    assert got.shape == single.shape == (2, 24, 1024)
    assert float(np.max(np.abs(got - single))) < LOGIT_ATOL


def test_fleet_tensor_parallel_stage_pieces_match_dense(tmp_path):
    """The pieces pp x mp stages are built from (fleet column/row/vocab-parallel layers swapped into
    the one model, tied vocab-parallel head, vocab-parallel loss over gloo) give the dense loss and
    gradients on 2 processes (the pp2_mp2 layout trains them end to end on 4)."""
    import paddle
    import paddle.nn.functional as F

    from gpt_compress.config import ModelConfig
    from gpt_compress.model.gpt import GPTForCausalLM

    data = np.random.default_rng(3).integers(0, 1024, size=(2, 17)).astype(np.int64)
    np.save(tmp_path / "ids.npy", data)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           str(tmp_path / "logs"), os.path.join(ROOT, "tests", "_fleet_tp_worker.py"), str(tmp_path / "got.npz"),
           str(tmp_path / "ids.npy")]
    res = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{res.stderr[-2000:]}\n{log_tail(tmp_path / 'logs')}"
    got = np.load(tmp_path / "got.npz")
    paddle.seed(7)
    model = GPTForCausalLM(ModelConfig.from_preset("gpt-tiny", hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0))
    ids = paddle.to_tensor(data)
    loss = F.cross_entropy(model(ids[:, :-1]).reshape([-1, 1024]), ids[:, 1:].reshape([-1]))
    loss.backward()
    # The vocab-parallel loss sums each row's exps in two halves of 512: a 1,024-term sum of
    # positive terms, off by at most gamma_1024 = 6.1e-5 relative, so the log-sum-exp by 6.1e-5
    # absolute, 8.8e-6 of a loss near ln 1024 = 6.93; 1e-5 is that bound. Measured 0.0 (init and
    # data seeds 7, 1, 2, 3; this process on 1 and 2 threads).
    assert abs(float(got["loss"]) - float(loss)) <= 1e-5 * abs(float(loss))
    # Gradients, per parameter relative to its largest entry (tests/_grad_helpers.py): measured
    # <= 7.1e-7 over those seeds and threads (absolute <= 1.4e-7); the former flat atol 1e-6 was
    # 5.9e-4 of the smallest parameter's gradients (max |grad| 1.7e-3).
    assert_grads_close({n: got[n] for n, _ in model.named_parameters()},
                       {n: p.grad.numpy() for n, p in model.named_parameters()})


def test_mp2_inference_export_generates_single_card_tokens(shakespeare, tmp_path_factory, tmp_path):
    from _export_helpers import model_dirs

    from gpt_compress.export.partition import partition
    from gpt_compress.inference.manifest import read_tp_manifest
    from gpt_compress.inference.runner import Generator
    from gpt_compress.inference.tensor_parallel import generate_tensor_parallel

    dirs = model_dirs(tmp_path_factory, shakespeare)
    tp_dir = str(tmp_path / "tp")
    partition(dirs["ckpt"], tp_dir, mp_degree=2)  # every rank program is validated against dygraph
    assert read_tp_manifest(tp_dir)["ranks"] == ["rank_0", "rank_1"]
    for r in range(2):  # no kernel-less ops: the same programs run on CPU and GPU
        graph = open(os.path.join(tp_dir, f"rank_{r}", "decode.json")).read()
        assert "c_identity" not in graph and "c_concat" not in graph
        assert "mp_allreduce_sum" in graph or "all_reduce" in graph
    single = Generator.from_dir(dirs["export"], backend="paddle")
    prompts = ["ROMEO:", "To be, or not to be"]
    want = single.generate(prompts, max_new_tokens=24, decode_strategy="greedy")
    got = generate_tensor_parallel(tp_dir, prompts, max_new_tokens=24, decode_strategy="greedy")
    assert got["sequences"] == want.sequences
    assert got["texts"] == want.texts
