"""Shared by the serving tests: a `gptc serve` subprocess on a free loopback port (test_serve.py,
test_tp_fused.py), and requests run to their end on an in-process engine (``run_engine``)."""
import json
import queue
import re
import signal
import subprocess
import sys
import time

import httpx

from _export_helpers import ENV, ROOT


class Server:
    """A `gptc serve` subprocess; ``url`` once it is listening, ``ready()`` waits for /health."""

    def __init__(self, model_dir: str, log_path, *args: str, env: dict = None):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "gpt_compress", "serve", "--model-dir", model_dir,
                                      "--port", "0", *args], env={**ENV, **(env or {})}, cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        assert line, f"server exited: {open(log_path).read()[-3000:]}"
        self.info = json.loads(line)
        self.url = self.info["url"]
        assert self.url.startswith("http://127.0.0.1:")  # loopback by default
        self.log_path = log_path

    def ready(self, timeout: float = 300.0) -> "Server":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, open(self.log_path).read()[-3000:]
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("server not ready")

    def metric(self, name: str, headers=None) -> float:
        """The sample ``name`` (``family_suffix{labels}``) of /metrics; 0.0 for a labelled series
        not yet observed (a counter's label set appears at its first increment). A name whose
        family /metrics does not declare fails: a renamed metric cannot read as 0."""
        text = httpx.get(self.url + "/metrics", headers=headers).text
        families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
        base = name.split("{")[0]
        assert any(base == f or base == f + suffix for f in families
                   for suffix in ("_total", "_count", "_sum", "_bucket", "_created")), (name, sorted(families))
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        assert m or "{" in name, (name, "declared but no sample")
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


def run_engine(engine, jobs: list, together: bool = True, timeout: float = 120.0) -> tuple[list, list]:
    """Start ``engine`` (serve/engine.py), submit a Request for each ``(prompt, cfg, extra Request
    fields)`` of ``jobs`` (in one ``submit_all`` when ``together``, else one by one) and wait until
    every one has ended, then stop it. Returns each job's token ids and its last event (Finished
    or Failed), in the order of ``jobs``."""
    from gpt_compress.serve.request import Failed, Finished, Request

    events = queue.Queue()
    reqs = [Request(prompt, cfg, emit=lambda evs, i=i: [events.put((i, ev)) for ev in evs], **extra)
            for i, (prompt, cfg, extra) in enumerate(jobs)]
    engine.start()
    try:
        if together:
            engine.submit_all(reqs)
        else:
            for req in reqs:
                engine.submit(req)
        tokens, ends = {i: [] for i in range(len(jobs))}, {}
        while len(ends) < len(jobs):
            i, ev = events.get(timeout=timeout)
            if isinstance(ev, (Failed, Finished)):
                ends[i] = ev
            else:
                tokens[i].append(ev.token_id)
    finally:
        engine.stop()
    return [tokens[i] for i in range(len(jobs))], [ends[i] for i in range(len(jobs))]
