"""Results report: a Markdown table across models and backends, and PNG plots (matplotlib).

Inputs are the JSON files ``gptc eval --output`` writes (one per model x backend x task) and,
optionally, speed figures (``gptc infer``/``bench/decode.py`` style: ``decode_tokens_per_s``,
``prefill_ms``) and training logs (``train_log.jsonl`` from the trainer). Rows are keyed by
(model directory, backend), so the WikiText and LAMBADA results of one artifact land in one row.

Plots: training/validation loss against step for every log given, and, when two or more
artifacts carry the figures, quality (WikiText PPL) against weight size and against decode speed.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Optional, Sequence

from ..errors import DataError
from ..fileio import atomic_file, write_text_atomic

# Weight files of each backend, by suffix: what a deployment has to ship and read.
WEIGHT_SUFFIXES = {"dygraph": (".safetensors",), "paddle": (".pdiparams",), "onnx": (".onnx", ".onnx.data")}
# Not counted: a training checkpoint's optimizer state (not loaded to run), and the fused CPU
# program's copy of the weights (a Paddle backend loads either it or model.pdiparams, never both).
NOT_WEIGHTS = ("optimizer.safetensors", "fused.pdiparams")


@dataclass
class ReportRow:
    """One artifact on one backend. ``None`` means not measured (shown as a dash)."""

    name: str
    backend: str
    model: str = ""
    size_mb: Optional[float] = None
    wikitext_ppl: Optional[float] = None
    wikitext_adjusted_ppl: Optional[float] = None
    lambada_acc: Optional[float] = None
    lambada_acc_harness: Optional[float] = None
    decode_tokens_per_s: Optional[float] = None
    prefill_ms: Optional[float] = None


# column -> (header, format); the order is the table's.
COLUMNS: dict[str, tuple[str, str]] = {
    "name": ("model", "{}"),
    "backend": ("backend", "{}"),
    "size_mb": ("weights (MB)", "{:.2f}"),
    "wikitext_ppl": ("PPL", "{:.3f}"),  # WikiText protocol on the evaluated text (WikiText-2 or held-out)
    "wikitext_adjusted_ppl": ("word-level PPL", "{:.3f}"),
    "lambada_acc": ("LAMBADA acc", "{:.2%}"),
    "lambada_acc_harness": ("LAMBADA acc (harness)", "{:.2%}"),
    "decode_tokens_per_s": ("decode tok/s", "{:.1f}"),
    "prefill_ms": ("prefill ms", "{:.1f}"),
}


def weight_size_mb(model_dir: str, backend: str) -> Optional[float]:
    """MB of the weight files ``backend`` loads from ``model_dir`` (None if there are none)."""
    suffixes = WEIGHT_SUFFIXES.get(backend, ())
    if not os.path.isdir(model_dir):
        return None
    total = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                if f.endswith(suffixes) and f not in NOT_WEIGHTS and os.path.isfile(os.path.join(model_dir, f)))
    return round(total / 2**20, 3) if total else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable result JSON ({e})") from None


def rows_from_results(results: Iterable[Mapping], names: Optional[Mapping[str, str]] = None) -> list[ReportRow]:
    """Merge eval/speed result dicts into one row per (model, backend), in first-seen order.

    Each dict needs ``model`` and ``backend`` (as ``gptc eval`` writes them); eval results also
    carry ``task``. ``names`` maps a model path to a display name (default: its basename)."""
    rows: dict[tuple[str, str], ReportRow] = {}
    for r in results:
        if "model" not in r or "backend" not in r:
            raise DataError(f"result without 'model'/'backend': {sorted(r)[:8]}")
        model = os.path.abspath(r["model"])
        key = (model, r["backend"])
        if key not in rows:
            name = (names or {}).get(r["model"]) or (names or {}).get(model) or os.path.basename(model.rstrip("/"))
            rows[key] = ReportRow(name=name, backend=r["backend"], model=model,
                                  size_mb=weight_size_mb(model, r["backend"]))
        row = rows[key]
        task = r.get("task")
        if task == "wikitext":
            row.wikitext_ppl, row.wikitext_adjusted_ppl = r["ppl"], r.get("adjusted_ppl")
        elif task == "lambada":
            row.lambada_acc, row.lambada_acc_harness = r["accuracy"], r.get("accuracy_harness")
        for k in ("decode_tokens_per_s", "prefill_ms", "size_mb"):
            if r.get(k) is not None:
                setattr(row, k, r[k])
    return list(rows.values())


def markdown_table(rows: Sequence[ReportRow], columns: Optional[Sequence[str]] = None) -> str:
    """A GitHub Markdown table; columns default to those that have a value in some row."""
    if columns is None:
        columns = [c for c in COLUMNS if c in ("name", "backend") or any(getattr(r, c) is not None for r in rows)]
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise DataError(f"unknown report column(s) {unknown}; known: {', '.join(COLUMNS)}")

    def cell(row, c):
        v = getattr(row, c)
        return "-" if v is None else COLUMNS[c][1].format(v)

    head = "| " + " | ".join(COLUMNS[c][0] for c in columns) + " |"
    rule = "|" + "|".join("---" if c in ("name", "backend") else "---:" for c in columns) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows])


def read_train_log(path: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train (step, loss) points, validation (step, eval_loss) points) of a ``train_log.jsonl``.
    A malformed line is an error naming the file and line."""
    train, val = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: malformed JSON ({e.msg})") from None
            if rec.get("loss") is not None:
                train.append((rec["step"], rec["loss"]))
            if rec.get("eval_loss") is not None:
                val.append((rec["step"], rec["eval_loss"]))
    return train, val


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'gpt-compress[report]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    """Write ``fig`` atomically to ``path`` and release it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_file(path, "wb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
        return path
    finally:
        plt.close(fig)


def plot_loss_curves(logs: Mapping[str, str], path: str) -> str:
    """Training (thin) and validation (markers) loss per step, one colour per log."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (label, log) in enumerate(logs.items()):
        train, val = read_train_log(log)
        color = f"C{i}"
        if train:
            ax.plot(*zip(*train), color=color, lw=0.8, alpha=0.8, label=f"{label} train")
        if val:
            ax.plot(*zip(*val), color=color, marker="o", lw=1.6, label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# x-axis attribute of a quality trade-off plot -> (label, title, file name)
TRADEOFFS = {"size_mb": ("weights (MB)", "Quality vs size", "size_vs_quality.png"),
             "decode_tokens_per_s": ("batch-1 decode tokens/s (higher is faster)", "Quality vs speed",
                                     "speed_vs_quality.png")}


def plot_tradeoff(rows: Sequence[ReportRow], x: str, path: str) -> Optional[str]:
    """WikiText PPL against ``x`` (a ``TRADEOFFS`` key), one labelled point per artifact x
    backend; None (no file) unless at least two rows have both figures."""
    xlabel, title, _ = TRADEOFFS[x]
    pts = [r for r in rows if getattr(r, x) is not None and r.wikitext_ppl is not None]
    if len(pts) < 2:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    backends = sorted({r.backend for r in pts})
    for r in pts:
        ax.scatter(getattr(r, x), r.wikitext_ppl, color=f"C{backends.index(r.backend)}", s=36)
        ax.annotate(f"{r.name} ({r.backend})", (getattr(r, x), r.wikitext_ppl), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    for b in backends:
        ax.scatter([], [], color=f"C{backends.index(b)}", label=b)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("perplexity (lower is better)")
    if max(r.wikitext_ppl for r in pts) / min(r.wikitext_ppl for r in pts) > 20:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_report(out_dir: str, rows: Sequence[ReportRow], logs: Optional[Mapping[str, str]] = None,
                 title: str = "gpt-compress results", notes: str = "") -> dict[str, str]:
    """Write ``report.md``, ``results.json`` and the PNGs into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    files: dict[str, str] = {}
    parts = [f"# {title}", ""]
    if notes:
        parts += [notes.strip(), ""]
    parts += [markdown_table(rows), ""]
    if logs:
        files["loss_curves"] = plot_loss_curves(logs, os.path.join(out_dir, "loss_curves.png"))
        parts += ["## Loss curves", "", "![loss curves](loss_curves.png)", ""]
    for x, (_, heading, name) in TRADEOFFS.items():
        png = plot_tradeoff(rows, x, os.path.join(out_dir, name))
        if png:
            files[name[:-4]] = png
            parts += [f"## {heading}", "", f"![{heading.lower()}]({name})", ""]
    for name, text in (("results.json", json.dumps([asdict(r) for r in rows], indent=2)),
                       ("report.md", "\n".join(parts))):
        path = os.path.join(out_dir, name)
        write_text_atomic(path, text + "\n")
        files[name.split(".")[0]] = path
    return files


def load_rows(result_paths: Sequence[str], names: Optional[Mapping[str, str]] = None) -> list[ReportRow]:
    """Rows from result JSON files (each a dict or a list of dicts)."""
    results: list[dict] = []
    for p in result_paths:
        data = _read_json(p)
        items = data if isinstance(data, list) else [data]
        for d in items:
            if not isinstance(d, dict):
                raise DataError(f"{p}: expected a JSON object or a list of objects")
            results.append(d)
    return rows_from_results(results, names)

