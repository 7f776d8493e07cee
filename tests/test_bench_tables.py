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


FAKE_DECODE = '''import json, pathlib, sys
here = pathlib.Path(__file__).parent
count = here / "fake_decode.count"
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
out = json.loads((here / "fake_decode.json").read_text())
out.pop("run", None)
out["results"]["paddle_int8"]["decode_tokens_per_s"] = 1000.0 + n  # run n shows 100n.0
print("progress on stderr", file=sys.stderr)
print(json.dumps(out, indent=1))
'''


def test_bench_twice_adds_a_file_each_deletes_nothing_and_tables_follow_the_newest(tmp_path, monkeypatch):
    """`make bench` twice in a row (bench/run_all.py's main, a fake decode bench): each run adds its
    results file, no file is deleted or rewritten but the generated pages, and the tables show the
    second run's figures and file."""
    import time

    root = _copy(tmp_path)
    (root / "bench" / "fake_decode.py").write_text(FAKE_DECODE)
    shutil.copy(ROOT / "bench/results/zen1/2026-11-24_decode.json", root / "bench" / "fake_decode.json")
    spec_ra = importlib.util.spec_from_file_location("bench_run_all", ROOT / "bench" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec_ra)
    spec_ra.loader.exec_module(run_all)
    monkeypatch.setattr(run_all, "ROOT", str(root))
    monkeypatch.setattr(run_all, "BENCHES", {"decode": ["bench/fake_decode.py"]})
    # Both runs within one minute of a day later than every committed result.
    monkeypatch.setattr(time, "gmtime", lambda *a: time.struct_time((2099, 1, 1, 12, 0, 0, 3, 1, 0)))

    before = _tree(root)
    added = []
    for n in (1, 2):
        previous = _tree(root)
        run_all.main(["--host", "zen9"])
        now = _tree(root)
        assert set(previous) <= set(now), f"run {n} deleted {set(previous) - set(now)}"
        new = sorted(set(now) - set(previous) - {"bench/fake_decode.count"})
        assert len(new) == 1 and new[0].startswith("bench/results/zen9/2099-01-01"), new
        added.append(new[0])
        changed = {p for p in previous if p in now and previous[p] != now[p]}
        assert changed <= {*tables.PAGES, "bench/fake_decode.count"}, changed
        record = json.loads(now[new[0]])
        assert record["run"]["host"] == "zen9" and record["run"]["load_avg_start"] is not None
        assert record["results"]["paddle_int8"]["decode_tokens_per_s"] == 1000.0 + n
    assert added == ["bench/results/zen9/2099-01-01_decode.json", "bench/results/zen9/2099-01-01T1200_decode.json"]
    for p in before:  # every results file there before is byte for byte the same
        if p.startswith("bench/results/"):
            assert _tree(root)[p] == before[p]
    for page in tables.PAGES:
        text = (root / page).read_text()
        assert "1002.0" in text and added[1] in text, page
        assert "1001.0" not in text, page
        assert "load average (1, 5, 15 minutes)" in text, page  # the run's load under its table
    assert tables.regenerate(str(root), check=True) == []


def test_file_names_of_runs_within_one_minute_sort_in_order():
    names = ["2026-11-24T0930-10", "2026-11-24", "2026-11-24T0930-2", "2026-11-24T0930", "2026-11-25"]
    assert sorted(names, key=tables.run_order) == ["2026-11-24", "2026-11-24T0930", "2026-11-24T0930-2",
                                                   "2026-11-24T0930-10", "2026-11-25"]
    assert tables.NAME_RE.match("2026-11-24T0930-2_decode.json").groups() == ("2026-11-24T0930-2", "decode")


def test_a_run_counts_as_busy_from_the_load_of_other_work():
    # 2 cores, a 2-thread run: idle before it, its own load at the end, is quiet.
    assert not tables.busy([0.1, 0.2, 0.3], [2.0, 1.2, 0.5], cores=2, threads=2)
    assert tables.busy([3.29, 1.82, 0.76], [2.0, 1.2, 0.5], cores=2, threads=2)  # busy before
    assert tables.busy([0.1, 0.2, 0.3], [8.0, 12.03, 11.01], cores=2, threads=2)  # busy during
    # work that ended before the run shows only in the 15-minute averages: a quiet run
    assert not tables.busy([0.49, 0.88, 2.06], [1.8, 1.37, 1.92], cores=2, threads=2)
