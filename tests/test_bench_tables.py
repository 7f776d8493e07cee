"""bench/tables.py: the performance tables come from the newest results file, regenerating
deletes nothing and is idempotent, and the committed README/docs tables are current."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "bench" / "tables.py")
tables = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = tables  # dataclasses look their module up while the class is made
spec.loader.exec_module(tables)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "bench" / "results")
    (tmp_path / "docs").mkdir()
    for page in tables.PAGES:
        shutil.copy(ROOT / page, tmp_path / page)
    return tmp_path


def test_committed_tables_are_current():
    assert tables.regenerate(str(ROOT), check=True) == [], "run `python bench/tables.py`"


def test_regenerating_twice_deletes_nothing_and_is_idempotent(tmp_path):
    root = _copy(tmp_path)
    before = _tree(root)
    tables.regenerate(str(root))
    once = _tree(root)
    assert once.keys() == before.keys()
    assert tables.regenerate(str(root)) == []
    assert _tree(root) == once


def test_newest_result_drives_the_tables(tmp_path):
    root = _copy(tmp_path)
    src = json.loads((ROOT / "bench/results/zen1/2026-11-24_decode.json").read_text())
    src["run"] = {**src["run"], "host": "zen9", "date": "2099-01-01", "command": "python bench/decode.py --planted"}
    src["results"]["paddle_int8"]["decode_tokens_per_s"] = 12345.6
    (root / "bench/results/zen9").mkdir()
    (root / "bench/results/zen9/2099-01-01_decode.json").write_text(json.dumps(src))
    before = set(_tree(root))
    assert set(tables.regenerate(str(root))) == set(tables.PAGES)
    assert set(_tree(root)) == before  # nothing deleted, nothing but the pages rewritten
    for page in tables.PAGES:
        text = (root / page).read_text()
        assert "12345.6" in text and "bench/results/zen9/2099-01-01_decode.json" in text
        assert "--planted" in text
    # Every results file keeps its row in the list of result files.
    perf = (root / "docs/performance.md").read_text()
    for p in (root / "bench/results").rglob("*.json"):
        assert p.name in perf
