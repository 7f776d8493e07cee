"""The documentation is tested against the code: every `gptc ...` command line in README.md and
docs/ parses with the real argparse parsers (parse only, nothing runs), every `-o Section.key=...`
and `Section.key` names a config field, every script named exists, every relative link resolves,
and every Python block runs (a block fenced as ```python excerpt is only compiled).
docs/configuration.md is the generator's current output. The checkers are shown to fail on a
planted bad flag, bad key, missing script and dead link."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from gpt_compress import cli, config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "results" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
# CHANGELOG.md is history: its links must resolve, but old command lines and keys are not checked.
HISTORY = {ROOT / "CHANGELOG.md"}
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"(?<![\w/.-])((?:scripts|bench|docs)/[\w./-]+\.(?:sh|py))\b")
SECTION_KEY = re.compile(r"^(%s)\.([A-Za-z_][\w.]*)(?:=.*)?$" % "|".join(config.SECTIONS))


def _text_outside_fences(text: str) -> str:
    return FENCE.sub("", text)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def shell_lines(info: str, body: str) -> list[tuple[str, bool]]:
    """(command line, shown failing) of a bash/console block: continuations joined. In a console
    block only `$ ` lines are commands, and one whose output reports an error is an example of
    that error: it must still fail."""
    kind = info.split()[:1]
    if kind not in (["bash"], ["sh"], ["console"], ["shell"]):
        return []
    console = kind == ["console"]
    out: list[list] = []
    cur = ""
    for line in body.splitlines():
        if console and not cur and not line.startswith("$ "):
            if out and "error" in line:
                out[-1][1] = True  # the output of the last command
            continue
        if console and not cur:
            line = line[2:]
        cur += line.rstrip().rstrip("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            out.append([cur.strip(), False])
            cur = ""
    return [(ln, err) for ln, err in out if ln and not ln.startswith("#")]


def gptc_commands(line: str) -> list[list[str]]:
    """The argument lists of every `gptc` (or `export_model`) invocation on one shell line."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    out, cur = [], None
    for tok in tokens:
        if tok in ("|", "||", "&&", ";", ">", ">>", "2>&1") or tok.endswith(";"):
            if cur is not None:
                out.append(cur)
            cur = None
            continue
        if cur is not None:
            cur.append(tok)
        elif tok in ("gptc", ".venv/bin/gptc", "$(command -v gptc)"):
            cur = []
        elif tok == "export_model":
            cur = ["export"]
    if cur is not None:
        out.append(cur)
    return out


@functools.lru_cache(maxsize=None)
def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser `gptc <name>` builds (cli.main's), without running the command."""
    module = importlib.import_module(f"gpt_compress.commands.{cli.COMMANDS[name][0]}")
    parser = argparse.ArgumentParser(prog=f"gptc {name}", description=cli.COMMANDS[name][1])
    module.add_arguments(parser)
    return parser


def check_command(argv: list[str], whole: bool = True) -> str | None:
    """None if `gptc argv...` parses; else the parser's complaint. A mention in running text
    (``whole=False``, e.g. `gptc infer --threads N`) need not be complete: its command and
    options must exist."""
    if not argv:
        return "bare `gptc`"
    if argv[0] in ("-h", "--help", "-V", "--version", "-v", "--verbose"):
        return None if len(argv) == 1 or argv[0] in ("-h", "--help", "-V", "--version") else \
            check_command(argv[1:], whole)
    if argv[0] not in cli.COMMANDS:
        return f"unknown command {argv[0]!r}"
    if not whole:
        known = command_parser(argv[0])._option_string_actions  # every -x / --xx the parser takes
        bad = [t for t in argv[1:] if t.startswith("-") and t.split("=", 1)[0] not in known]
        return f"unknown option(s) {bad}" if bad else None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            command_parser(argv[0]).parse_args(argv[1:])
    except SystemExit as e:
        if e.code not in (0, None):  # --help exits 0
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def check_key(dotted: str) -> str | None:
    """None if ``Section.key[.sub]`` names a config field; else why not."""
    section, *keys = dotted.split(".")
    if section not in config.SECTIONS:
        return f"unknown section {section!r}"
    cls = typing.get_type_hints(config.Config)[config.SECTIONS[section]]
    for i, key in enumerate(keys):
        if section == "Model" and key == "preset" and i == 0:
            return None
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if key not in fields:
            return f"unknown key {dotted!r}"
        cls = typing.get_type_hints(cls)[key]
    return None


def overrides(argv: list[str]) -> list[str]:
    """The ``Section.key`` of every ``-o Section.key=value`` in an argument list."""
    out = []
    for i, tok in enumerate(argv):
        text = argv[i + 1] if tok in ("-o", "--override") and i + 1 < len(argv) else (
            tok[2:] if tok.startswith("-o") and len(tok) > 2 and tok[2] != "-" else None)
        if text and "=" in text:
            out.append(text.split("=", 1)[0])
    return out


def check_link(page: Path, target: str) -> str | None:
    """None if a relative link resolves (anchors and web links are not followed)."""
    if re.match(r"^[a-z]+:", target) or target.startswith("#"):
        return None
    path = (page.parent / target.split("#", 1)[0]).resolve()
    return None if path.exists() else f"dead link {target!r}"


def check_script(name: str) -> str | None:
    return None if (ROOT / name).exists() else f"no such script {name!r}"


def page_problems(page: Path) -> list[str]:
    """Every problem found on one page, as 'page: problem'."""
    text = page.read_text(encoding="utf-8")
    rel = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    problems = [f"{rel}: {p}" for t in LINK.findall(_text_outside_fences(text)) if (p := check_link(page, t))]
    if page in HISTORY:
        return problems
    lines = [(ln, True, err) for info, body in fenced_blocks(text) for ln, err in shell_lines(info, body)]
    spans = INLINE.findall(_text_outside_fences(text))
    lines += [(s, False, False) for s in spans  # not the placeholders of `gptc <command> --help`
              if s.startswith("gptc ") and "<" not in s and not s.startswith("gptc ...")]
    for line, whole, shown_failing in lines:
        for argv in gptc_commands(line):
            found = [f"`gptc {' '.join(argv)}`: {p}"] if (p := check_command(argv, whole)) else []
            found += [f"-o {k}: {p}" for k in overrides(argv) if (p := check_key(k))]
            if shown_failing and not found:
                problems.append(f"{rel}: `gptc {' '.join(argv)}` is shown failing but is valid now")
            elif not shown_failing:
                problems += [f"{rel}: {p}" for p in found]
    for span in spans:
        m = SECTION_KEY.match(span.strip())
        if m and "<" not in span and (p := check_key(span.split("=", 1)[0].strip())):
            problems.append(f"{rel}: `{span}`: {p}")
    problems += [f"{rel}: {p}" for s in sorted(set(SCRIPT.findall(text))) if (p := check_script(s))]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_matches_the_code(page):
    assert page.exists(), page
    assert page_problems(page) == []


def python_blocks() -> list[tuple[str, str, bool]]:
    """(where, code, runs) of every Python block; ```python excerpt blocks are compiled only."""
    out = []
    for page in PAGES:
        for i, (info, body) in enumerate(fenced_blocks(page.read_text(encoding="utf-8"))):
            words = info.split()
            if words[:1] == ["python"]:
                out.append((f"{page.relative_to(ROOT)}#{i}", body, "excerpt" not in words))
    return out


@pytest.mark.parametrize("where,code,runs", python_blocks(), ids=[w for w, _, _ in python_blocks()])
def test_python_blocks(where, code, runs, tmp_path):
    compile(code, where, "exec")  # an excerpt still has to be valid Python
    if runs:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{where}:\n{proc.stderr[-2000:]}"


def test_configuration_page_is_generated_and_current():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_configuration.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_section_and_key_is_in_the_configuration_page():
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for section, attr in config.SECTIONS.items():
        for f in dataclasses.fields(typing.get_type_hints(config.Config)[attr]):
            assert f"`{section}.{f.name}" in text


def test_checkers_catch_planted_drift(tmp_path):
    # A bad flag, a bad command, a bad key, a missing script and a dead link each fail, and their
    # good twins pass, so a green run means the docs match the code.
    assert check_command(["pretrain", "-c", "configs/pretrain_gpt_tiny_cpu.yaml"]) is None
    assert "--no-such-flag" in check_command(["pretrain", "--no-such-flag"])
    assert check_command(["pretrian"]) is not None
    assert check_command(["infer", "--threads"], whole=False) is None
    assert check_command(["infer", "--thread-count"], whole=False) is not None
    assert check_key("Engine.max_steps") is None and check_key("Optimizer.lr.max_lr") is None
    assert check_key("Engine.max_stepz") is not None and check_key("Optimizer.lr.nope") is not None
    assert check_key("Nope.key") is not None
    assert check_script("scripts/pretrain_gpt_345M_single_card.sh") is None
    assert check_script("scripts/no_such_script.sh") is not None
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [web](https://example.com) [anchor](#top) [dead](no/such/file.md)\n")
    assert check_link(page, "page.md") is None and check_link(page, "https://example.com") is None
    assert check_link(page, "no/such/file.md") is not None
    # The same drift planted in a page is reported by the page checker, one problem each.
    planted = tmp_path / "planted.md"
    planted.write_text("```bash\ngptc pretrain -c configs/pretrain_gpt_tiny_cpu.yaml --no-such-flag\n"
                       "gptc pretrain -c configs/pretrain_gpt_tiny_cpu.yaml -o Engine.max_stepz=10\n"
                       "scripts/no_such_script.sh\n```\n[dead](no_such_page.md)\n", encoding="utf-8")
    found = page_problems(planted)
    assert len(found) == 4, found
    assert any("--no-such-flag" in p for p in found)
    assert any("Engine.max_stepz" in p for p in found)
    assert any("no_such_script.sh" in p for p in found)
    assert any("no_such_page.md" in p for p in found)
