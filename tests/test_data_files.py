"""tests/data: the files the suite reads when ../shared/data is absent are the ones the README
names, with the checksums in tests/data/SHA256SUMS (a changed slice changes the tests' figures)."""
from __future__ import annotations

import hashlib

from conftest import TESTS_DATA


def test_shipped_data_matches_its_checksums_and_readme():
    sums = dict(reversed(line.split("  ", 1)) for line in (TESTS_DATA / "SHA256SUMS").read_text().splitlines())
    files = sorted(f"./{p.relative_to(TESTS_DATA).as_posix()}" for p in TESTS_DATA.rglob("*")
                   if p.is_file() and p.name not in ("README.md", "SHA256SUMS"))
    assert sorted(sums) == files
    for name, digest in sums.items():
        assert hashlib.sha256((TESTS_DATA / name).read_bytes()).hexdigest() == digest, name
    readme = (TESTS_DATA / "README.md").read_text(encoding="utf-8")
    data = [n for n in files if not n.endswith((".LICENSE", ".copyright")) and "LICENSE" not in n]
    missing = [n for n in data if n.rsplit("/", 1)[-1] not in readme]
    assert not missing, f"not described in tests/data/README.md: {missing}"
