"""`gptc serve`: real server processes on free loopback ports, real HTTP clients (httpx, the
official `openai` client). The tiny export is the one test_export/test_inference build.

Servers: ``server`` (Paddle Inference, the default backend: the fused program with slots in its
in-place cache, serve/slots.py; continuous batching up to 8; an
API key), ``slow`` (onnxruntime, one sequence at a time, one waiting slot, 0.1 s slept per
step so that requests stay in flight; a 5 s timeout) and, for SIGTERM, a server of its own."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from _export_helpers import ENV, LOGIT_ATOL, MEAN_SCORE_RTOL, ROOT, model_dirs
from _serve_helpers import Server

KEY = "test-key-17"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Log-probabilities the server reports from the fused program vs a float64 log-softmax of the same
# program's logits for the whole sequence: the logits are bitwise the same (batch invariance,
# tests/test_fused.py), so only the float64 exp/log/sum of 1,024 terms can differ (each within a
# few 2^-53 relative: a log-softmax near -10 within 1e-13). Measured 0. A logit off by one float32
# ulp (1e-7 and more here) fails it.
FUSED_LOGPROB_ATOL = 1e-12


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)["export"]


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    s = Server(export_dir, tmp_path_factory.mktemp("serve") / "server.log", "--max-batch", "8",
               "--max-queue", "64", env={"GPTC_API_KEY": KEY})
    yield s.ready()
    s.stop()


@pytest.fixture(scope="module")
def slow(export_dir, tmp_path_factory):
    s = Server(export_dir, tmp_path_factory.mktemp("serve") / "slow.log", "--backend", "onnx", "--max-batch", "1",
               "--max-queue", "1", "--step-delay", "0.1", "--timeout", "5")
    yield s.ready()
    s.stop()


@pytest.fixture(scope="module")
def gen(export_dir):
    """The server's backend as `gptc serve` configures it, in this process."""
    from gpt_compress.commands.serve import _paddle_serving_options
    from gpt_compress.inference.runner import Generator

    return Generator.from_dir(export_dir, backend="paddle", **_paddle_serving_options(None))


@pytest.fixture(scope="module")
def gen_bf16(tmp_path_factory, shakespeare):
    """``gen`` over the same checkpoint exported with a bfloat16 KV cache (fused program only)."""
    from gpt_compress.commands.serve import _paddle_serving_options
    from gpt_compress.export import export
    from gpt_compress.inference.runner import Generator

    out = export(model_dirs(tmp_path_factory, shakespeare)["ckpt"], str(tmp_path_factory.mktemp("bf16") / "export"),
                 formats=("paddle",), kv_cache_dtype="bfloat16")
    return Generator.from_dir(out, backend="paddle", **_paddle_serving_options(None))


def _complete(url, headers=None, **body):
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def test_openai_client_plain_and_streamed_equal_generator(server, gen):
    openai = pytest.importorskip("openai")  # the official client; the other tests need only httpx
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["export"]
    cases = [dict(temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 20, "repetition_penalty": 1.3}),
             dict(temperature=0.0)]
    for case in cases:
        extra = case.get("extra_body", {})
        sampling = dict(decode_strategy="sampling", temperature=case["temperature"], top_p=case["top_p"],
                        seed=case["seed"], **extra) if case["temperature"] else {}
        ref = gen.generate("ROMEO:", max_new_tokens=24, **sampling)
        want = gen.tokenizer.decode([t for t in ref.sequences[0] if t != gen.eos_token_id])
        plain = client.completions.create(model="export", prompt="ROMEO:", max_tokens=24, **case)
        assert plain.choices[0].text == want
        assert plain.choices[0].model_extra["token_ids"] == ref.sequences[0]
        assert plain.usage.prompt_tokens == ref.prompt_tokens[0]
        assert plain.usage.completion_tokens == len(ref.sequences[0])
        chunks = list(client.completions.create(model="export", prompt="ROMEO:", max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}, **case))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        # a chunk carries one token, or the run of them that was waiting (greedy runs): in order
        assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == ref.sequences[0]
        assert chunks[-1].usage.completion_tokens == len(ref.sequences[0])
        assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    # logprobs (plain and streamed): the chosen token's and the top 3, from the model's distribution.
    plain = client.completions.create(model="export", prompt="ROMEO:", max_tokens=4, temperature=0, logprobs=3)
    lp = plain.choices[0].logprobs
    ids = gen.tokenizer.encode("ROMEO:")
    logits = gen.backend.prefill(np.asarray([ids]), np.ones((1, len(ids)), np.int64))[0][0].astype(np.float64)
    ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    first = plain.choices[0].model_extra["token_ids"][0]
    assert lp.token_logprobs[0] == pytest.approx(ref[first], abs=FUSED_LOGPROB_ATOL)
    assert lp.top_logprobs[0][lp.tokens[0]] == lp.token_logprobs[0] == pytest.approx(ref.max(), abs=FUSED_LOGPROB_ATOL)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and value == max(top.values()) and top[token] == value  # greedy: the best
    assert "".join(lp.tokens) == plain.choices[0].text and lp.text_offset[0] == 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="export", prompt="ROMEO:", max_tokens=4, temperature=0, logprobs=3, stream=True) if c.choices]
    assert [v for c in streamed if c for v in c.token_logprobs] == lp.token_logprobs
    # The raw stream: server-sent events ending with `data: [DONE]`.
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH,
                      json={"prompt": "ROMEO:", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    # n choices per prompt, echo, stop strings.
    out = _complete(server.url, AUTH, prompt=["ROMEO:", "To be"], max_tokens=5, n=2, seed=3,
                    echo=True).json()
    assert len(out["choices"]) == 4 and out["choices"][2]["text"].startswith("To be")
    greedy = gen.generate("ROMEO:", max_new_tokens=24).texts[0]
    stop = greedy[5:7]
    cut = _complete(server.url, AUTH, prompt="ROMEO:", max_tokens=24, temperature=0, stop=[stop]).json()
    assert cut["choices"][0]["text"] == greedy[:greedy.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_concurrent_greedy_requests_equal_each_alone(server, gen):
    base = gen.tokenizer.encode("ROMEO: I say to thee, my lord, the king is come; " * 3)
    jobs = [(base[i:i + 2 + 4 * i], 8 + 3 * i) for i in range(16)]  # prompt 2..62 tokens, 8..53 new

    async def one(client, prompt, max_tokens):
        r = await client.post(server.url + "/v1/completions", headers=AUTH, timeout=300,
                              json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                    "min_tokens": max_tokens})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def run():
        async with httpx.AsyncClient() as client:
            alone = [await one(client, p, m) for p, m in jobs]
            steps = server.metric("gptc_decode_batch_size_count", AUTH)
            single = server.metric('gptc_decode_batch_size_bucket{le="1.0"}', AUTH)
            together = await asyncio.gather(*[one(client, p, m) for p, m in jobs])
            return alone, together, steps, single

    assert httpx.get(server.url + "/health").json()["decoder"] == "SlotDecoder"  # the fused program's slots
    alone, together, steps, single = asyncio.run(run())
    assert together == alone
    assert [len(t) for t in alone] == [m for _, m in jobs]
    assert alone[0] == gen.generate([jobs[0][0]], max_new_tokens=jobs[0][1], min_new_tokens=jobs[0][1]).sequences[0]
    # The 16 prompts of one request reach the engine at once (Engine.submit_all), so its first
    # admission takes several (up to --max-batch 8 within Serve.prefill_budget): batches > 1
    # whatever the timing.
    one_request = _complete(server.url, AUTH, prompt=[p for p, _ in jobs], max_tokens=53, min_tokens=53,
                            temperature=0).json()
    assert [c["token_ids"][:m] for (_, m), c in zip(jobs, one_request["choices"])] == alone
    # Decode steps with more than one sequence in the batch.
    batched = (server.metric("gptc_decode_batch_size_count", AUTH) - steps
               - (server.metric('gptc_decode_batch_size_bucket{le="1.0"}', AUTH) - single))
    assert batched > 0
    assert server.metric("gptc_running_batch_size", AUTH) == 0


@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_slot_decoder_rows_equal_each_alone(request, cache, monkeypatch):
    """In-process, the fused backend (its KV cache float32, or bfloat16: the slots' row copies
    move its bits): every third step the waiting sequences join as the free
    slots allow, several at once, prefilled together in one left-padded batch (prompts of
    1..100 tokens; a long one arriving moves the write column, leaving gaps in the other rows),
    leave at different steps (the last row moves into the freed slot), and the cache, 24 columns
    at first, is repacked and grown several times: every row's greedy tokens are those of
    running it alone."""
    from gpt_compress.serve import slots

    gen = request.getfixturevalue("gen" if cache == "float32" else "gen_bf16")
    assert gen.backend.cache_dtype == cache
    assert slots.prefill_groups([90, 3, 40, 2, 38], 1.25) == [[3, 1], [4, 2], [0]]
    assert slots.prefill_groups([5, 5, 5], 1.25) == [[0, 1, 2]] and slots.prefill_groups([], 1.25) == []
    assert type(gen.backend).__name__ == "FusedBackend"
    monkeypatch.setattr(slots, "INITIAL_CAPACITY", 24)
    monkeypatch.setattr(slots, "PAD_WASTE", 100.0)  # one prefill batch per admission, whatever the padding
    calls = []
    real_prefill = gen.backend.prefill
    monkeypatch.setattr(gen.backend, "prefill", lambda ids, mask: calls.append(ids.shape) or real_prefill(ids, mask))
    rng = np.random.default_rng(0)
    lengths = [3, 40, 2, 90, 5, 60, 7, 100, 20, 1]
    jobs = [(rng.integers(0, gen.vocab_size, n).tolist(), min(10 + 5 * i, 128 - n)) for i, n in enumerate(lengths)]
    want = [gen.generate([p], max_new_tokens=m, min_new_tokens=m).sequences[0] for p, m in jobs]
    calls.clear()
    dec = slots.SlotDecoder(gen.backend, max_batch=4, slack=2)
    out: dict[int, list] = {}
    logits: dict[int, np.ndarray] = {}
    waiting, step = list(range(len(jobs))), 0
    while waiting or logits:
        if waiting and len(dec) < 4 and step % 3 == 0:
            new, waiting = waiting[:4 - len(dec)], waiting[4 - len(dec):]
            states = dec.prefill_many([jobs[i][0] for i in new])
            dec.join([(i, state) for i, (_, state) in zip(new, states)])
            for i, (row, _) in zip(new, states):
                logits[i], out[i] = row, []
        tokens = {}
        for i, row in list(logits.items()):
            out[i].append(int(np.argmax(row)))
            if len(out[i]) == jobs[i][1]:
                del logits[i]
                dec.remove([i])
            else:
                tokens[i] = out[i][-1]
        if tokens:
            logits.update(dec.step(tokens))
        step += 1
    assert [out[i] for i in range(len(jobs))] == want
    assert calls[0] == (4, 90) and len(calls) < len(jobs)  # the first four joined at once, left-padded
    assert dec.relayouts >= 3 and dec.capacity > 24 and dec.max_rows == 4 and len(dec) == 0


def test_engine_greedy_runs_give_the_tokens_of_single_steps(gen):
    """The engine runs several greedy steps in one program call when nothing waits and every row
    is plain greedy (``Engine._greedy_run``): an EOS inside a run, ``max_tokens`` ending a run,
    rows whose ``min_tokens`` hold EOS back for different spans (single steps, or runs no longer
    than the shortest hold) and a sampled row beside greedy ones (single steps) all give each
    request the tokens ``Generator.generate`` gives it alone, in runs of 8 steps and in runs sized
    by time up to 32 (``Engine._run_steps``). A run's tokens reach the caller in one ``emit`` call
    (``Engine._flush``), the first token before the run."""
    import threading

    from gpt_compress.model.generation import MIN_RUN_STEPS
    from gpt_compress.serve.engine import Engine
    from gpt_compress.serve.request import Finished, Request, Token, request_config

    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, gen.vocab_size, n).tolist() for n in (5, 17, 9, 30)]
    free = gen.generate([prompts[0]], max_new_tokens=24).sequences[0]
    at = next(i for i in range(2, 8) if free[i] not in free[:i])  # a new token inside the first run
    eos = free[at]
    # (prompt, max_tokens, min_tokens, temperature): holds of 0, 13 and 4 tokens, a sampled row
    jobs = [(prompts[0], 24, 0, 0.0), (prompts[1], 13, 13, 0.0), (prompts[2], 9, 4, 0.0), (prompts[3], 6, 0, 0.7),
            (prompts[3], 11, 0, 0.0)]
    want = [gen.generate([p], max_new_tokens=m, min_new_tokens=lo, eos_token_id=eos, seed=3,
                         **({"decode_strategy": "sampling", "temperature": t} if t else {})).sequences[0]
            for p, m, lo, t in jobs]
    assert want[0] == free[:at + 1]

    def run(batch: list[int], max_batch: int = 4, most: int = 0) -> tuple[list, list, list]:
        engine = Engine(gen, max_batch=max_batch)
        engine.eos = eos
        engine.batch.greedy_steps = most or MIN_RUN_STEPS  # runs of 8 steps, or of up to ``most``
        if most:  # as long as the time allows, from the first run on
            engine._step_s = 1e-9
        runs = []
        real = engine.batch.step_greedy
        engine.batch.step_greedy = lambda tokens, steps, e, hold: runs.append((len(tokens), steps, hold)) or real(
            tokens, steps, e, hold)
        out = {i: [] for i in batch}
        calls = {i: [] for i in batch}  # the event types of each emit call
        done = threading.Semaphore(0)

        def emit(i):
            def on(events):
                calls[i].append([type(ev).__name__ for ev in events])
                for ev in events:
                    if isinstance(ev, Token):
                        out[i].append(ev.token_id)
                    elif isinstance(ev, Finished):
                        done.release()
                    else:
                        raise AssertionError(ev)
            return on
        reqs = [Request(prompt=jobs[i][0], cfg=request_config(jobs[i][1], jobs[i][3], 1.0, 0, 1.0, 3, jobs[i][2]),
                        emit=emit(i)) for i in batch]
        engine.start()
        engine.submit_all(reqs)
        for _ in batch:
            assert done.acquire(timeout=120)
        engine.stop()
        return [out[i] for i in batch], runs, [calls[i] for i in batch]

    got, runs, calls = run([0])
    assert got == [want[0]] and runs and runs[0][1] == MIN_RUN_STEPS  # EOS inside the first run
    assert calls == [[["Token"], ["Token"] * at + ["Finished"]]]  # the prefill's token, then the run's
    got, runs, _ = run([1, 2])
    assert got == [want[1], want[2]]
    # A run no longer than the shortest hold (3), single steps while one row's hold is over and the
    # other's is not, then row 1 alone: a run held to its end (its min_tokens is its max_tokens).
    assert runs[0] == (2, 3, 3) and runs[-1][0] == 1 and runs[-1][1] == runs[-1][2] >= 2
    got, runs, _ = run([0, 1, 2, 3])
    assert got == want[:4] and all(r[0] < 4 for r in runs)  # the sampled row: single steps while it runs
    # Three requests for two slots: runs while the third waits (no slot to admit it into).
    got, runs, _ = run([4, 0, 1], max_batch=2)
    assert got == [want[4], want[0], want[1]] and runs[0] == (2, MIN_RUN_STEPS, 0)
    # Runs longer than the backend's 8: to the nearest max_tokens, EOS inside, and held to the end.
    got, runs, _ = run([0], most=32)
    assert got == [want[0]] and runs[0] == (1, 23, 0)
    got, runs, _ = run([1], most=32)
    assert got == [want[1]] and runs == [(1, 12, 12)]


def test_engine_sizes_greedy_runs_by_the_time_a_step_took(gen):
    """A run while nothing can be admitted lasts about ``greedy_run_ms`` at the latest run's pace:
    8 steps before any ran, never fewer than 8 (the decoder allowing) nor more than the decoder's
    greedy_steps."""
    from gpt_compress.inference.fused import GREEDY_STEPS
    from gpt_compress.model.generation import MIN_RUN_STEPS
    from gpt_compress.serve.engine import Engine

    engine = Engine(gen, max_batch=4, greedy_run_ms=25.0)
    assert engine.batch.greedy_steps == GREEDY_STEPS == 32  # the fused backend's default
    assert engine._run_steps() == MIN_RUN_STEPS == 8
    for step_s, steps in ((0.001, 25), (0.01, 8), (1e-5, 32), (0.0024, 10)):
        engine._step_s = step_s
        assert engine._run_steps() == steps
    engine.batch.greedy_steps = 4  # a decoder of shorter runs
    assert engine._run_steps() == 4


def test_slot_decoder_steps_leave_no_python_objects_behind(gen):
    """A server decodes for days: a step must not leave objects behind. Two running rows of
    four slots (the steps run on views of the first rows); after the first step, 30 more leave
    the number of live Python lists unchanged. It failed when every step made new views with
    ``Tensor._slice``, whose Paddle constructor never frees a list it creates (one per cache
    tensor and step: 30 x 2 x layers here)."""
    import gc

    from gpt_compress.serve import slots

    dec = slots.SlotDecoder(gen.backend, max_batch=4)
    rng = np.random.default_rng(1)
    states = dec.prefill_many([rng.integers(0, gen.vocab_size, n).tolist() for n in (5, 9)])
    dec.join([(i, state) for i, (_, state) in enumerate(states)])
    tokens = {i: int(np.argmax(row)) for i, (row, _) in enumerate(states)}

    def step():
        for i, row in dec.step(tokens).items():
            tokens[i] = int(np.argmax(row))

    def live_lists() -> int:
        gc.collect()
        return sum(type(o) is list for o in gc.get_objects())

    step()
    before = live_lists()
    for _ in range(30):
        step()
    assert live_lists() - before == 0
    assert dec.width < dec.capacity and len(dec) == 2  # no repack in between (it would make new views)


BAD = [  # (raw body or JSON, status, words the message must contain)
    (b'{"prompt": "ROMEO:", ', 400, "malformed JSON"),
    (b'["ROMEO:"]', 400, "JSON object"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": {"text": "x"}}, 400, "prompt"),
    ({"prompt": "ROMEO:", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "ROMEO:", "max_tokens": 127}, 400, "127"),  # + prompt > the context of 128
    ({"prompt": "ROMEO:", "temperature": -1}, 400, "temperature"),
    ({"prompt": "ROMEO:", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "ROMEO:", "top_k": -5}, 400, "top_k"),
    ({"prompt": "ROMEO:", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": [1, 2, 99999]}, 400, "vocabulary"),
    ({"prompt": ""}, 400, "at least 1"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt.1"),
    ({"prompt": "Hi", "max_tokens": 3, "seed": -1}, 400, "seed"),  # once an engine crash (np.random)
    ({"prompt": "Hi", "seed": 2**64}, 400, "seed"),
    (b'{"prompt": "\\ud800"}', 400, "unicode"),  # a lone surrogate: once a 500 with a traceback
    (b'{"prompt": ["ok", "\\udfff"]}', 400, "prompt.1"),
    (b'{"prompt": "Hi", "stop": "\\ud800"}', 400, "stop"),
    ({"prompt": "Hi", "max_tokens": "4"}, 400, "max_tokens"),  # strict: a string is not a number
    ({"prompt": "Hi", "max_tokens": True}, 400, "max_tokens"),
    (b'{"prompt": "Hi", "temperature": NaN}', 400, "temperature"),
    (b'{"prompt": "Hi", "repetition_penalty": Infinity}', 400, "repetition_penalty"),
    (b'', 400, "JSON object"),
    ({"prompt": "ROMEO:", "max_tokns": 4}, 400, "max_tokns"),
    ({"prompt": "ROMEO:", "stream": "yes"}, 400, "stream"),
    ({"prompt": "ROMEO:", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "ROMEO:", "stop": ["a", ""]}, 400, "stop.1"),
    ({"prompt": "ROMEO:", "n": 100}, 400, "max_n"),
    ({"prompt": "ROMEO:", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "ROMEO:", "max_tokens": 0, "logprobs": 1}, 400, "echo"),  # 0 scores the prompt: needs echo
    ({"prompt": "ROMEO:", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "ROMEO:", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (b'{"prompt": "Hi", "frequency_penalty": NaN}', 400, "frequency_penalty"),
    ({"prompt": "ROMEO:", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "ROMEO:", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ({"prompt": "ROMEO:", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"prompt": "ROMEO:", "logit_bias": [5]}, 400, "logit_bias"),
    ({"prompt": "ROMEO:", "best_of": 0}, 400, "best_of"),
    ({"prompt": "ROMEO:", "best_of": 1, "n": 2}, 400, "best_of"),
    ({"prompt": "ROMEO:", "best_of": 3, "stream": True}, 400, "best_of"),
    ({"prompt": "ROMEO:", "best_of": 100}, 400, "max_n"),
    ({"prompt": "ROMEO:", "model": "gpt-4"}, 404, "gpt-4"),
]


def test_the_servers_connections_send_without_nagle():
    """``gptc serve``'s socket: a connection it accepts has TCP_NODELAY, so a response's segments
    leave at once. (A protocol-0 socket's connections kept Nagle's algorithm: every response on a
    kept-alive connection then waited about 40 ms for the client's delayed ACK.)"""
    import socket

    from gpt_compress.commands.serve import listening_socket

    with listening_socket("127.0.0.1", 0) as sock:
        sock.listen(1)
        with socket.create_connection(sock.getsockname()) as client:
            conn, _ = sock.accept()
            with conn:
                assert conn.proto == socket.IPPROTO_TCP
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # not a property of the host


def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_goes_on(server):
    assert len(BAD) >= 12
    for body, status, words in BAD:
        kw = {"content": body, "headers": {**AUTH, "Content-Type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body, "headers": AUTH}
        r = httpx.post(server.url + "/v1/completions", timeout=60, **kw)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert words in error["message"] and "Traceback" not in error["message"], (body, r.text)
        ok = _complete(server.url, AUTH, prompt="ROMEO:", max_tokens=2)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) >= 1
    assert "prompt 0 has 2 tokens and max_tokens is 127" in _complete(
        server.url, AUTH, prompt="ROMEO:", max_tokens=127).json()["error"]["message"]
    assert httpx.get(server.url + "/v1/completions", headers=AUTH).status_code == 405
    for ctype in ({}, {"Content-Type": "text/plain"}):  # JSON only, as a browser cannot send it across sites
        r = httpx.post(server.url + "/v1/completions", headers={**AUTH, **ctype}, content=b'{"prompt": "Hi"}')
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_api_key(server):
    assert httpx.get(server.url + "/health").status_code == 200  # /health needs no key
    for headers in (None, {"Authorization": "Bearer wrong"}):
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert _complete(server.url, headers, prompt="ROMEO:", max_tokens=2).status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    assert _complete(server.url, AUTH, prompt="ROMEO:", max_tokens=2).status_code == 200
    openai = pytest.importorskip("openai")  # the official client; the checks above need only httpx
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").completions.create(
            model="export", prompt="ROMEO:", max_tokens=2)


def _next_event(lines):
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("no event")


LONG = {"prompt": "ROMEO:", "max_tokens": 100, "min_tokens": 100, "temperature": 0, "stream": True}


def test_cancelled_stream_frees_its_slot(slow):
    before = slow.metric("gptc_generation_tokens_total")
    cancelled = slow.metric('gptc_engine_requests_total{status="cancelled"}')
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", slow.url + "/v1/completions", json=LONG) as r:
            assert "token_ids" in _next_event(r.iter_lines())["choices"][0]
        # The client is gone: a later request (one slot only) is admitted and finishes.
        r = client.post(slow.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "min_tokens": 3})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    assert slow.metric('gptc_engine_requests_total{status="cancelled"}') == cancelled + 1
    assert slow.metric("gptc_generation_tokens_total") - before < 100  # the stream stopped early


def test_queue_full_gets_429_with_retry_after(slow):
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with a.stream("POST", slow.url + "/v1/completions", json=LONG) as running:
            held = running.iter_lines()  # kept referenced: a closed iterator closes the connection
            _next_event(held)  # this request holds the one batch slot
            with b.stream("POST", slow.url + "/v1/completions", json=LONG):  # waits in the one queue slot
                end = time.monotonic() + 60
                while slow.metric("gptc_queue_depth") < 1 and time.monotonic() < end:
                    time.sleep(0.05)
                r = httpx.post(slow.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2})
                assert r.status_code == 429 and r.headers["Retry-After"] == "1"
                assert "busy" in r.json()["error"]["message"]
    # Both streams are closed: their requests leave the queue and the batch within a step or two.
    end = time.monotonic() + 60
    while (slow.metric("gptc_queue_depth") or slow.metric("gptc_running_batch_size")) and time.monotonic() < end:
        time.sleep(0.05)
    assert _complete(slow.url, prompt="ROMEO:", max_tokens=2).status_code == 200


def test_request_timeout(slow):
    r = _complete(slow.url, prompt="ROMEO:", max_tokens=100, min_tokens=100)  # 100 steps x 0.1 s > 5 s
    assert r.status_code == 504 and "timed out after 5 s" in r.json()["error"]["message"]
    assert _complete(slow.url, prompt="ROMEO:", max_tokens=2).status_code == 200


def test_sigterm_drains_in_flight_requests_then_exits_0(export_dir, tmp_path):
    s = Server(export_dir, tmp_path / "drain.log", "--backend", "onnx", "--step-delay", "0.05").ready()
    try:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={**LONG, "max_tokens": 30, "min_tokens": 30}) as r:
            lines = r.iter_lines()
            events = [_next_event(lines)]
            s.proc.send_signal(signal.SIGTERM)
            lines = [line for line in lines if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events += [json.loads(line[6:]) for line in lines[:-1]]
        assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 30  # all of it, after SIGTERM
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health")
    finally:
        s.stop()


@pytest.mark.parametrize("backend", ["onnx", "paddle"])
def test_an_exception_in_one_request_fails_only_that_request(export_dir, backend):
    """In-process, both batch decoders: a backend whose prefill raises for one prompt, and a
    request whose sampling state cannot be made (a negative seed: ``np.random.default_rng``
    raises; once, the row joined the batch without its request and every later step failed);
    each fails alone, the others finish with their own tokens, and the engine serves on."""
    import dataclasses
    import queue

    from gpt_compress.inference.runner import Generator
    from gpt_compress.serve.engine import Engine
    from gpt_compress.serve.request import Failed, Finished, Request, request_config

    gen = Generator.from_dir(export_dir, backend=backend)
    prompts = [[5, 6, 7], [13, 14], [8, 9, 10, 11], [20, 21]]
    want = {i: gen.generate([prompts[i]], max_new_tokens=6, min_new_tokens=6).sequences[0] for i in (0, 2)}
    real_prefill = gen.backend.prefill

    def prefill(ids, mask):
        if 13 in ids:
            raise RuntimeError("boom")
        return real_prefill(ids, mask)

    gen.backend.prefill = prefill
    engine = Engine(gen, max_batch=4, max_queue=8).start()
    try:
        events = queue.Queue()
        greedy = request_config(6, 0.0, 1.0, 0, 1.0, None, 6)
        bad_seed = dataclasses.replace(greedy)
        bad_seed.seed = -1  # the config and the server refuse it (400); set past their checks, it gets through
        def to_queue(i):
            return lambda evs: [events.put((i, ev)) for ev in evs]
        engine.submit_all([Request(p, bad_seed if i == 3 else greedy, emit=to_queue(i))
                           for i, p in enumerate(prompts)])  # admitted together
        ends, tokens = {}, {0: [], 2: []}
        while len(ends) < 4:
            i, ev = events.get(timeout=60)
            assert i not in ends  # one last event per request
            if isinstance(ev, (Failed, Finished)):
                ends[i] = ev
            else:
                tokens[i].append(ev.token_id)
        assert isinstance(ends[1], Failed) and ends[1].status == 500 and "boom" in ends[1].message
        assert isinstance(ends[3], Failed) and ends[3].status == 500 and "ValueError" in ends[3].message
        for i in (0, 2):
            assert isinstance(ends[i], Finished)
            assert tokens[i] == want[i]
        # The engine goes on: a later request is served, and nothing is left in the batch.
        engine.submit(Request(prompts[0], greedy, emit=to_queue(0)))
        later = []
        while not isinstance(ev := events.get(timeout=60)[1], (Failed, Finished)):
            later.append(ev.token_id)
        assert isinstance(ev, Finished) and later == want[0]
        assert engine.running == 0 and len(engine.batch) == 0
        assert events.empty()
    finally:
        engine.stop()


def test_serve_config_section_and_cli_errors(export_dir, tmp_path):
    from gpt_compress.config import ConfigError, load_config

    cfg = load_config(None, ["Serve.max_batch=4", "Serve.backend=onnx"]).serve
    assert (cfg.max_batch, cfg.backend, cfg.host) == (4, "onnx", "127.0.0.1")
    with pytest.raises(ConfigError, match="max_batch"):
        load_config(None, ["Serve.max_batch=0"])
    proc = subprocess.run([sys.executable, "-m", "gpt_compress", "serve", "--model-dir", str(tmp_path)],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "gptc serve: error:" in proc.stderr and "manifest.json" in proc.stderr


def test_a_draft_model_serves_the_tokens_of_the_model(export_dir, gen, shakespeare, tmp_path_factory):
    """`gptc serve --draft DIR` (the pruned export, its own slot cache): a greedy completion equals
    the one without a draft, a seeded sampled one equals ``Generator.generate`` with the same draft
    and k (the rejection rule: the model's distribution, tests/test_speculative.py), streamed or
    not; /metrics gives the acceptance rate and the tokens per step. A draft it cannot load is
    an error before it listens."""
    draft = model_dirs(tmp_path_factory, shakespeare)["pruned_export"]
    s = Server(export_dir, tmp_path_factory.mktemp("serve") / "draft.log", "--draft", draft,
               "--speculative-tokens", "4").ready()
    try:
        prompt = "ROMEO:\nBut, soft! what light through yonder window breaks?\nROMEO:\nBut, soft!"
        for sampling in ({}, dict(decode_strategy="sampling", temperature=0.8, top_p=0.9, seed=11)):
            ref = gen.generate(prompt, max_new_tokens=24, **sampling,
                               **({"draft": draft, "draft_tokens": 4} if sampling else {}))
            body = dict(prompt=prompt, max_tokens=24, temperature=sampling.get("temperature", 0.0),
                        top_p=sampling.get("top_p", 1.0), seed=sampling.get("seed"))
            assert _complete(s.url, **body).json()["choices"][0]["token_ids"] == ref.sequences[0], sampling
            with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert [t for e in events for t in e["choices"][0]["token_ids"]] == ref.sequences[0], sampling
        rate = s.metric("gptc_speculative_acceptance_rate")
        per_step = s.metric("gptc_speculative_tokens_per_step")
        assert s.metric("gptc_speculative_draft_tokens_total") > 0 and 0 < rate < 1 and per_step > 1
        assert s.metric("gptc_speculative_draft_seconds_total") > 0
    finally:
        s.stop()
    for args, message in [(["--draft", "auto"], "records no draft"),
                          (["--draft", draft, "--backend", "onnx"], "needs --backend paddle")]:
        proc = subprocess.run([sys.executable, "-m", "gpt_compress", "serve", "--model-dir", export_dir, *args],
                              env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_schemathesis_fuzzes_the_servers_own_schema(export_dir, tmp_path):
    """schemathesis drives `gptc serve`'s OpenAPI schema (loopback only): generated requests
    across every endpoint, valid and invalid (coverage and fuzzing phases, deterministic
    generation), with every check but ``positive_data_acceptance`` (a schema-valid prompt may
    still be too long for the context: a 400 the schema cannot express). Not one 5xx, not one
    response outside the schema (status, content type, body, headers), and the server healthy
    after. The suite's run is bounded (``GPTC_FUZZ_EXAMPLES`` per endpoint, 30 by default, and
    ``GPTC_FUZZ_SECONDS``, 180); ``GPTC_FUZZ_EXAMPLES=350 GPTC_FUZZ_SECONDS=900`` runs over 1,000."""
    pytest.importorskip("schemathesis")
    examples = int(os.environ.get("GPTC_FUZZ_EXAMPLES", "30"))
    seconds = int(os.environ.get("GPTC_FUZZ_SECONDS", "180"))
    s = Server(export_dir, tmp_path / "fuzz.log", "--max-batch", "4", "--max-queue", "4",
               "-o", "Serve.max_n=2", "-o", "Serve.max_tokens_default=2").ready()
    try:
        schema = httpx.get(s.url + "/openapi.json").json()
        props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
        assert props["max_tokens"]["anyOf"][0]["maximum"] == 127  # the loaded model's context - 1
        assert {"/health", "/metrics", "/v1/models", "/v1/completions", "/tokenize", "/detokenize",
                "/tokenizer_info"} <= set(schema["paths"])
        proc = subprocess.run([str(Path(sys.executable).parent / "st"), "run", s.url + "/openapi.json", "--checks", "all",
                               "--exclude-checks", "positive_data_acceptance", "--max-examples", str(examples),
                               "--phases", "coverage,fuzzing", "--generation-deterministic", "--continue-on-failure",
                               "--max-time", str(seconds), "--request-timeout", "120", "--no-color", "--workers", "1"],
                              capture_output=True, text=True, timeout=seconds + 300, cwd=tmp_path,
                              env=ENV)
        out = proc.stdout + proc.stderr
        generated = re.search(r"(\d+) generated, (\d+) passed", out)
        assert proc.returncode == 0 and generated, out[-6000:]
        need = 1000 if examples >= 350 else 100  # the bounded default still fuzzes every endpoint
        assert int(generated.group(1)) >= need and generated.group(1) == generated.group(2), out[-3000:]
        metrics = httpx.get(s.url + "/metrics").text
        assert not re.search(r'gptc_http_requests_total\{endpoint="[^"]*",status="5\d\d"\}', metrics)
        assert httpx.get(s.url + "/health").status_code == 200
        ok = _complete(s.url, prompt="ROMEO:", max_tokens=3, min_tokens=3, temperature=0)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3
        assert s.metric("gptc_running_batch_size") == 0 and s.metric("gptc_queue_depth") == 0
    finally:
        s.stop()


def test_vllm_tokenizer_endpoints(server, gen):
    """/tokenize, /detokenize and /tokenizer_info as vLLM answers them (lm-evaluation-harness's
    remote tokenizer): the model's own tokenizer, special tokens written in the text included."""
    text = "ROMEO: I say to thee"
    ids = gen.tokenizer.encode(text)
    r = httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": 128, "tokens": ids}
    r = httpx.post(server.url + "/detokenize", headers=AUTH, json={"tokens": ids, "model": "export"})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    info = httpx.get(server.url + "/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 128
    eos = httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": info["eos_token"]}).json()["tokens"]
    assert eos == [gen.tokenizer.eod_id]
    for path, body, status, words in [("/detokenize", {"tokens": [1, 99999]}, 400, "vocabulary"),
                                      ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
                                      ("/tokenize", {"prompt": 5}, 400, "prompt"),
                                      ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
                                      ("/tokenize", {"text": "x"}, 400, "text")]:
        r = httpx.post(server.url + path, headers=AUTH, json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], (path, body, r.text)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_echo_logprobs_score_the_prompt_as_score_does(server, gen):
    """echo + logprobs: each prompt token's log-probability given the tokens before it (the
    first null) and the top alternatives, equal to ``score``'s log-softmax; ``max_tokens`` 0
    scores without generating; prompts in every OpenAI form, one choice per prompt in order."""
    texts = ["ROMEO: I say to thee, my lord", "JULIET: what light"]
    ids = [gen.tokenizer.encode(t) for t in texts]
    refs = [_log_softmax(gen.score(np.asarray([p]))[0]) for p in ids]
    for prompt in (texts, ids, texts[0], ids[0]):
        out = _complete(server.url, AUTH, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0).json()
        many = isinstance(prompt, list) and isinstance(prompt[0], (str, list))
        assert [c["index"] for c in out["choices"]] == list(range(2 if many else 1))
        assert out["usage"]["completion_tokens"] == 0
        for choice, p, ref in zip(out["choices"], ids, refs):
            lp = choice["logprobs"]
            assert choice["text"] == gen.tokenizer.decode(p) and choice["token_ids"] == []
            assert choice["finish_reason"] == "length"
            assert lp["tokens"] == [gen.tokenizer.decode([t]) for t in p]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            want = [ref[k - 1, p[k]] for k in range(1, len(p))]
            np.testing.assert_allclose(lp["token_logprobs"][1:], want, rtol=0, atol=FUSED_LOGPROB_ATOL)
            for k in range(1, len(p)):
                best = np.argsort(-ref[k - 1])[:2]
                top = lp["top_logprobs"][k]
                assert set(top) == {gen.tokenizer.decode([int(t)]) for t in best} | {lp["tokens"][k]}
                assert max(top.values()) == pytest.approx(ref[k - 1, best[0]], abs=FUSED_LOGPROB_ATOL)
            assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    # With generation (lm-evaluation-harness's request): the prompt's entries, then the generated one.
    body = dict(prompt=[ids[0]], max_tokens=1, echo=True, logprobs=1, temperature=0)
    out = _complete(server.url, AUTH, **body).json()["choices"][0]
    lp = out["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids[0]) + 1 and out["token_ids"] == [int(np.argmax(refs[0][-1]))]
    assert lp["token_logprobs"][-1] == pytest.approx(refs[0][-1].max(), abs=FUSED_LOGPROB_ATOL)
    np.testing.assert_allclose(lp["token_logprobs"][1:-1], [refs[0][k - 1, ids[0][k]] for k in range(1, len(ids[0]))],
                               rtol=0, atol=FUSED_LOGPROB_ATOL)
    # Streamed: the echo chunk carries the prompt's log-probabilities.
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == texts[0] and first["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH,
                      json={**body, "max_tokens": 0, "stream": True}) as r:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    assert [(c["text"], c["finish_reason"]) for c in chunks] == [(texts[0], None), ("", "length")]
    assert chunks[0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]


def test_penalties_logit_bias_and_best_of_equal_generator(server, gen):
    """presence_penalty, frequency_penalty and logit_bias choose the tokens ``Generator.generate``
    chooses with the same settings (``model/generation.py``); best_of returns the candidates of
    highest mean token log-probability among those n=best_of gives with the same seed."""
    plain = gen.generate("ROMEO:", max_new_tokens=24).sequences[0]
    banned, forced = plain[0], plain[3]
    cases = [dict(presence_penalty=1.5), dict(frequency_penalty=2.0), dict(presence_penalty=-1.0, frequency_penalty=0.5),
             dict(logit_bias={banned: -100.0}), dict(logit_bias={forced: 100.0}),
             dict(temperature=0.9, seed=11, frequency_penalty=1.0, logit_bias={banned: -5.0})]
    for case in cases:
        sampling = dict(decode_strategy="sampling", temperature=0.9, seed=11) if "seed" in case else {}
        options = {k: v for k, v in case.items() if k not in ("temperature", "seed")}
        want = gen.generate("ROMEO:", max_new_tokens=24, **sampling, **options).sequences[0]
        body = {"temperature": 0, **case, **({"logit_bias": {str(k): v for k, v in case["logit_bias"].items()}}
                                           if "logit_bias" in case else {})}
        got = _complete(server.url, AUTH, prompt="ROMEO:", max_tokens=24, **body).json()
        assert got["choices"][0]["token_ids"] == want, case
        assert want != plain, case  # the option changed the tokens
    assert gen.generate("ROMEO:", max_new_tokens=24, logit_bias={banned: -100.0}).sequences[0][0] != banned
    assert set(gen.generate("ROMEO:", max_new_tokens=5, logit_bias={forced: 100.0}).sequences[0]) == {forced}
    with pytest.raises(Exception, match="logit_bias"):
        gen.generate("ROMEO:", max_new_tokens=2, logit_bias={10**6: 1.0})
    # best_of: the n best by mean log-probability of the best_of candidates (seed + j each).
    body = dict(prompt=["ROMEO:", "JULIET:"], max_tokens=8, temperature=1.0, seed=5)
    every = _complete(server.url, AUTH, n=4, logprobs=0, **body).json()["choices"]
    best = _complete(server.url, AUTH, n=2, best_of=4, **body).json()
    for p in range(2):
        group = every[4 * p:4 * p + 4]
        mean = [sum(c["logprobs"]["token_logprobs"]) / len(c["token_ids"]) for c in group]
        order = sorted(range(4), key=lambda j: -mean[j])[:2]
        assert [c["token_ids"] for c in best["choices"][2 * p:2 * p + 2]] == [group[j]["token_ids"] for j in order]
    assert [c["index"] for c in best["choices"]] == [0, 1, 2, 3]
    assert best["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in every)
    # Generator (and `gptc generate`: model/generation.py's best_of) keeps the same candidate.
    one = _complete(server.url, AUTH, prompt="ROMEO:", max_tokens=8, temperature=1.0, seed=5, best_of=4).json()
    assert one["choices"][0]["token_ids"] == gen.generate("ROMEO:", max_new_tokens=8, decode_strategy="sampling",
                                                          temperature=1.0, seed=5, best_of=4).sequences[0]


LAMBADA_TASK = """task: lambada_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
WIKITEXT_TASK = """task: wikitext_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


def test_lm_evaluation_harness_scores_equal_gptc_eval(server, gen, shared_data, export_dir, tmp_path):
    """lm-evaluation-harness's own CLI (``local-completions``, the server's remote tokenizer, local
    task YAMLs, no download) on the served model gives ``gptc eval``'s figures on the same text:
    LAMBADA accuracy and perplexity of its split (``accuracy_harness``, ``harness_ppl``), and a
    rolling WikiText log-likelihood whose word perplexity is ``gptc eval``'s total NLL over the
    harness's word count.

    Windows: the harness sends at most ``max_length - 1`` = 127 tokens (+ 1 generated: the
    context of 128), so ``gptc eval --seq-len 126`` (contexts cut to 127 tokens with the
    target). Its rolling windows predict 126 tokens each, the first given a prefix token; gptc
    eval's windows of 126 inputs predict from the text's second token, so its file starts with
    that prefix token (a newline: ``custom_prefix_token_id``)."""
    pytest.importorskip("lm_eval")
    # 30 LAMBADA passages (beyond this tiny Shakespeare model: none is right) and 10 Shakespeare
    # passages ending with the word the model itself continues them with, so that the accuracy
    # compared is not 0.
    lines = (shared_data / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:30]
    play = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = gen.tokenizer
    for start in range(1000, 61000, 2000):
        prefix = play[start:start + 200].rsplit(" ", 1)[0]
        words, n = (prefix + gen.generate(prefix, max_new_tokens=8).texts[0]).split(" "), len(prefix.split(" "))
        if len(words) <= n:
            continue
        context, word = " ".join(words[:n]), words[n].split("\n")[0]  # the word up to a line break
        # the harness encodes the whole text and splits it, gptc eval encodes the parts: keep the
        # passages whose tokens agree
        if word and tok.encode(context) + tok.encode(" " + word) == tok.encode(f"{context} {word}"):
            lines.append(json.dumps({"text": f"{context} {word}"}) + "\n")
    lines = lines[:40]
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(lines), encoding="utf-8")
    # A WikiText slice of 126 x k tokens: gptc eval's last window is then full (a padded one also
    # scores its last token predicting the EOS padding, FleetX's protocol, which the harness does not).
    raw = gen.tokenizer.encode((shared_data / "wikitext-2" / "wiki.test.raw").read_text(encoding="utf-8")[:4000].strip())
    text = next(t for t in (gen.tokenizer.decode(raw[:126 * k]) for k in range(8, 2, -1))
                if len(gen.tokenizer.encode(t)) % 126 == 0 and t == t.strip())
    (tmp_path / "wikitext.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    newline = gen.tokenizer.encode("\n")
    assert len(newline) == 1 and gen.tokenizer.encode("\n" + text) == newline + gen.tokenizer.encode(text)
    (tmp_path / "wikitext_gptc.txt").write_text("\n" + text, encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "lambada_local.yaml").write_text(LAMBADA_TASK.format(data=lambada))
    (tasks / "wikitext_local.yaml").write_text(WIKITEXT_TASK.format(data=tmp_path / "wikitext.jsonl"))
    args = (f"base_url={server.url}/v1/completions,model=export,tokenizer_backend=remote,auth_token={KEY},"
            f"max_length=128,custom_prefix_token_id={newline[0]},max_retries=1")
    env = {**ENV, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions",
                           "--model_args", args, "--batch_size", "8", "--tasks", "lambada_local,wikitext_local", "--include_path",
                           str(tasks), "--output_path", str(tmp_path / "out")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]

    def gptc_eval(*extra):
        out = subprocess.run([sys.executable, "-m", "gpt_compress", "eval", "--model", export_dir, "--backend",
                              "paddle", "--seq-len", "126", "--no-progress", *extra],
                             env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout[out.stdout.index("{"):])

    ours = gptc_eval("--task", "lambada", "--data", str(lambada))
    harness = results["lambada_local"]
    assert ours["num_examples"] == len(lines) > 30 and ours["truncated_contexts"] > 0  # the window matters
    assert ours["accuracy_harness"] > 0
    assert harness["acc,none"] == ours["accuracy_harness"]  # the same greedy checks of the same examples
    # The same per-token log-probabilities, summed in another order and arithmetic (measured 6.0e-8)
    assert harness["perplexity,none"] == pytest.approx(ours["harness_ppl"], rel=MEAN_SCORE_RTOL)
    wiki = gptc_eval("--task", "wikitext", "--data", str(tmp_path / "wikitext_gptc.txt"), "--input-format", "raw")
    assert wiki["num_windows"] > 2 and wiki["num_scored"] == len(gen.tokenizer.encode(text))
    words = len(re.split(r"\s+", text))  # the harness's word count (its count_words)
    total_nll = wiki["avg_loss"] * (wiki["num_tokenized_tokens"] - 1)
    word_ppl = results["wikitext_local"]["word_perplexity,none"]
    assert word_ppl == pytest.approx(np.exp(total_nll / words), rel=MEAN_SCORE_RTOL)


CHAT_TEMPLATE = "QUESTION: {question}\nANSWER:"


def test_chat_completions_on_a_finetuned_model_equal_gptc_generate(server, shakespeare, tmp_path_factory, tmp_path):
    """`gptc finetune` records its prompt template; the export carries it, and
    /v1/chat/completions makes the last user message the prompt through it: the reply (plain
    and streamed) equals `gptc generate` on the finetuned checkpoint with that prompt and the
    same settings. A model with no prompt format gets a 400 saying so."""
    ckpt = model_dirs(tmp_path_factory, shakespeare)["ckpt"]
    rows = [{"question": f"who speaks in scene {i}?", "tgt": " ROMEO and JULIET, my lord."} for i in range(16)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    options = [f"Finetune.train_file={train}", f"Finetune.prompt_template={json.dumps(CHAT_TEMPLATE)}",
               f"Global.output_dir={tmp_path / 'ft'}", "Data.seq_length=128", "Engine.max_steps=4",
               "Engine.global_batch_size=4", "Engine.micro_batch_size=4", "Engine.save_steps=0",
               "Engine.eval_freq=0", "Engine.logging_freq=0"]

    def gptc(*args):
        out = subprocess.run([sys.executable, "-m", "gpt_compress", *args], env=ENV, cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    gptc("finetune", "--no-progress", "--model", str(ckpt), *[x for o in options for x in ("-o", o)])
    model = tmp_path / "ft" / "model"
    assert json.loads((model / "config.json").read_text())["prompt_template"] == CHAT_TEMPLATE
    gptc("export", "--model", str(model), "--output", str(tmp_path / "export"), "--format", "paddle")
    s = Server(str(tmp_path / "export"), tmp_path / "chat.log").ready()
    try:
        question = "who speaks in scene 3?"
        messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": question}]
        for settings, overrides in [({"temperature": 0}, []),
                                    ({"temperature": 0.8, "seed": 3, "presence_penalty": 0.5},
                                     ["Generation.decode_strategy=sampling", "Generation.temperature=0.8",
                                      "Generation.seed=3", "Generation.presence_penalty=0.5"])]:
            out = gptc("generate", "--model", str(model), "--prompt", CHAT_TEMPLATE.format(question=question),
                       "--no-stream", "-o", "Generation.max_new_tokens=12", *[x for o in overrides for x in ("-o", o)])
            ref = json.loads(out.strip().splitlines()[-1])["results"][0]
            want = ref["text"].replace("<|endoftext|>", "")
            r = httpx.post(s.url + "/v1/chat/completions", timeout=120,
                           json={"messages": messages, "max_tokens": 12, **settings})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {
                "role": "assistant", "content": want}, (body, ref)
            assert body["usage"]["completion_tokens"] == len(ref["new_tokens"])
            assert body["usage"]["prompt_tokens"] == ref["prompt_tokens"]
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=120,
                              json={"messages": messages, "max_tokens": 12, "stream": True, **settings}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == want
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": messages[:1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "user" in r.text
    finally:
        s.stop()
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "no prompt format" in r.json()["error"]["message"]
    for body, field in [({"messages": []}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
                        ({"messages": messages, "presence_penalty": 3}, "presence_penalty"),
                        ({"messages": messages, "logit_bias": {"x": 1}}, "logit_bias")]:
        r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


@pytest.mark.parametrize("backend", ["fused", "onnx"])
def test_prompt_scores_equal_log_softmax_on_every_scoring_path(export_dir, gen, backend):
    """``top_logprobs`` (the engine's prompt scores) equals the full logits' log-softmax on each
    path: the fused program's rows (``logits_at``) and, on an export with the scoring programs,
    ``head_scores`` (k <= 1: no logits leave the backend) or the full logits (k > 1)."""
    from gpt_compress.eval.scoring import top_logprobs
    from gpt_compress.inference.runner import Generator

    runner = gen if backend == "fused" else Generator.from_dir(export_dir, backend="onnx")
    assert runner.scores_rows if backend == "fused" else runner.scores_positions
    prompts = [gen.tokenizer.encode(t) for t in ("ROMEO: I say to thee, my lord", "JULIET: what light", "Ay")]
    width = max(map(len, prompts))
    ids = np.zeros((3, width), np.int64)
    select = np.zeros((3, width), bool)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
        select[i, :len(p) - 1] = True
    labels = np.roll(ids, -1, axis=1)
    ref = np.concatenate([_log_softmax(gen.score(np.asarray([p]))[0][:-1]) for p in prompts])
    want = ref[np.arange(len(ref)), np.concatenate([p[1:] for p in prompts]).astype(np.int64)]
    # fused: the same logits (FUSED_LOGPROB_ATOL); onnxruntime's scoring programs: a logit and a
    # log-sum-exp each within LOGIT_ATOL of the fused program's (measured 9.8e-7)
    tol = FUSED_LOGPROB_ATOL if backend == "fused" else 2 * LOGIT_ATOL
    for k in (0, 1, 3):
        lp, top_ids, top_lp = top_logprobs(runner.backend, ids, labels, select, k)
        np.testing.assert_allclose(lp, want, rtol=0, atol=tol)
        assert top_ids.shape == (len(want), k)
        np.testing.assert_allclose(top_lp, -np.sort(-ref, axis=-1)[:, :k], rtol=0, atol=tol)
        np.testing.assert_allclose(np.take_along_axis(ref, top_ids, axis=-1), top_lp, rtol=0, atol=tol)
