"""The performance tables of README.md and docs/performance.md, regenerated from the newest
results under ``bench/results/<host>/<date>_<bench>.json``.

    python bench/tables.py            # rewrite the generated blocks (only where they changed)
    python bench/tables.py --check    # exit 1 if a generated block is out of date

Each table is built from one results file, named under it with its host, date and command.
Only the text between a ``<!-- BEGIN GENERATED: NAME -->`` and its ``<!-- END GENERATED: NAME -->``
marker is replaced; nothing else in the page is touched and no file is ever deleted, so running
this twice changes nothing the second time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("bench", "results")
# <date>, <date>T<HHMM> for a second run that day, <date>T<HHMM>-<n> for one within the same minute.
NAME_RE = re.compile(r"^(\d{4}-\d{2}-\d{2}(?:T\d{4}(?:-\d+)?)?)_([A-Za-z0-9_.-]+)\.json$")
# README/docs page -> the generated blocks it holds.
PAGES = {"README.md": ("headline", "decode-summary"), os.path.join("docs", "performance.md"): ("performance", "result-files")}
# Decode rows: the bench's contender name -> the name a reader knows.
DECODE_ROWS = {
    "paddle": "fused Paddle float32", "paddle_unfused": "unfused Paddle float32", "onnx": "onnxruntime float32",
    "paddle_int8": "**fused Paddle int8**", "paddle_int8_kvbf16": "fused Paddle int8, bfloat16 KV cache",
    "onnx_int8": "onnxruntime int8", "paddle_int4": "fused Paddle int4",
    "onnx_int4": "onnxruntime int4", "dygraph": "Paddle dygraph float32",
    "ct2_int8": "CTranslate2 int8 (peer)", "ct2_float32": "CTranslate2 float32 (peer)",
    "hf_peer": "transformers float32 (peer)",
    "llamacpp_q8_0": "llama.cpp q8_0 (peer)", "llamacpp_q4_0": "llama.cpp q4_0 (peer)",
    "llamacpp_f32": "llama.cpp f32 (peer)",
}


@dataclass
class Result:
    """One results file: where it is and what it holds."""

    path: str  # relative to the repository root
    host: str
    date: str
    bench: str
    data: dict

    @property
    def run(self) -> dict:
        return self.data.get("run", {})


def load_results(root: str = ROOT) -> list[Result]:
    """Every ``bench/results/<host>/<date>_<bench>.json``, oldest first."""
    out = []
    base = os.path.join(root, RESULTS)
    for host in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if not os.path.isdir(os.path.join(base, host)):
            continue
        for name in sorted(os.listdir(os.path.join(base, host))):
            m = NAME_RE.match(name)
            if not m:
                continue
            rel = os.path.join(RESULTS, host, name)
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                out.append(Result(rel.replace(os.sep, "/"), host, m.group(1), m.group(2), json.load(f)))
    return sorted(out, key=lambda r: (run_order(r.date), r.host, r.bench))


def run_order(date: str) -> tuple:
    """Sort key of a file name's date part: the day, then the time of a later run that day, then
    its number within the minute (``2026-11-24`` < ``2026-11-24T0930`` < ``...T0930-2`` < ``...T0930-10``)."""
    day, _, rest = date.partition("T")
    hhmm, _, n = rest.partition("-")
    return day, hhmm, int(n or 1)


def newest(results: list[Result], bench: str) -> Result | None:
    """The newest result of ``bench`` (by date, then host name)."""
    found = [r for r in results if r.bench == bench]
    return found[-1] if found else None


def _f(v, spec: str = "{:.1f}") -> str:
    return "" if v is None else spec.format(v) if isinstance(v, (int, float)) else str(v)


def busy(start: list[float], end: list[float], cores: int, threads: int) -> bool:
    """Whether other work shared the host: a 1-minute load above half the cores when the run
    starts, or at its end a 1- or 5-minute load above the run's own threads plus half the cores
    (the end counts the run itself). The 15-minute averages reach back before a run of a few
    minutes: work that ended before it started shows there, so they do not count."""
    return start[0] > 0.5 * cores or max(end[:2]) > threads + 0.5 * cores


def load_note(r: Result) -> str:
    """The run's load, as the reader of its figures needs it ("" where the file has none)."""
    start, end, cores = r.run.get("load_avg_start"), r.run.get("load_avg_end"), r.run.get("cores")
    if not start or not end or not cores:
        return ""
    note = (f"load average (1, 5, 15 minutes) {'/'.join(map(str, start))} at the start and "
            f"{'/'.join(map(str, end))} at the end, on {cores} cores")
    if busy(start, end, cores, r.run.get("threads") or cores):
        note += (": other work shared the host, so every figure is low and the contenders are slowed "
                 "unequally; a run on idle cores gives the figures to rely on")
    return note


def _source(r: Result) -> list[str]:
    run = r.run
    load = f"; {load_note(r)}" if load_note(r) else ""
    return [f"Host `{r.host}` ({run.get('cpu', 'CPU not recorded')}), {r.date}{load}; results file "
            f"[`{r.path}`](../{r.path}); command:", "", "```bash", run.get("command", "(not recorded)"), "```", ""]


def decode_table(r: Result) -> list[str]:
    """Batch-1 and batch-B decode, prefill, long-context steps and memory, one row a backend."""
    d = r.data
    b = d.get("batch", 8)
    rows = [(label, d.get("results", {}).get(name)) for name, label in DECODE_ROWS.items()]
    rows = [(label, x) for label, x in rows if x]
    cols = [("batch 1 tok/s", lambda x: _f(x.get("decode_tokens_per_s")))]
    if b > 1:
        cols.append((f"batch {b} tok/s", lambda x: _f(x.get(f"batch{b}_decode_tokens_per_s"), "{:.0f}")))
    cols.append(("prefill ms", lambda x: _f(x.get("prefill_ms")) if x.get("prefill_ms") is not None else (
        f"{_f(x.get('first_token_ms'))} (first token)" if x.get("first_token_ms") is not None else "")))
    if any(x.get("step_ms_at_100") is not None for _, x in rows):
        cols.append(("step ms at 100 / 900 cached", lambda x: (
            f"{_f(x.get('step_ms_at_100'), '{:.2f}')} / {_f(x.get('step_ms_at_900'), '{:.2f}')}"
            if x.get("step_ms_at_100") is not None else "")))
    if any(x.get(f"batch{b}_step_ms_at_100") is not None for _, x in rows):
        cols.append((f"batch-{b} step ms at 100 / 900", lambda x: (
            f"{_f(x.get(f'batch{b}_step_ms_at_100'), '{:.2f}')} / {_f(x.get(f'batch{b}_step_ms_at_900'), '{:.2f}')}"
            if x.get(f"batch{b}_step_ms_at_100") is not None else "")))
    cols.append(("peak RSS MB (weights MB)", lambda x: (
        f"{_f(x.get('peak_rss_mb'), '{:.0f}')} ({_f(x.get('weights_mb'), '{:.0f}')})"
        if x.get("peak_rss_mb") is not None else "")))
    out = [f"| {d.get('preset', 'gpt-bench')}, {d.get('threads', '?')} threads | "
           + " | ".join(c for c, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    for label, x in rows:
        out.append(f"| {label} | " + " | ".join(fn(x) for _, fn in cols) + " |")
    return out


def _label(name: str) -> str:
    return DECODE_ROWS.get(name, name).replace("*", "").replace(" (peer)", "")


def decode_ratios(r: Result) -> list[str]:
    d = r.data
    lines = []
    if d.get("bandwidth_limit_tokens_per_s"):
        lines.append(f"Batch-1 limit: {d['weight_bytes_per_token'] / 1e6:.0f} MB of float32 weights a token at "
                     f"{d['copy_bandwidth_gbps']} GB/s measured copy bandwidth = {d['bandwidth_limit_tokens_per_s']} "
                     "tokens/s.")
    parts = []
    for key, v in d.get("ratios", {}).items():
        pair, _, measure = key.partition(" ")
        if "/" not in pair or "prefill" in measure:
            continue
        a, b = pair.split("/", 1)
        where = " at batch 8" if measure.startswith("batch8") else ""
        parts.append(f"{_label(a)} / {_label(b)}{where} {v:.2f}x")
    if parts:
        lines.append("Decode speed ratios within this run: " + "; ".join(parts) + ".")
    return lines


def serve_table(r: Result) -> list[str]:
    rows = ["| clients | tokens/s batched | tokens/s `--max-batch 1` | ratio | TTFT p50 / p99 ms | ITL p50 / p99 ms "
            "| errors | unserved |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in r.data.get("levels", []):
        bt, one = lv.get("batched", {}), lv.get("max_batch_1", {})
        rows.append(f"| {lv.get('clients')} | {_f(bt.get('output_tokens_per_s'))} | {_f(one.get('output_tokens_per_s'))} | "
                    f"{_f(lv.get('throughput_ratio'), '{:.2f}x')} | {_f(bt.get('ttft_p50_ms'))} / {_f(bt.get('ttft_p99_ms'))} | "
                    f"{_f(bt.get('itl_p50_ms'))} / {_f(bt.get('itl_p99_ms'))} | {bt.get('errors', '')} | {bt.get('unserved', '')} |")
    gen = r.data.get("generator", {}).get("output_tokens_per_s")
    if gen:
        turns = r.data["generator"].get("rounds")
        when = f", in {turns} turns alternating with the 1-client level" if turns else ""
        rows += ["", f"The in-process `Generator` on the same mix, one request after another{when}: {_f(gen)} tokens/s "
                     f"(one client of the server: {_f(r.data.get('server_1_client_over_generator'), '{:.2f}x')} of it)."]
    return rows


def train_table(r: Result) -> list[str]:
    d = r.data
    rows = ["| | tokens/s | GFLOP/s | of GEMM ceiling |", "|---|---:|---:|---:|"]
    for k, v in d.get("ours", {}).items():
        rows.append(f"| gpt-compress {k} | {_f(v.get('tokens_per_s'))} | {_f(v.get('gflops'))} | "
                    f"{_f(v.get('fraction_of_ceiling'), '{:.2f}')} |")
    peer = d.get("peer", {}).get("fwd_bwd", {}).get("train_tokens_per_s")
    rows.append(f"| transformers GPT-2, torch CPU (peer) | {_f(peer)} | | |")
    ceiling = d.get("flops", {}).get("matmul_ceiling_gflops")
    return rows + ["", f"GEMM ceiling measured in the same process: {_f(ceiling)} GFLOP/s."]


# What gpt-compress is compared with: (measure, ours, theirs, larger is better).
HEADLINE = (
    ("batch-1 decode, int8 weights (tok/s)", "paddle_int8", "onnx_int8", "decode_tokens_per_s", True),
    ("batch-1 decode, int8 weights (tok/s)", "paddle_int8", "ct2_int8", "decode_tokens_per_s", True),
    ("batch-1 decode, int8 weights (tok/s)", "paddle_int8", "llamacpp_q8_0", "decode_tokens_per_s", True),
    ("batch-1 decode, int4 weights (tok/s)", "paddle_int4", "llamacpp_q4_0", "decode_tokens_per_s", True),
    ("batch-1 decode, float32 (tok/s)", "paddle", "onnx", "decode_tokens_per_s", True),
    ("batch-1 decode, float32 (tok/s)", "paddle", "hf_peer", "decode_tokens_per_s", True),
    ("batch-8 decode, int8 weights (tok/s)", "paddle_int8", "onnx_int8", "batch8_decode_tokens_per_s", True),
    ("64-token prefill, int8 weights (ms)", "paddle_int8", "onnx_int8", "prefill_ms", False),
    ("64-token prefill, float32 (ms)", "paddle", "onnx", "prefill_ms", False),
    ("peak memory, float32 runner (MB)", "paddle", "onnx", "peak_rss_mb", False),
)


def block_headline(results: list[Result]) -> list[str]:
    r = newest(results, "decode")
    if r is None:
        return ["No decode results yet: run `make bench`."]
    res = r.data.get("results", {})
    rows = [f"| measure ({r.data.get('preset', 'gpt-bench')}, {r.data.get('threads', '?')} threads) | gpt-compress "
            "| alternative | advantage |", "|---|---:|---|---:|"]
    for label, ours, theirs, key, higher in HEADLINE:
        a, b = res.get(ours, {}).get(key), res.get(theirs, {}).get(key)
        if a is None or b is None:
            continue
        name = DECODE_ROWS[theirs].replace(" (peer)", "").replace("*", "")
        rows.append(f"| {label} | {_f(a)} | {name}: {_f(b)} | **{(a / b if higher else b / a):.2f}x** |")
    cpu, load = r.run.get("cpu"), load_note(r)
    return rows + ["", f"From one run: [`{r.path}`]({r.path}) (host `{r.host}`{', ' + cpu if cpu else ''}, {r.date}"
                       f"{'; ' + load if load else ''}); the full table and its command are under "
                       "[Performance](#performance)."]


def block_decode_summary(results: list[Result]) -> list[str]:
    r = newest(results, "decode")
    if r is None:
        return ["No decode results yet: run `make bench`."]
    src = _source(r)
    src[0] = src[0].replace("](../", "](")  # README.md sits at the root
    return decode_table(r) + [""] + src[:-1]


def block_performance(results: list[Result]) -> list[str]:
    out: list[str] = []
    for bench, title, table in (("decode", "Decode, gpt-bench", decode_table),
                                ("decode_345M", "Decode, gpt-345M", decode_table),
                                ("decode_345M_512", "Decode, gpt-345M, 512-token prompt", decode_table),
                                ("serve", "Serving (`gptc serve`, continuous batching)", serve_table),
                                ("serve_int8", "Serving the int8 fused program", serve_table),
                                ("serve_int8_kvbf16", "Serving the int8 fused program, bfloat16 KV cache",
                                 serve_table),
                                ("serve_int8_sampled", "Serving the int8 fused program, sampled requests "
                                 "(temperature 1)", serve_table),
                                ("train", "Training (gpt-bench, batch 8 x 256, float32 AdamW step)", train_table)):
        r = newest(results, bench)
        if r is None:
            continue
        out += [f"### {title}", ""] + _source(r) + table(r) + [""]
        if table is decode_table:
            out += decode_ratios(r) + [""]
    return out[:-1] if out else ["No results yet: run `make bench`."]


def block_result_files(results: list[Result]) -> list[str]:
    rows = ["| host | date | bench | file | command |", "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.host, r.date, r.bench)):
        rows.append(f"| {r.host} | {r.date} | {r.bench} | [`{os.path.basename(r.path)}`](../{r.path}) | "
                    f"`{r.run.get('command', '')}` |")
    return rows


BLOCKS = {"headline": block_headline, "decode-summary": block_decode_summary, "performance": block_performance,
          "result-files": block_result_files}


def render(text: str, results: list[Result]) -> str:
    """``text`` with every generated block rebuilt; an unknown block name is an error."""
    def repl(m: re.Match) -> str:
        name = m.group(1)
        if name not in BLOCKS:
            raise SystemExit(f"bench/tables.py: unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
        body = "\n".join(BLOCKS[name](results))
        return f"<!-- BEGIN GENERATED: {name} -->\n{body}\n<!-- END GENERATED: {name} -->"

    return re.sub(r"<!-- BEGIN GENERATED: ([\w-]+) -->.*?<!-- END GENERATED: \1 -->", repl, text, flags=re.S)


def regenerate(root: str = ROOT, check: bool = False) -> list[str]:
    """Rewrite the pages whose generated blocks changed (or, with ``check``, only list them)."""
    results = load_results(root)
    stale = []
    for page in PAGES:
        path = os.path.join(root, page)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = render(text, results)
        if new != text:
            stale.append(page)
            if not check:
                tmp = f"{path}.tmp-{os.getpid()}"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(new)
                os.replace(tmp, path)
    return stale


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report out-of-date pages (exit 1 if any)")
    p.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    stale = regenerate(a.root, check=a.check)
    for page in stale:
        print(f"{page}: {'out of date' if a.check else 'regenerated'}", file=sys.stderr)
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
