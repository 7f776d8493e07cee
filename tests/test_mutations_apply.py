"""tests/mutations.py applies each defect by replacing a piece of source text that must occur
exactly once; a rename or a move that drops that text would leave the defect unchecked (the
script reports it only when run). This keeps every mutation applicable."""
from mutations import MUTATIONS, ROOT


def test_every_mutation_finds_its_text_exactly_once():
    assert len(MUTATIONS) >= 5
    for m in MUTATIONS:
        text = (ROOT / m.path).read_text(encoding="utf-8")
        for old, new in m.edits:
            assert text.count(old) == 1, (m.name, m.path, old)
            assert old != new, m.name
        for test in m.tests:
            assert (ROOT / test.split("::")[0]).is_file(), (m.name, test)
