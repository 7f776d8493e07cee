"""An English corpus that every machine already has: the Python standard library's docstrings.

Used by ``gptc demo`` so the toolkit can be shown end to end with no download. Each module's
module/class/function docstrings (cleaned, hard-wrapped lines joined into paragraphs, code
examples dropped) form one document.
"""
from __future__ import annotations

import ast
import json
import os
import sysconfig
import warnings

from ..fileio import atomic_file


def iter_stdlib_files(root: str | None = None):
    """Sorted ``.py`` files of the standard library, skipping tests and site-packages."""
    root = root or sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def reflow(doc: str) -> str:
    """Prose paragraphs of a docstring, hard-wrapped lines joined; code-like paragraphs
    (indented lines, doctest prompts) are dropped so the corpus reads like English text."""
    out = []
    for para in doc.split("\n\n"):
        lines = [ln for ln in para.split("\n") if ln.strip()]
        if not lines or any(ln.startswith((" ", "\t", ">>>", "...")) for ln in lines):
            continue
        text = " ".join(ln.strip() for ln in lines)
        if len(text) > 30:
            out.append(text)
    return "\n\n".join(out)


def module_docstrings(path: str) -> str:
    """All docstrings of one source file, in source order, separated by blank lines."""
    try:
        with open(path, encoding="utf-8") as f:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old modules
                tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            doc = reflow(doc) if doc else ""
            if len(doc) > 40:
                docs.append(doc)
    return "\n\n".join(docs)


def build_stdlib_corpus(out_jsonl: str, max_bytes: int = 4_000_000, root: str | None = None) -> dict:
    """Write ``{"text": ...}`` lines (one per module) up to ``max_bytes``; returns a summary."""
    os.makedirs(os.path.dirname(os.path.abspath(out_jsonl)), exist_ok=True)
    docs = total = 0
    with atomic_file(out_jsonl) as f:
        for path in iter_stdlib_files(root):
            text = module_docstrings(path)
            if len(text) < 200:
                continue
            f.write(json.dumps({"text": text}) + "\n")
            docs += 1
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                break
        if docs == 0:  # leaves no file behind
            raise RuntimeError(f"no docstrings found under {root or sysconfig.get_paths()['stdlib']}")
    return {"documents": docs, "bytes": total, "path": out_jsonl}
