"""The server's less travelled paths, in process (the application of `gptc serve` on the shared
tiny export through Starlette's TestClient): /health while loading and after a load error, the
batch decoder of onnxruntime and of the unfused Paddle programs with several rows over HTTP,
seeded requests of different sampling settings chosen together (and one of them failing),
latency metrics, a client leaving a non-streaming request, requests during shutdown, an error in
the middle of a stream, a timeout while queued, min_tokens > max_tokens, a text prompt to a model
without a tokenizer; then the command's own flags on a `gptc serve` subprocess."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from _export_helpers import ENV, ROOT, model_dirs
from _serve_helpers import run_engine

pytest.importorskip("fastapi")  # the `serve` extra
from fastapi.testclient import TestClient  # noqa: E402

from gpt_compress.config import ServeConfig  # noqa: E402
from gpt_compress.serve.app import create_app  # noqa: E402

PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:\nBefore we proceed"]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, shakespeare):
    return model_dirs(tmp_path_factory, shakespeare)["export"]


@pytest.fixture(scope="module")
def onnx_gen(export_dir):
    from gpt_compress.inference.runner import Generator

    return Generator.from_dir(export_dir, backend="onnx")


def _wait_health(client, status: int, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while True:
        r = client.get("/health")
        if r.status_code == status or time.monotonic() > end:
            return r
        time.sleep(0.05)


@contextlib.contextmanager
def serving(load, **cfg):
    """The app around ``load`` with ServeConfig(**cfg), its lifespan running: (client, state)."""
    fatal: list[str] = []
    app = create_app(load, ServeConfig(**cfg), "tiny", on_fatal=fatal.append)
    with TestClient(app) as client:
        client.fatal = fatal
        yield client, app.state.serve


@contextlib.contextmanager
def ready(gen, **cfg):
    with serving(lambda: gen, **cfg) as (client, state):
        assert _wait_health(client, 200).status_code == 200
        yield client, state


def metric(client, name: str, labels: str = "") -> float:
    """A sample of /metrics; a name that is not there fails (a renamed metric must not read 0)."""
    text = client.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def greedy_alone(gen, prompt, n: int) -> list[int]:
    ids = gen.encode(prompt)[0]
    return gen.generate([ids], max_new_tokens=n, min_new_tokens=n).sequences[0]


def test_health_is_503_loading_until_the_model_is_loaded(onnx_gen):
    release = threading.Event()

    def load():
        release.wait(60)
        return onnx_gen

    with serving(load) as (client, state):
        r = client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2})
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]
        release.set()
        r = _wait_health(client, 200)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200
        assert not client.fatal


def test_health_is_503_with_the_message_after_a_load_error():
    def load():
        raise RuntimeError("no such program: decode.pdmodel")

    with serving(load) as (client, state):
        r = _wait_health(client, 503)
        end = time.monotonic() + 60
        while r.json()["status"] == "loading" and time.monotonic() < end:
            time.sleep(0.05)
            r = client.get("/health")
        assert r.status_code == 503
        assert r.json() == {"status": "error", "message": "RuntimeError: no such program: decode.pdmodel"}
        assert client.fatal == ["RuntimeError: no such program: decode.pdmodel"]  # the command exits 1 on it
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2})
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]


@pytest.mark.parametrize("backend", ["onnx", "paddle-unfused"])
def test_batch_decoder_rows_over_http_equal_each_alone(export_dir, onnx_gen, backend):
    """Three prompts of different lengths in one request are admitted together and decoded as
    one batch of three rows (BatchDecoder: onnxruntime, unfused Paddle); each row's greedy
    tokens are those of generating it alone, and the latency metrics count every token."""
    from gpt_compress.commands.serve import _paddle_serving_options
    from gpt_compress.inference.runner import Generator

    gen = onnx_gen if backend == "onnx" else Generator.from_dir(
        export_dir, backend="paddle", fused=False, **_paddle_serving_options(None))
    n = 12
    with ready(gen, max_batch=4) as (client, state):
        assert client.get("/health").json()["decoder"] == "BatchDecoder"
        r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": n, "min_tokens": n,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["token_ids"] for c in choices] == [greedy_alone(gen, p, n) for p in PROMPTS]
        assert [c["text"] for c in choices] == [gen.tokenizer.decode(c["token_ids"]) for c in choices]
        # n - 1 decode steps of 3 rows (the first token comes from the prefill).
        assert metric(client, "gptc_decode_batch_size_count") == n - 1
        assert metric(client, "gptc_decode_batch_size_bucket", '{le="2.0"}') == 0
        assert metric(client, "gptc_decode_batch_size_sum") == 3 * (n - 1)
        # Latency histograms: a first token per row, n - 1 inter-token gaps per row.
        assert metric(client, "gptc_time_to_first_token_seconds_count") == 3
        assert metric(client, "gptc_inter_token_latency_seconds_count") == 3 * (n - 1)
        assert metric(client, "gptc_time_to_first_token_seconds_sum") > 0
        assert metric(client, "gptc_inter_token_latency_seconds_sum") > 0
        assert metric(client, "gptc_generation_tokens_total") == 3 * n
        assert metric(client, "gptc_engine_requests_total", '{status="ok"}') == 3


@pytest.mark.parametrize("backend", ["onnx", "paddle"])
def test_requests_sampled_together_each_get_their_tokens_alone(export_dir, onnx_gen, backend):
    """Seeded requests of different sampling settings running in one batch (two alike, top-k, a
    repetition penalty, a logit bias, log-probabilities, a greedy one) have their tokens chosen
    together at every step (``Engine._choose_all``: the alike ones warped and drawn at once); each
    gets the tokens ``Generator.generate`` gives it alone with its seed, on the batch decoder
    (onnxruntime) and on the fused program's slots (Paddle, the server's default)."""
    from gpt_compress.commands.serve import _paddle_serving_options
    from gpt_compress.inference.runner import Generator
    from gpt_compress.serve.engine import Engine
    from gpt_compress.serve.request import Finished, request_config

    gen = onnx_gen if backend == "onnx" else Generator.from_dir(export_dir, backend="paddle",
                                                                **_paddle_serving_options(None))
    prompts = [gen.tokenizer.encode(p) for p in PROMPTS]
    # (max_tokens, temperature, top_p, top_k, repetition_penalty, seed), logit_bias, logprobs
    jobs = [((10, 0.9, 0.95, 0, 1.0, 1), None, None), ((12, 0.9, 0.95, 0, 1.0, 2), None, None),
            ((9, 1.2, 1.0, 20, 1.0, 3), None, None), ((11, 0.8, 1.0, 0, 1.3, 4), None, None),
            ((10, 1.0, 1.0, 0, 1.0, 5), {11: 4.0}, None), ((8, 0.7, 0.9, 0, 1.0, 6), None, 2),
            ((10, 0.0, 1.0, 0, 1.0, None), None, None)]
    cfgs = [request_config(*args, logit_bias=bias) for args, bias, _ in jobs]
    want = [gen.generate([prompts[i % 3]], config=cfg).sequences[0] for i, cfg in enumerate(cfgs)]
    engine = Engine(gen, max_batch=len(jobs))
    assert type(engine.batch).__name__ == {"onnx": "BatchDecoder", "paddle": "SlotDecoder"}[backend]
    tokens, ends = run_engine(engine, [(prompts[i % 3], cfg, {"logprobs": jobs[i][2]}) for i, cfg in enumerate(cfgs)])
    assert all(isinstance(e, Finished) for e in ends), ends
    assert tokens == want


def test_a_request_whose_sampling_fails_fails_alone_and_the_others_draw_as_alone(onnx_gen):
    """A request whose tokens cannot be chosen (a logit_bias id outside the vocabulary, set past
    the server's check) beside seeded sampled requests of other settings: choosing them together
    raises after the others have drawn their numbers; the engine draws them again one by one, so
    the failing request fails alone (500) and each other gets the tokens it gets alone."""
    import dataclasses

    from gpt_compress.serve.engine import Engine
    from gpt_compress.serve.request import Failed, Finished, request_config

    gen = onnx_gen
    prompts = [gen.tokenizer.encode(p) for p in PROMPTS]
    cfgs = [request_config(10, 0.9, 1.0, 0, 1.0, 11), request_config(10, 1.1, 0.95, 0, 1.0, 12)]
    want = [gen.generate([prompts[i]], config=cfg).sequences[0] for i, cfg in enumerate(cfgs)]
    bad = dataclasses.replace(request_config(10, 0.7, 1.0, 0, 1.0, 13), logit_bias={gen.vocab_size + 5: 1.0})
    # the bad request last: its setting's group is warped after the others have drawn
    tokens, ends = run_engine(Engine(gen, max_batch=3), [(prompts[i], cfg, {}) for i, cfg in enumerate(cfgs + [bad])])
    assert isinstance(ends[2], Failed) and ends[2].status == 500
    assert isinstance(ends[0], Finished) and isinstance(ends[1], Finished)
    assert tokens[:2] == want


def test_min_tokens_over_max_tokens_is_a_400_naming_both(onnx_gen):
    with ready(onnx_gen) as (client, state):
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "min_tokens": 5})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "min_tokens" and "min_tokens=5" in err["message"] and "max_tokens=3" in err["message"]
        # Equal is allowed: exactly that many tokens.
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "min_tokens": 3})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3


def test_model_without_tokenizer_takes_token_ids_and_refuses_text(export_dir, onnx_gen):
    from gpt_compress.inference.runner import Generator

    bare = Generator(onnx_gen.backend, vocab_size=onnx_gen.vocab_size, max_positions=onnx_gen.max_positions,
                     eos_token_id=onnx_gen.eos_token_id, pad_token_id=onnx_gen.pad_token_id, tokenizer=None)
    with ready(bare) as (client, state):
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        ids = onnx_gen.encode("ROMEO:")[0]
        r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "min_tokens": 5, "logprobs": 1,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == greedy_alone(onnx_gen, "ROMEO:", 5) and choice["text"] == ""
        assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]


def test_error_in_the_middle_of_a_stream_ends_it_with_an_error_event(onnx_gen):
    with ready(onnx_gen, max_batch=2) as (client, state):
        real_step, calls = state.engine.batch.step, []

        def failing_step(tokens):
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("injected decode failure")
            return real_step(tokens)

        state.engine.batch.step = failing_step
        with client.stream("POST", "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 20, "min_tokens": 20,
                                                            "stream": True, "temperature": 0}) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        tokens = [c for c in chunks if "choices" in c]
        # The prefill's token and those of the three good decode steps arrive (in one chunk or
        # several: tokens already waiting share one), then the error.
        assert all(c["choices"][0]["finish_reason"] is None for c in tokens)
        assert [t for c in tokens for t in c["choices"][0]["token_ids"]] == greedy_alone(onnx_gen, "ROMEO:", 4)
        err = chunks[-1]["error"]
        assert err["code"] == "500" and "injected decode failure" in err["message"]
        assert events[-1] == "[DONE]"
        # The server goes on: the next request completes.
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "min_tokens": 4,
                                                 "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy_alone(onnx_gen, "ROMEO:", 4)
        assert metric(client, "gptc_engine_requests_total", '{status="error_500"}') == 1


def _post_in_thread(client, body, out: list):
    t = threading.Thread(target=lambda: out.append(client.post("/v1/completions", json=body)))
    t.start()
    return t


def _wait_metric(client, name, value, timeout=60.0):
    end = time.monotonic() + timeout
    while metric(client, name) != value:
        assert time.monotonic() < end, f"{name} never reached {value}"
        time.sleep(0.02)


def test_timeout_while_queued_is_a_504_saying_so(onnx_gen):
    # One slot and 3 s steps: the first request is admitted (its prompt counted) and sleeps out its
    # first step; the second, sent then, waits in the queue. At the next iteration (>= 3 s on)
    # both are past the 1 s timeout: the first fails as running, the second as queued.
    with ready(onnx_gen, max_batch=1, step_delay=3.0, request_timeout=1.0) as (client, state):
        first: list = []
        t = _post_in_thread(client, {"prompt": "ROMEO:", "max_tokens": 60, "min_tokens": 60}, first)
        _wait_metric(client, "gptc_prompt_tokens_total", len(onnx_gen.encode("ROMEO:")[0]))
        r = client.post("/v1/completions", json={"prompt": "JULIET:", "max_tokens": 2})
        t.join(60)
        assert r.status_code == 504 and "while queued" in r.json()["error"]["message"], r.text
        assert first[0].status_code == 504 and "while queued" not in first[0].json()["error"]["message"]
        assert metric(client, "gptc_engine_requests_total", '{status="error_504"}') == 2


def test_shutdown_fails_in_flight_and_refuses_new_requests_with_503(onnx_gen):
    with ready(onnx_gen, max_batch=1, step_delay=0.05) as (client, state):
        first: list = []
        t = _post_in_thread(client, {"prompt": "ROMEO:", "max_tokens": 100, "min_tokens": 100}, first)
        _wait_metric(client, "gptc_running_batch_size", 1)
        state.engine.stop()  # what the lifespan does when uvicorn shuts down
        t.join(60)
        assert first[0].status_code == 503 and "shut down" in first[0].json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_client_leaving_a_non_streaming_request_gets_499_and_frees_the_slot(onnx_gen):
    """An ASGI call whose client disconnects right after sending the body (as uvicorn reports it:
    the disconnect is there at once): the endpoint notices within DISCONNECT_POLL, answers 499
    and cancels the request, which leaves the batch long before its 60 tokens."""
    with ready(onnx_gen, max_batch=1, step_delay=0.05) as (client, state):
        body = json.dumps({"prompt": "ROMEO:", "max_tokens": 60, "min_tokens": 60}).encode()
        sent: list[dict] = []

        async def call():
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return messages.pop() if messages else {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
            await client.app(scope, receive, send)

        asyncio.run(call())
        _wait_metric(client, "gptc_running_batch_size", 0)
        assert metric(client, "gptc_engine_requests_total", '{status="cancelled"}') == 1
        assert metric(client, "gptc_generation_tokens_total") < 60
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
        # The freed slot serves the next request.
        assert client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------ the command's flags
def _start(export_dir, log, *args):
    proc = subprocess.Popen([sys.executable, "-m", "gpt_compress", "serve", "--model-dir", export_dir, "--port", "0",
                             *args], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    info = json.loads(proc.stdout.readline())
    return proc, info


def _ready(proc, url, timeout=300.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            r = httpx.get(url + "/health")
            if r.status_code == 200 or r.json().get("status") == "error":
                return r
        time.sleep(0.2)
    return None


def test_cli_flags_api_key_model_name_threads_no_verify_grace_period(export_dir, onnx_gen, tmp_path):
    """A copy of the export with a changed manifest file: without --no-verify the server reports
    the checksum and exits 1; with it (and --api-key, --model-name, --threads 1) it serves under
    that name and key; --grace-period 1 ends a long in-flight request at SIGTERM instead of
    waiting for its 200 tokens."""
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    with open(copy / "manifest.json", "a", encoding="utf-8") as f:
        f.write("\n")  # the same JSON, another sha256 (the manifest is verified whatever the backend)

    with open(tmp_path / "bad.log", "w") as log:
        proc, info = _start(str(copy), log, "--backend", "onnx")
        r = _ready(proc, info["url"])
        assert proc.wait(60) == 1
    assert "sha256" in (tmp_path / "bad.log").read_text() or (r is not None and "sha256" in r.text)

    with open(tmp_path / "good.log", "w") as log:
        proc, info = _start(str(copy), log, "--backend", "onnx", "--no-verify", "--api-key", "k-1",
                            "--model-name", "bard", "--threads", "1", "--grace-period", "1", "--step-delay", "0.1")
        try:
            url = info["url"]
            assert info["model"] == "bard" and info["api_key"] is True
            assert _ready(proc, url).status_code == 200
            auth = {"Authorization": "Bearer k-1"}
            assert httpx.get(url + "/v1/models").status_code == 401
            assert [m["id"] for m in httpx.get(url + "/v1/models", headers=auth).json()["data"]] == ["bard"]
            r = httpx.post(url + "/v1/completions", headers=auth, timeout=120,
                           json={"model": "bard", "prompt": "ROMEO:", "max_tokens": 6, "min_tokens": 6,
                                 "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy_alone(onnx_gen, "ROMEO:", 6)
            got: list = []

            def long_request():
                try:
                    got.append(httpx.post(url + "/v1/completions", headers=auth, timeout=120,
                                          json={"prompt": "ROMEO:", "max_tokens": 120, "min_tokens": 120}))
                except httpx.HTTPError as e:  # the connection closed under it
                    got.append(e)

            t = threading.Thread(target=long_request)
            t.start()
            end = time.monotonic() + 60
            while "gptc_running_batch_size 1.0" not in httpx.get(url + "/metrics", headers=auth).text:
                assert time.monotonic() < end
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            t.join(60)
            # 120 steps of >= 0.1 s cannot finish within the 1 s grace period: the request is cut.
            assert got and not (isinstance(got[0], httpx.Response) and got[0].status_code == 200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


def test_generated_text_decodes_only_past_its_head_and_equals_a_full_decode(gpt2_tokenizer, shared_data):
    """``serve/text.py``: token by token over real English and Chinese text (multi-byte
    characters split across tokens), the text is the full decode at every length, the decoded
    head moves on, and ``upto`` (the text without a final EOS) works; a tokenizer that does not
    concatenate decodes every list whole."""
    import dataclasses

    from gpt_compress.serve import text as text_mod
    from gpt_compress.serve.text import GeneratedText

    en = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:1500]
    zh = json.loads((shared_data / "chinese" / "tang300.jsonl").read_text(encoding="utf-8").splitlines()[0])
    zh = "".join(str(v) for v in zh.values())[:300]
    assert gpt2_tokenizer.concatenates
    for sample in (en, zh + en[:200] + "naïve café — ¿qué? 🙂"):
        ids = gpt2_tokenizer.encode(sample)
        buf, heads = GeneratedText(gpt2_tokenizer), set()
        for n in range(1, len(ids) + 1):
            assert buf.text(ids[:n]) == gpt2_tokenizer.decode(ids[:n]), n
            heads.add(buf.anchor)
        assert len(heads) > 3 and max(heads) >= len(ids) - 3 * text_mod.ANCHOR_TOKENS  # it moved along
        assert buf.text(ids, len(ids) - 1) == gpt2_tokenizer.decode(ids[:-1])
        with pytest.raises(ValueError, match="before the decoded head"):
            buf.text(ids, buf.anchor - 1)

    @dataclasses.dataclass
    class Whole:  # a decoder whose text is not the concatenation (WordPiece-like: spaces between)
        concatenates: bool = False
        calls: list = dataclasses.field(default_factory=list)

        def decode(self, ids):
            self.calls.append(len(ids))
            return " ".join(map(str, ids))

    tok = Whole()
    buf = GeneratedText(tok)
    for n in range(1, 40):
        assert buf.text(list(range(n))) == " ".join(map(str, range(n)))
    assert tok.calls == list(range(1, 40)) and buf.anchor == 0
    assert GeneratedText(None).text([1, 2, 3]) == ""
