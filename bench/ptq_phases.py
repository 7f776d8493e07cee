"""Where `gptc ptq` holds its memory: peak RSS per phase of one in-process run.

Runs ``gptc ptq ARGS...`` (the CLI, in this process) with a sampler thread reading ``VmRSS`` of
``/proc/self/status`` every few milliseconds, and phase markers around the command's stages
(loading, quantizing, the closing evaluations, the int8 export's fused program / Paddle deploy
model / ONNX float copy and conversion / validation, the evaluation of each exported backend).
Prints one JSON document: the baseline RSS after the libraries are imported, the weight bytes,
and per phase its peak RSS, as a multiple of the weights both in all and less the baseline.

    python bench/ptq_phases.py --weights-of CKPT -- ptq --model CKPT -o ... --no-validate

Phases nest (``export/int8.onnx``); a phase's peak is over its whole span, its children included.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss() -> int:
    """This process's resident bytes now (``memory.status_bytes``), 0 without /proc."""
    from gpt_compress.memory import status_bytes

    return status_bytes("VmRSS") or 0


class Timeline:
    """Peak RSS per phase (a stack of names) sampled by a background thread."""

    def __init__(self, interval: float = 0.005):
        self.stack: list[str] = []
        self.peaks: dict[str, int] = {}
        self.enter: dict[str, int] = {}  # RSS when a phase (first) started and last ended
        self.exit: dict[str, int] = {}
        self.order: list[str] = []
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _note(self, value: int) -> None:
        for i in range(len(self.stack)):
            key = "/".join(self.stack[: i + 1])
            if value > self.peaks.get(key, 0):
                self.peaks[key] = value

    def _run(self) -> None:
        while not self._stop.is_set():
            self._note(rss())
            time.sleep(self.interval)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.stack.append(name)
        key = "/".join(self.stack)
        if key not in self.order:
            self.order.append(key)
        now = rss()
        self.enter.setdefault(key, now)
        self._note(now)
        try:
            yield
        finally:
            now = rss()
            self._note(now)
            self.exit[key] = now
            self.stack.pop()

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapped(*a, **k):
            with self.phase(name):
                return fn(*a, **k)

        setattr(owner, attr, wrapped)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()


def instrument(tl: Timeline) -> None:
    """Phase markers around the stages of `gptc ptq` (patched where each is looked up)."""
    from gpt_compress import export as export_pkg
    from gpt_compress.commands import _quant, ptq
    from gpt_compress.export import api, int8
    from gpt_compress.qat import quantize

    tl.wrap(_quant, "prepare", "load")
    tl.wrap(quantize, "quantize_model", "quantize")
    tl.wrap(quantize, "save_quantized", "save_quantized")
    tl.wrap(_quant.Evaluator, "model", "evaluate_dygraph")
    tl.wrap(_quant.Evaluator, "exported", "evaluate_exported")
    tl.wrap(export_pkg, "export_model", "export")
    tl.wrap(api, "reference", "reference")
    tl.wrap(api, "try_save_fused", "fused")
    tl.wrap(api, "save_int8_programs", "int8_programs")
    tl.wrap(api, "validate_dir", "validate")
    tl.wrap(int8, "deploy_model", "paddle_deploy_model")
    tl.wrap(int8, "save_paddle_programs", "paddle_programs")
    tl.wrap(int8, "_onnx_programs", "onnx")
    tl.wrap(int8, "fake_quant_float_model", "onnx_float_model")
    tl.wrap(int8, "convert_programs", "onnx_convert")
    try:
        from gpt_compress.qat import ptq as qptq

        tl.wrap(qptq, "calibrate", "calibrate")
    except AttributeError:
        pass
    del ptq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights-of", required=True, help="checkpoint whose float32 weight bytes are the unit")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- ptq ARGS...")
    a = p.parse_args()
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    if ROOT not in sys.path:  # after PYTHONPATH: a tree given there is the one measured
        sys.path.append(ROOT)
    import onnx  # noqa: F401  the libraries every ptq run loads, in the baseline
    import onnxruntime  # noqa: F401
    import paddle
    import paddle.inference  # noqa: F401

    from gpt_compress import cli
    from gpt_compress.memory import model_config_of

    del paddle
    weights = 4 * model_config_of(a.weights_of).num_parameters()
    base = rss()
    tl = Timeline()
    instrument(tl)
    tl.start()
    code = 0
    t0 = time.perf_counter()
    try:
        with tl.phase("ptq"):
            cli.main(argv)
    except SystemExit as e:
        code = e.code or 0
    tl.stop()
    gib = 1 << 30
    out = {"argv": argv, "exit_code": code, "seconds": round(time.perf_counter() - t0, 1),
           "weight_bytes": weights, "baseline_rss_gib": round(base / gib, 3),
           "phases": {k: {"peak_rss_gib": round(tl.peaks[k] / gib, 3), "start_rss_gib": round(tl.enter[k] / gib, 3),
                          "end_rss_gib": round(tl.exit[k] / gib, 3), "x_weights": round(tl.peaks[k] / weights, 2),
                          "x_weights_above_baseline": round((tl.peaks[k] - base) / weights, 2)}
                      for k in tl.order if k in tl.peaks}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
