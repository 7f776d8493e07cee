"""The fused CPU operators (kernels/gptc_ops.cc + headers) and the fused Paddle program (export/fused.py,
inference/fused.py) on the trained tiny GPT of tests/_export_helpers.py and its pruned copy.

The operator library is built once per machine and source (cached, ``kernels.cache_dir()``);
the first test to need it pays the build (~40-70 s on a busy 2-core machine)."""
import gc
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import paddle
import pytest

from _export_helpers import ENV, LOGIT_ATOL, model_dirs
from _kernel_helpers import assert_batch_invariant_logits, build_pair, compare_builds, other_build_outputs
from _parity_helpers import PROMPTS, Recorder, calib_batches, int8_logit_atol, left_padded
from gpt_compress.inference.runner import Generator



@pytest.fixture(scope="module")
def dirs(tmp_path_factory, shakespeare):
    """model_dirs, plus ``narrow_ckpt`` / ``narrow_export``: the trained model pruned in depth and
    width (block 1 of 2, 40 of 64 hidden channels, heads 1 and 3 of 4; head width 16 kept)."""
    from gpt_compress.checkpoint import load_model, save_model
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.export import export
    from gpt_compress.prune import prune_model

    out = model_dirs(tmp_path_factory, shakespeare)
    base = tmp_path_factory.mktemp("narrow")
    model = load_model(out["ckpt"])
    keep_hidden = sorted(np.random.default_rng(0).choice(64, 40, replace=False).tolist())
    narrow = prune_model(model, [[0, 1, 2, 3], [1, 3]], [list(range(256))] * 2, keep_layers=[1],
                         keep_hidden=keep_hidden)
    out["narrow_ckpt"] = save_model(narrow, str(base / "ckpt"), tokenizer=Tokenizer.load(out["ckpt"]))
    out["narrow_export"] = export(out["narrow_ckpt"], str(base / "export"), formats=("paddle",))
    return out


def _eager_steps(model, fused, ids, mask, steps, seed=0):
    """Max relative logit difference of the eager fused layer vs dygraph over prefill and
    ``steps`` decode steps (random next tokens), the cache written in place in between."""
    cfg = model.config
    b, t = ids.shape
    caches = [paddle.zeros([b, cfg.heads(i), t + steps, cfg.dim_head]) for i in range(cfg.num_layers) for _ in "kv"]
    rng = np.random.default_rng(seed)
    worst, new = 0.0, ids
    for step in range(steps + 1):
        with paddle.no_grad():
            ref = model(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask)).numpy()[:, -1]
            got = fused(paddle.to_tensor(new), paddle.to_tensor(mask),
                        paddle.to_tensor(np.arange(b) * new.shape[1] + new.shape[1] - 1), caches).numpy()
        worst = max(worst, float(np.max(np.abs(got - ref))) / max(1.0, float(np.max(np.abs(ref)))))
        new = rng.integers(0, cfg.vocab_size, (b, 1))
        ids, mask = np.concatenate([ids, new], 1), np.concatenate([mask, np.ones_like(new)], 1)
    return worst


@pytest.mark.parametrize("which", ["ckpt", "pruned_ckpt", "narrow_ckpt"])
def test_fused_ops_eagerly_match_dygraph_on_a_left_padded_batch(dirs, which):
    """The fused program's op runs in dygraph: prefill + 32 decode steps within LOGIT_ATOL x
    max(1, max |logit|) of the model, with per-layer head counts and FFN widths (pruned), and
    with a hidden size that is not heads x head width (narrow)."""
    from gpt_compress.checkpoint import load_model
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.export.fused import FusedLM, fused_weights

    model = load_model(dirs[which])
    if which == "pruned_ckpt":
        assert len({model.config.heads(i) for i in range(model.config.num_layers)}) > 1
    ids, mask = left_padded(Tokenizer.load(dirs[which]), PROMPTS)
    assert _eager_steps(model, FusedLM(fused_weights(model)), ids, mask, steps=32) < LOGIT_ATOL


@pytest.mark.parametrize("which", ["export", "pruned_export", "narrow_export"])
def test_fused_program_matches_dygraph_and_the_unfused_programs(dirs, which):
    """The default Paddle backend runs fused.json: prefill + 32 decode steps of a left-padded batch
    within 1e-4 of dygraph; greedy and beam-search tokens identical to the unfused export's."""
    from gpt_compress.inference.fused import FusedBackend
    from gpt_compress.inference.predictor import PaddleBackend

    ckpt = dirs[which.replace("export", "ckpt")]
    fused = Generator.from_dir(dirs[which], backend="paddle")
    unfused = Generator.from_dir(dirs[which], backend="paddle", fused=False)
    ref = Generator.from_dir(ckpt, backend="dygraph")
    assert isinstance(fused.backend, FusedBackend) and isinstance(unfused.backend, PaddleBackend)
    fused.backend, ref.backend = Recorder(fused.backend), Recorder(ref.backend)
    out = fused.generate(PROMPTS, max_new_tokens=33)
    assert out.sequences == ref.generate(PROMPTS, max_new_tokens=33).sequences
    assert out.sequences == unfused.generate(PROMPTS, max_new_tokens=33).sequences
    diffs = [float(np.max(np.abs(a - r))) for a, r in zip(fused.backend.logits, ref.backend.logits)]
    assert len(diffs) == 33 and max(diffs) < LOGIT_ATOL, max(diffs)
    beam = dict(max_new_tokens=10, decode_strategy="beam_search", num_beams=3)
    assert fused.generate(PROMPTS[1:], **beam).sequences == unfused.generate(PROMPTS[1:], **beam).sequences
    ids, mask = left_padded(fused.tokenizer, PROMPTS)
    scored = fused.score(ids, mask) - ref.score(ids, mask)
    assert float(np.max(np.abs(scored[mask > 0]))) < LOGIT_ATOL


def test_saved_fused_program_is_the_custom_ops_and_its_inputs(dirs):
    from gpt_compress.export.fused import count_ops
    from gpt_compress.kernels import KERNEL_VERSION

    manifest = json.loads(open(os.path.join(dirs["export"], "manifest.json")).read())
    layers = manifest["model"]["num_layers"]
    ops = count_ops(os.path.join(dirs["export"], manifest["fused"]["model"]))
    assert ops == manifest["fused"]["ops"]
    # 4 + 2 per layer feeds (ids, mask, rows, control, the caches), the two lists (caches,
    # weights) of the one gptc_generate op (its caches inplace: the trailing "_"), two fetches
    # (the logits, greedy's tokens): nothing else runs. The weights are a float32
    # and an int8 blob per group (the embeddings, each block; the last with the final norm and
    # head): Paddle's executor costs about as much per op input as per op.
    assert ops.pop("parameter") == 2 * (layers + 1)
    assert ops == {"pd_op.data": 4 + 2 * layers, "builtin.combine": 2, "custom_op.gptc_generate_": 1,
                   "pd_op.fetch": 2}
    assert manifest["fused"]["kernel"]["version"] == KERNEL_VERSION


def test_an_export_of_an_older_kernel_version_is_refused_with_the_command_that_rewrites_it(dirs, tmp_path):
    """Only the current kernel version's program runs: an export whose fused program is of an
    older one (its manifest says so) gets one line naming the version and the re-export."""
    from gpt_compress.inference.manifest import ModelDirError

    old_dir = tmp_path / "v2"
    shutil.copytree(dirs["export"], old_dir)
    manifest = json.loads((old_dir / "manifest.json").read_text())
    manifest["fused"]["kernel"]["version"] = 2
    (old_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelDirError) as err:
        Generator.from_dir(str(old_dir), backend="paddle")
    message = str(err.value)
    assert "\n" not in message and "kernel version 2" in message, message
    assert f"gptc export --model CHECKPOINT --output {old_dir} --overwrite" in message, message


def test_prefill_and_decode_logits_are_bitwise_the_scoring_programs_rows(dirs):
    """The program's paths agree bitwise: a left-padded batch's prefill (the last block computes
    only each sequence's last row past its attention) and two decode steps give the logits of
    scoring every position of the same tokens (every row computed), also for a prefill of 18 rows
    (the head's layer norms shared out from 16 rows on)."""
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.inference.fused import FusedBackend

    be = FusedBackend(dirs["export"])
    ids, mask = left_padded(Tokenizer.load(dirs["ckpt"]), PROMPTS)
    logits, cache = be.prefill(ids, mask)
    assert np.array_equal(logits, be.score(ids, mask)[:, -1])
    for step in range(2):
        nxt = np.argmax(logits, -1)[:, None].astype(np.int64)
        ids, mask = np.concatenate([ids, nxt], 1), np.concatenate([mask, np.ones_like(nxt)], 1)
        logits, cache = be.decode(nxt, mask, cache)
        assert np.array_equal(logits, be.score(ids, mask)[:, -1]), f"step {step}"
    many = np.tile(ids, (6, 1)), np.tile(mask, (6, 1))
    assert np.array_equal(be.prefill(*many)[0], be.score(*many)[:, -1])


def _quantized(ckpt, shakespeare, mode):
    from gpt_compress.checkpoint import load_model
    from gpt_compress.config import QuantConfig
    from gpt_compress.qat.ptq import calibrate
    from gpt_compress.qat.quantize import quantize_model

    if mode == "w8a8":  # PTQ W8A8 blocks, weight-only int8 tied embedding / head
        qcfg = QuantConfig(weight_only=["gpt.wte"])
    else:
        qcfg = QuantConfig(targets=[], weight_only=["*"], weight_bits=4 if mode == "int4" else 8)
    qmodel = quantize_model(load_model(ckpt), qcfg)
    if mode == "w8a8":
        calibrate(qmodel, calib_batches(shakespeare[1], 2), qcfg)
    qmodel.eval()
    return qmodel


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
def test_fused_int_kernels_match_the_fake_quant_model(dirs, shakespeare, tmp_path, mode):
    """Weight-only int8 / int4 (blocks of 32, int8 inputs per token and block) and PTQ W8A8:
    the saved fused program, in a predictor, within ``int8_logit_atol`` of the fake-quant dygraph
    model over prefill + 16 decode steps (the greedy fast path's tokens the argmax of each step's
    logits), and the same greedy tokens (trained model)."""
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.inference.dygraph import DygraphBackend
    from gpt_compress.inference.fused import FusedBackend
    from gpt_compress.inference.manifest import Manifest
    from gpt_compress.export.fused import save_fused

    qmodel = _quantized(dirs["ckpt"], shakespeare, mode)
    info = save_fused(qmodel, str(tmp_path))
    assert info["weights"]["head_bits"] == (4 if mode == "int4" else 8)
    cfg = qmodel.config
    manifest = Manifest(str(tmp_path), {"fused": info, "max_position_embeddings": cfg.max_position_embeddings,
                                        "cache": {"layers": [{"heads": cfg.heads(i), "head_dim": cfg.dim_head}
                                                             for i in range(cfg.num_layers)]}})
    tok = Tokenizer.load(dirs["ckpt"])
    gens = [Generator(Recorder(be), vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                      eos_token_id=None, pad_token_id=0, tokenizer=tok)
            for be in (FusedBackend(manifest, verify=False), DygraphBackend(qmodel))]
    outs = [g.generate(PROMPTS, max_new_tokens=17).sequences for g in gens]
    assert outs[0] == outs[1]
    diffs = [float(np.max(np.abs(a - r))) for a, r in zip(gens[0].backend.logits, gens[1].backend.logits)]
    assert gens[0].backend.greedy_mismatches == 0
    assert len(diffs) == 17 and max(diffs) < int8_logit_atol(qmodel, LOGIT_ATOL), max(diffs)


def test_repeated_generations_are_identical_and_clones_on_two_threads_agree(dirs):
    gen = Generator.from_dir(dirs["export"], backend="paddle")
    kw = dict(max_new_tokens=12, decode_strategy="sampling", top_k=20, seed=3)
    first = gen.generate(PROMPTS, **kw).sequences
    assert gen.generate(PROMPTS, **kw).sequences == first
    clones = [Generator(gen.backend.clone(), vocab_size=gen.vocab_size, max_positions=gen.max_positions,
                        eos_token_id=None, pad_token_id=0, tokenizer=gen.tokenizer) for _ in range(2)]
    results, errors = [None, None], []

    def run(i):
        try:
            results[i] = [clones[i].generate(PROMPTS, **kw).sequences for _ in range(2)]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [[first, first], [first, first]]
    # The backend itself runs on its callers' threads (no worker thread): another thread's call
    # gives the same tokens.
    other = []
    t = threading.Thread(target=lambda: other.append(gen.generate(PROMPTS, **kw).sequences))
    t.start()
    t.join()
    assert other == [first]



def _another_thread_runs_during(call) -> bool:
    """Whether a waiting Python thread gets the GIL while ``call()`` runs (up to 20 calls): with
    the switch interval far beyond the test, a thread runs only when the caller releases the GIL.
    The garbage collector is off meanwhile: objects it frees (Paddle tensors) may release the GIL."""
    go, ran = threading.Event(), []
    other = threading.Thread(target=lambda: go.wait() and ran.append(True))
    other.start()
    interval = sys.getswitchinterval()
    gc.collect()
    gc.disable()
    sys.setswitchinterval(1000.0)
    try:
        go.set()  # the other thread is runnable from here; it needs the GIL
        for _ in range(20):
            call()
            if ran:
                break
        seen = bool(ran)
    finally:
        sys.setswitchinterval(interval)
        gc.enable()
        other.join()
    return seen


def test_the_fused_ops_release_the_gil_while_they_compute(dirs):
    """Paddle's binding runs a program holding the GIL (the unfused prefill program: no other
    thread runs meanwhile); the fused ops release it while they compute (gptc_gil.h), so a
    server's HTTP loop runs beside a decode step. Fails with the release taken out of
    gptc_generate."""
    gen = Generator.from_dir(dirs["export"], backend="paddle")
    ids, mask = left_padded(gen.tokenizer, PROMPTS)
    # The unfused prefill program's predictor, run on this thread (its backend runs it on a worker).
    pred = Generator.from_dir(dirs["export"], backend="paddle", fused=False).backend.predictor("prefill")
    inputs = [paddle.to_tensor(ids if n == "input_ids" else mask) for n in pred.get_input_names()]
    pred.run(inputs)
    assert not _another_thread_runs_during(lambda: pred.run(inputs))
    # The fused program's predictor, run again on the inputs of a prefill of 16 full rows (a run of
    # milliseconds, so the waiting thread is scheduled inside it on a busy machine): the run alone,
    # as numpy's ufuncs around it release the GIL themselves.
    long = np.random.default_rng(0).integers(0, gen.vocab_size, (16, gen.max_positions))
    gen.backend.prefill(long, np.ones_like(long))
    assert _another_thread_runs_during(gen.backend._pred.run)


def test_greedy_steps_fetch_the_programs_argmax_token(dirs):
    """``decode_greedy`` reads the program's Tokens output (gptc_generate's row_argmax), equal to
    np.argmax of ``decode``'s logits on every row of a left-padded batch, and greedy ``generate``
    (which uses it) gives the tokens of the logits path (a proxy without ``decode_greedy``)."""
    gen = Generator.from_dir(dirs["export"], backend="paddle")
    be = gen.backend
    ids, mask = left_padded(gen.tokenizer, PROMPTS)
    logits, cache = be.prefill(ids, mask)
    _, cache2 = be.prefill(ids, mask)
    nxt = np.argmax(logits, axis=-1)[:, None]
    for _ in range(6):
        mask = np.concatenate([mask, np.ones_like(nxt)], axis=1)
        lg, cache = be.decode(nxt, mask, cache)
        tok, cache2 = be.decode_greedy(nxt, mask, cache2)
        assert tok.dtype == np.int64 and tok.shape == (len(PROMPTS),)
        assert np.array_equal(tok, np.argmax(lg, axis=-1))
        nxt = tok[:, None]
    assert len(be._io[1]) == 2 and be._io[1][1].copy_to_cpu().dtype == np.int64  # not the np.argmax fallback
    plain = Generator(Recorder(be, greedy=False), vocab_size=gen.vocab_size, max_positions=gen.max_positions,
                      eos_token_id=None, pad_token_id=0, tokenizer=gen.tokenizer)
    assert gen.generate(PROMPTS, max_new_tokens=12).sequences == plain.generate(PROMPTS, max_new_tokens=12).sequences


def test_several_greedy_steps_in_one_run_give_the_step_by_step_tokens(dirs):
    """``decode_greedy_steps`` (gptc_generate's Control): 5 steps in one program run give the
    tokens and bitwise the cache of 5 ``decode_greedy`` calls on a left-padded batch, a row
    finished before the call gets the pad token; greedy ``generate`` (runs sized by time: 8 steps
    before one was timed, then the 4 left of 13 new tokens) equals the logits path's tokens, with
    an EOS that ends one row inside a run, and with ``min_new_tokens`` keeping it out of the
    first 10 tokens."""
    gen = Generator.from_dir(dirs["export"], backend="paddle")
    be = gen.backend
    assert be.greedy_steps == 32
    ids, mask = left_padded(gen.tokenizer, PROMPTS)
    logits, cache = be.prefill(ids, mask)
    _, one = be.prefill(ids, mask)
    nxt = np.argmax(logits, axis=-1)[:, None]
    mask = np.concatenate([mask, np.ones_like(nxt)], axis=1)
    finished = np.zeros(len(PROMPTS), bool)
    finished[1] = True
    many, cache = be.decode_greedy_steps(nxt, mask, cache, 5, None, 7, finished, 0)
    assert many.shape == (len(PROMPTS), 5) and cache.length == mask.shape[1] + 4
    feed, m = nxt.copy(), mask
    feed[1] = nxt[1]
    for j in range(5):
        tok, one = be.decode_greedy(feed, m, one)
        tok[1] = 7
        assert np.array_equal(many[:, j], tok), j
        feed, m = tok[:, None], np.concatenate([m, np.ones_like(feed)], axis=1)
    filled = cache.length
    assert one.length == filled
    # Row 1 was fed the pad token after the first step in both; the others the same tokens.
    assert all(np.array_equal(a.numpy()[:, :, :filled], b.numpy()[:, :, :filled])
               for a, b in zip(cache.tensors, one.tensors))
    free = Generator(Recorder(be, greedy=False), vocab_size=gen.vocab_size, max_positions=gen.max_positions,
                     eos_token_id=None, pad_token_id=0, tokenizer=gen.tokenizer)
    seqs = free.generate(PROMPTS, max_new_tokens=13).sequences
    # An EOS that ends row 0 inside the first run (its 2nd-8th token) but not some other row
    # before the second run (its first 9 tokens).
    eos = next(t for t in seqs[0][1:8] if any(t not in s[:9] for s in seqs[1:]))
    runs = []
    steps = be.decode_greedy_steps
    be.decode_greedy_steps = lambda *a: runs.append(a[3]) or steps(*a)
    kw = dict(vocab_size=gen.vocab_size, max_positions=gen.max_positions, eos_token_id=int(eos), pad_token_id=0,
              tokenizer=gen.tokenizer)
    got = Generator(be, **kw).generate(PROMPTS, max_new_tokens=13).sequences
    assert got == Generator(Recorder(be, greedy=False), **kw).generate(PROMPTS, max_new_tokens=13).sequences
    assert runs == [8, 4] and got[0][-1] == eos and len(got[0]) <= 8, (runs, got)
    # min_new_tokens: the runs' first steps never choose the EOS (the logits path's processor).
    runs.clear()
    got = Generator(be, **kw).generate(PROMPTS, max_new_tokens=13, min_new_tokens=10).sequences
    assert got == Generator(Recorder(be, greedy=False), **kw).generate(PROMPTS, max_new_tokens=13, min_new_tokens=10).sequences
    assert runs == [8, 4] and len(got[0]) >= 10 and eos not in got[0][:9], (runs, got)


def test_greedy_runs_are_sized_by_the_time_a_step_took(dirs, monkeypatch):
    """``generate``'s greedy runs (``generation.run_steps``): 8 steps before a step was timed, then
    about 25 ms of steps at the latest run's pace, within 8 and the backend's 32 and never past
    ``max_new_tokens``. A clock that moves 2 ms per reading makes a step of an 8-step run 0.25 ms
    (runs of 32 follow), one of 400 ms a step of 50 ms (runs of 8 follow); the tokens are the
    logits path's either way."""
    import itertools
    import types

    from gpt_compress.model import generation

    gen = Generator.from_dir(dirs["export"], backend="paddle")
    be = gen.backend
    kw = dict(vocab_size=gen.vocab_size, max_positions=gen.max_positions, eos_token_id=None, pad_token_id=0,
              tokenizer=gen.tokenizer)
    want = Generator(Recorder(be, greedy=False), **kw).generate(PROMPTS, max_new_tokens=60).sequences
    runs = []
    steps = be.decode_greedy_steps
    be.decode_greedy_steps = lambda *a: runs.append(a[3]) or steps(*a)
    for tick, expected in ((0.002, [8, 32, 19]), (0.4, [8] * 7 + [3])):
        clock = itertools.count(step=tick)
        monkeypatch.setattr(generation, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
        runs.clear()
        assert Generator(be, **kw).generate(PROMPTS, max_new_tokens=60).sequences == want
        assert runs == expected, (tick, runs)


def test_greedy_steps_after_several_new_tokens_give_the_separate_runs_tokens(dirs):
    """``decode_greedy_steps`` fed 3 uncached tokens a row (a speculative draft catching up) gives
    the tokens and bitwise the cache of a ``decode`` of the first 2 and a run fed the last, on a
    left-padded batch with row 1 finished, and refuses rows other than each row's last."""
    gen = Generator.from_dir(dirs["export"], backend="paddle")
    be = gen.backend
    ids, mask = left_padded(gen.tokenizer, PROMPTS)
    new = np.random.default_rng(0).integers(0, gen.vocab_size, (len(PROMPTS), 3))
    full = np.concatenate([mask, np.ones_like(new)], axis=1)
    finished = np.array([False, True, False])
    _, one = be.prefill(ids, mask)
    _, one = be.decode(new[:, :2], full[:, :-1], one)
    want, one = be.decode_greedy_steps(new[:, 2:], full, one, 4, None, 7, finished, 0)
    _, joint = be.prefill(ids, mask)
    got, joint = be.decode_greedy_steps(new, full, joint, 4, None, 7, finished, 0)
    assert got.shape == (len(PROMPTS), 4) and np.array_equal(got, want) and got[1].tolist() == [7] * 4
    n = joint.length
    assert n == one.length == full.shape[1] + 3
    assert all(np.array_equal(a.numpy()[:, :, :n], b.numpy()[:, :, :n]) for a, b in zip(joint.tensors, one.tensors))
    from gpt_compress.kernels import control

    _, c = be.prefill(ids, mask)
    with pytest.raises(Exception):  # the op's check; Paddle Inference passes on no message
        be._run(new, full, np.arange(len(PROMPTS)), c.tensors, True, control(len(PROMPTS), 2))


def test_interleaved_caches_rebind_the_predictor_inputs(dirs):
    """The backend binds a cache's tensors to the predictor once and keeps them bound while decode
    steps reuse them: two sequences decoded in turn (each step a different cache), one growing
    past its capacity (new tensors), give bitwise each sequence's logits decoded alone."""
    from gpt_compress.inference.fused import FusedBackend

    backend = FusedBackend(dirs["export"], verify=False, reserve=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200, (1, n)).astype(np.int64) for n in (5, 9)]
    steps = rng.integers(0, 200, (2, 4, 1, 1)).astype(np.int64)

    def alone(i):
        ids = prompts[i]
        logits, cache = backend.prefill(ids, np.ones_like(ids))
        out = [logits]
        for s in steps[i]:
            logits, cache = backend.decode(s, np.ones((1, cache.length + 1), np.int64), cache)
            out.append(logits)
        return out

    expected = [alone(0), alone(1)]
    got, caches = [[], []], [None, None]
    for i in (0, 1):
        logits, caches[i] = backend.prefill(prompts[i], np.ones_like(prompts[i]))
        got[i].append(logits)
    for j in range(4):
        for i in (0, 1):
            logits, caches[i] = backend.decode(steps[i, j], np.ones((1, caches[i].length + 1), np.int64), caches[i])
            got[i].append(logits)
    assert caches[0].capacity == 2 * (5 + 2)  # grew (doubled): new tensors bound mid-way
    for i in (0, 1):
        assert all(np.array_equal(a, b) for a, b in zip(got[i], expected[i])), f"sequence {i}"

NO_COMPILER = r"""
import json, sys, warnings
from gpt_compress.errors import KernelError
from gpt_compress.inference.runner import Generator
out = {}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    g = Generator.from_dir(sys.argv[1], backend="paddle")
out["backend"] = type(g.backend).__name__
out["warning"] = " ".join(str(x.message) for x in w)
out["tokens"] = g.generate([[5, 6, 7]], max_new_tokens=6).sequences
try:
    Generator.from_dir(sys.argv[1], backend="paddle", fused=True)
except KernelError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def test_without_a_compiler_the_error_names_it_and_the_unfused_programs_run(dirs, tmp_path):
    env = {**ENV, "CXX": str(tmp_path / "no-such-g++"), "GPTC_KERNEL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", NO_COMPILER, dirs["export"]], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend"] == "PaddleBackend" and "no C++ compiler" in out["warning"]
    assert "no C++ compiler" in out["error"] and "no-such-g++" in out["error"]
    ref = Generator.from_dir(dirs["ckpt"], backend="dygraph").generate([[5, 6, 7]], max_new_tokens=6).sequences
    assert out["tokens"] == ref


OPENMP_ORDER = r"""
import json, os, sys, warnings
if sys.argv[2] == "paddle_first":
    import paddle  # noqa: F401  (loads libgomp before gpt_compress can set GOMP_SPINCOUNT)
from gpt_compress.inference.fused import FusedBackend
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    backend = FusedBackend(sys.argv[1], verify=False)
tokens = [int(t) for t in backend.prefill(*[__import__("numpy").array([[5, 6, 7]])] * 2)[0].argmax(-1)]
print(json.dumps({"threads": backend.threads, "warning": " ".join(str(x.message) for x in w if "libgomp" in str(x.message)),
                  "tokens": tokens}))
"""


def test_ops_threads_fall_back_to_one_when_libgomp_was_loaded_before_gpt_compress(dirs, tmp_path):
    """``import gpt_compress`` sets GOMP_SPINCOUNT before libgomp reads it; a program that imports
    paddle first (which loads libgomp) cannot get the short spin, and its fused ops run on one
    thread by default, with a warning saying how to use all of them. Same logits either way."""
    env = {k: v for k, v in ENV.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["OMP_NUM_THREADS"] = "2"
    out = {}
    for order in ("paddle_first", "gpt_compress_first"):
        proc = subprocess.run([sys.executable, "-c", OPENMP_ORDER, dirs["export"], order], env=env,
                              cwd=str(tmp_path), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[order] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["gpt_compress_first"]["threads"] == 2 and out["gpt_compress_first"]["warning"] == ""
    assert out["paddle_first"]["threads"] == 1
    assert "GOMP_SPINCOUNT" in out["paddle_first"]["warning"] and "import gpt_compress before" in out["paddle_first"]["warning"]
    assert out["paddle_first"]["tokens"] == out["gpt_compress_first"]["tokens"]


def test_a_corrupt_cached_library_is_detected(dirs, tmp_path):
    """load_ops rebuilds a cached library whose bytes no longer match the hash stamped at build
    time (a truncated or overwritten file); ``cached_library_problem`` is that check."""
    from gpt_compress import kernels

    kernels.load_ops()
    copy = shutil.copytree(kernels.cache_dir(), tmp_path / "lib")
    assert kernels.cached_library_problem(str(copy)) is None
    so = copy / kernels.NAME / (kernels.NAME + ".so")
    with open(so, "r+b") as f:
        f.seek(4096)
        f.write(b"\0" * 64)
    problem = kernels.cached_library_problem(str(copy))
    assert problem is not None and str(so) in problem and "corrupt" in problem
    os.remove(so)
    assert kernels.cached_library_problem(str(copy)) is None  # missing: simply built


@pytest.mark.parametrize("mode", ["fp32", "int8", "int4"])
def test_a_rows_logits_are_bitwise_the_same_alone_in_a_batch_and_token_by_token(dirs, mode):
    """Batch invariance (what ``gptc serve``'s continuous batching relies on): a sequence's logits
    are bitwise identical run alone, as a left-padded row of a batch (on 2 OpenMP threads), and
    with its prompt fed token by token (GEMV decode steps) instead of in one prefill (GEMM)."""
    assert_batch_invariant_logits(dirs["ckpt"], mode)


def test_int8_weights_in_row_groups_give_the_row_major_weights_logits(dirs):
    """The int8 export's weights in row groups (every Linear and the tied embedding / head: the
    grouped kernels at every M, the embedding rows read from the groups) give bitwise the logits
    of the same weights stored row-major (the lane, block and GEMV kernels), each asserting its
    batch invariance."""
    grouped = assert_batch_invariant_logits(dirs["ckpt"], "int8")
    rows = assert_batch_invariant_logits(dirs["ckpt"], "int8", group_int8=False)
    assert np.array_equal(grouped, rows)


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bits, rounded to nearest even (finite values)."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_a_bfloat16_cache_holds_each_key_and_value_rounded_to_nearest_even(dirs):
    """The first block's keys and values do not depend on the cache (its inputs are the
    embeddings), so with a bfloat16 cache they are bitwise the float32 cache's rounded to nearest
    even: at every real position of a left-padded prefill and of a decode step after it. Many of
    them needed rounding, up as well as down (truncating would fail)."""
    from gpt_compress.checkpoint import load_model
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.export.fused import FusedLM, fused_weights

    model = load_model(dirs["ckpt"])
    model.eval()
    fused, cfg = FusedLM(fused_weights(model)), model.config
    ids, mask = left_padded(Tokenizer.load(dirs["ckpt"]), PROMPTS)
    new = np.random.default_rng(0).integers(0, cfg.vocab_size, (len(PROMPTS), 1))
    b, t = ids.shape
    got = {}
    for dtype in ("float32", "bfloat16"):
        caches = [paddle.zeros([b, cfg.heads(i), t + 1, cfg.dim_head], dtype=dtype) for i in range(cfg.num_layers)
                  for _ in "kv"]
        with paddle.no_grad():
            fused(paddle.to_tensor(ids), paddle.to_tensor(mask), paddle.to_tensor(np.arange(b) * t + t - 1), caches)
            fused(paddle.to_tensor(new), paddle.to_tensor(np.concatenate([mask, np.ones_like(new)], 1)),
                  paddle.to_tensor(np.arange(b)), caches)
        got[dtype] = [c.numpy() for c in caches[:2]]  # block 0's keys and values
    real = np.concatenate([mask, np.ones_like(new)], 1) > 0  # (B, T + 1)
    for f32, bf in zip(got["float32"], got["bfloat16"]):
        assert bf.dtype == np.uint16
        want, have = _bf16_bits(f32.transpose(0, 2, 1, 3)[real]), bf.transpose(0, 2, 1, 3)[real]
        assert np.array_equal(have, want)
        up = want > (f32.transpose(0, 2, 1, 3)[real].view(np.uint32) >> 16)  # magnitude rounded up
        assert 0.2 < float(np.mean(up)) < 0.8


@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_a_bfloat16_cache_keeps_batch_invariance_within_its_rounding(dirs, mode):
    """A bfloat16 KV cache (``gptc export --kv-cache-dtype bfloat16``): every query reads the keys
    and values back rounded, its own included, so a row's logits stay bitwise the same alone, in
    a left-padded batch and token by token. They differ from the float32 cache's (the cache is
    really bfloat16), at every real position, by at most the export validation's bound
    (``BF16_CACHE_ATOL``: 4 u of the logits' magnitude, u = 2^-9 the rounding's relative error;
    measured 0.14 u), plus for int8 the flips of input codes the moved activations may cause
    (``INT8_FLIPS`` of ``lm_head_flip_bound``, as ``int8_logit_atol``; measured 1.8 u in all)."""
    from _parity_helpers import INT8_FLIPS, lm_head_flip_bound

    from gpt_compress.checkpoint import load_model
    from gpt_compress.config import QuantConfig
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.export.validate import BF16_CACHE_ATOL
    from gpt_compress.qat.quantize import quantize_model

    bf = assert_batch_invariant_logits(dirs["ckpt"], mode, cache_dtype="bfloat16")
    f32 = assert_batch_invariant_logits(dirs["ckpt"], mode)
    _, mask = left_padded(Tokenizer.load(dirs["ckpt"]), PROMPTS)
    real = np.concatenate([mask, np.ones((len(PROMPTS), 3), np.int64)], 1) > 0
    diff = float(np.max(np.abs(bf[real] - f32[real])))
    atol = BF16_CACHE_ATOL * max(1.0, float(np.max(np.abs(f32[real]))))
    if mode == "int8":
        qmodel = quantize_model(load_model(dirs["ckpt"]), QuantConfig(targets=[], weight_only=["*"], weight_bits=8))
        atol += INT8_FLIPS * lm_head_flip_bound(qmodel)
    assert 0 < diff <= atol, (diff, atol)


def test_gptc_export_kv_cache_dtype_bfloat16(dirs, tmp_path):
    """``gptc export --kv-cache-dtype bfloat16`` (validated against dygraph at ``BF16_CACHE_ATOL``
    as it exports): the manifest records the cache dtype, the backend allocates bfloat16 caches,
    and a left-padded batch generates each prompt's greedy tokens alone (a cache grown on the way).
    Without the fused Paddle program there is no such cache: a one-line error, nothing written."""
    out = tmp_path / "bf16"
    proc = subprocess.run([sys.executable, "-m", "gpt_compress", "export", "--model", dirs["pruned_ckpt"], "--output",
                           str(out), "--format", "paddle", "--kv-cache-dtype", "bfloat16"], env=ENV,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["fused"]["cache_dtype"] == "bfloat16"
    gen = Generator.from_dir(str(out), backend="paddle")
    gen.backend.reserve = 8  # the cache grows (a copy of its bfloat16 rows) within the generation
    _, cache = gen.backend.prefill(np.array([[1, 2, 3]]), np.ones((1, 3), np.int64))
    assert cache.tensors[0].dtype == paddle.bfloat16
    batch = gen.generate(PROMPTS, max_new_tokens=20).sequences
    assert batch == [gen.generate([p], max_new_tokens=20).sequences[0] for p in PROMPTS]
    for args, rc, message in [(["--kv-cache-dtype", "bfloat16", "--format", "onnx"], 1, "is the fused program's"),
                              (["--kv-cache-dtype", "bfloat16", "--no-fused"], 1, "is the fused program's"),
                              (["--kv-cache-dtype", "float16"], 2, "invalid choice")]:
        proc = subprocess.run([sys.executable, "-m", "gpt_compress", "export", "--model", dirs["pruned_ckpt"],
                               "--output", str(tmp_path / "bad"), *args], env=ENV, capture_output=True, text=True)
        assert proc.returncode == rc and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "bad").exists()


OTHER_BUILD = r"""
import sys
import numpy as np
from gpt_compress import runtime
runtime.prefer_mkl_avx2()  # as conftest.py does for the test session
sys.path.insert(0, sys.argv[2])
import _kernel_helpers as t
np.savez(sys.argv[1], **{m: t.assert_batch_invariant_logits(sys.argv[3], m) for m in ("fp32", "int8", "int4")},
         int8_kvbf16=t.assert_batch_invariant_logits(sys.argv[3], "int8", cache_dtype="bfloat16"))
print("{}")
"""


def test_the_fused_models_logits_are_bitwise_the_same_in_the_avx2_and_native_builds(dirs, tmp_path, capsys):
    """The batch-invariance test above under the other instruction-set build too (a subprocess,
    ``GPTC_KERNEL_ISA``), on a host whose native build has AVX-512 or VNNI paths: each build
    asserts its own invariance, and the two give bitwise the same logits (float32, int8, int4, and
    int8 with a bfloat16 KV cache)."""
    this, other, _ = build_pair()
    ours = {m: assert_batch_invariant_logits(dirs["ckpt"], m) for m in ("fp32", "int8", "int4")}
    ours["int8_kvbf16"] = assert_batch_invariant_logits(dirs["ckpt"], "int8", cache_dtype="bfloat16")
    script = OTHER_BUILD.replace("sys.argv[3]", repr(dirs["ckpt"]))
    theirs, _ = other_build_outputs(tmp_path, other, script)
    figures = compare_builds(ours, theirs, ("fp32",))
    with capsys.disabled():
        print(f"\nfused model, builds {this} vs {other}: " + ", ".join(
            f"{k} max rel diff {v['max_rel_diff']:.3g} bitwise {v['bitwise']}" for k, v in figures.items()))
    assert all(f["bitwise"] for f in figures.values()), figures


@pytest.mark.parametrize("mode", ["fp32", "int8", "int4", "w8a8"])
def test_a_draft_vocabulary_gives_the_argmax_over_its_tokens(dirs, shakespeare, tmp_path, mode):
    """A fused program with a draft vocabulary (the 200 tokens most frequent in the training data,
    EOS among them; ``export/draft_vocab.py``): with the control's flag, 5 greedy steps in one run
    on a left-padded batch give, step by step, the argmax over those tokens of the full logits of
    the program without it (a row finished before the call padded, an EOS finishing a row inside
    the run, the first 2 steps never EOS); the run's logits are those tokens' values bitwise and
    -inf elsewhere. Without the flag, its tokens and cache are bitwise the other program's."""
    import paddle

    from gpt_compress.checkpoint import load_model
    from gpt_compress.data.tokenizer import Tokenizer
    from gpt_compress.export.draft_vocab import draft_vocab
    from gpt_compress.export.fused import FusedLM, fused_weights, save_fused
    from gpt_compress.inference.fused import FusedBackend
    from gpt_compress.inference.manifest import Manifest
    from gpt_compress.kernels import control

    model = load_model(dirs["ckpt"]) if mode == "fp32" else _quantized(dirs["ckpt"], shakespeare, mode)
    model.eval()
    cfg = model.config
    tok = Tokenizer.load(dirs["ckpt"])
    vocab = draft_vocab([shakespeare[1]], 200, cfg.vocab_size, cfg.vocab_size - 1)
    assert len(vocab) == 200 and vocab[-1] == cfg.vocab_size - 1 and np.all(np.diff(vocab) > 0)

    def backend(sub: str, ids_kept):
        (tmp_path / sub).mkdir()
        info = save_fused(model, str(tmp_path / sub), ids_kept)
        manifest = Manifest(str(tmp_path / sub), {"fused": info, "max_position_embeddings": cfg.max_position_embeddings,
                                                  "cache": {"layers": [{"heads": cfg.heads(i), "head_dim": cfg.dim_head}
                                                                       for i in range(cfg.num_layers)]}})
        return FusedBackend(manifest, verify=False)

    full, drafting = backend("full", None), backend("vocab", vocab)
    assert drafting.draft_vocab == 200 and full.draft_vocab == 0
    with pytest.raises(ValueError, match="no draft vocabulary"):
        full.decode_greedy_steps(np.zeros((1, 1), np.int64), np.ones((1, 1), np.int64), None, 2, None, 0,
                                 np.zeros(1, bool), draft_vocab=True)
    ids, mask = left_padded(tok, PROMPTS)
    logits, ref_cache = full.prefill(ids, mask)
    _, cache = drafting.prefill(ids, mask)
    _, same_cache = drafting.prefill(ids, mask)
    nxt = np.argmax(logits, axis=-1)[:, None]
    mask = np.concatenate([mask, np.ones_like(nxt)], axis=1)
    finished = np.zeros(len(PROMPTS), bool)
    finished[1] = True
    # EOS: row 0's first draft token, which the run suppresses (steps 0-1) and which may end a
    # row later; the reference, step by step over the full logits.
    _, first = full.prefill(ids, mask[:, :-1])
    eos = int(vocab[np.argmax(full.decode(nxt, mask, first)[0][0, vocab])])
    want, feed, m, done, steps = [], nxt.copy(), mask, finished.copy(), 5
    for j in range(steps):
        lg, ref_cache = full.decode(feed, m, ref_cache)
        sub = lg[:, vocab].copy()
        if j < 2:
            sub[:, np.searchsorted(vocab, eos)] = -np.inf
        t = vocab[np.argmax(sub, axis=-1)]
        t = np.where(done, 7, t)
        done = done | (t == eos)
        want.append(t)
        feed, m = t[:, None], np.concatenate([m, np.ones_like(feed)], axis=1)
    want = np.stack(want, axis=1)
    got, cache = drafting.decode_greedy_steps(nxt, mask, cache, steps, eos, 7, finished, 2, draft_vocab=True)
    assert np.array_equal(got, want), (got, want)
    assert np.isin(got[~finished], vocab).all()
    plain, same_cache = drafting.decode_greedy_steps(nxt, mask, same_cache, steps, None, 7, finished, 0)
    _, again = full.prefill(ids, mask[:, :-1])
    ref, again = full.decode_greedy_steps(nxt, mask, again, steps, None, 7, finished, 0)
    assert np.array_equal(plain, ref)
    n = same_cache.length
    assert n == again.length and all(np.array_equal(a.numpy()[:, :, :n], b.numpy()[:, :, :n])
                                      for a, b in zip(same_cache.tensors, again.tensors))
    # The logits of a flagged run (eager): the vocabulary's values, bitwise, and -inf elsewhere.
    layer = FusedLM(fused_weights(model), tokens=True, draft_vocab=vocab)
    b, t = ids.shape
    caches = [paddle.zeros([b, cfg.heads(i), t, cfg.dim_head]) for i in range(cfg.num_layers) for _ in "kv"]
    rows = paddle.to_tensor(np.arange(b) * t + t - 1)
    flagged, _ = layer(paddle.to_tensor(ids), paddle.to_tensor(mask[:, :-1]), rows, caches,
                       paddle.to_tensor(control(b, 1, draft_vocab=True)))
    whole, _ = layer(paddle.to_tensor(ids), paddle.to_tensor(mask[:, :-1]), rows, caches)
    flagged, whole = flagged.numpy(), whole.numpy()
    outside = np.setdiff1d(np.arange(cfg.vocab_size), vocab)
    assert np.array_equal(flagged[:, vocab], whole[:, vocab]) and np.all(flagged[:, outside] == -np.inf)
