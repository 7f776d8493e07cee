"""The package's layering, read from the source with ``ast`` (imports inside functions included):
the core (model, data, train, parallel) never reaches into the deployment wing or the CLI, and
no two subpackages (or top-level modules) import each other, directly or around a circle, no
private name (``_x``) is imported from another module, and no module probes a backend for a
capability (``inference/base.py``'s ``Backend`` declares them all). In the
tests, no test module imports another: what two of them share lives in a ``tests/_*_helpers.py``
module (a test file imported elsewhere would have its tests collected and its fixtures shared by
accident, and would change whenever the other test changes)."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gpt_compress"
TESTS = Path(__file__).resolve().parent
CORE = ("model", "data", "train", "parallel")
ABOVE_CORE = ("export", "inference", "commands")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    p = PACKAGE.parent.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


@functools.lru_cache(maxsize=None)
def import_edges() -> tuple[tuple[str, str, int], ...]:
    """(importing module, imported gpt_compress module, line) for every import statement."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import submodule` imports the submodule
                targets = [f"{source}.{a.name}" if _is_module(f"{source}.{a.name}") else source for a in node.names]
            else:
                continue
            edges += [(module, t, node.lineno) for t in targets if t.split(".")[0] == "gpt_compress"]
    return tuple(edges)


def _part(module: str) -> str:
    """The subpackage or top-level module of ``module`` ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_import_reader_sees_deferred_and_relative_imports():
    edges = {(a, b) for a, b, _ in import_edges()}
    # a relative import at module level, and one deferred into a function body
    assert ("gpt_compress.export.api", "gpt_compress.inference.manifest") in edges
    assert ("gpt_compress.export.validate", "gpt_compress.inference.predictor") in edges
    assert ("gpt_compress.cli", "gpt_compress.runtime") in edges  # `from . import runtime`


def test_core_never_imports_export_inference_or_commands():
    bad = [f"{a} (line {line}) imports {b}" for a, b, line in import_edges()
           if _part(a) in CORE and _part(b) in ABOVE_CORE]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for a, b, line in import_edges():
        pa, pb = _part(a), _part(b)
        if pa != pb and pb:  # `from gpt_compress import __version__` reads the root, not a subpackage
            graph.setdefault(pa, set()).add(pb)
            where.setdefault((pa, pb), f"{a}:{line} -> {b}")
    # A depth-first search for a back edge; report the circle with one import per step.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circle = stack[stack.index(nxt):] + [nxt]
                return [where[(x, y)] for x, y in zip(circle, circle[1:])]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            circle = visit(node)
            assert circle is None, "import cycle:\n" + "\n".join(circle)


def test_no_test_module_imports_another():
    bad = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            bad += [f"tests/{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not bad, "move what is shared into a tests/_*_helpers.py module:\n" + "\n".join(bad)


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore stays in its module: what another module needs is public
    (``from .x import _helper`` couples two modules through a name that promises nothing)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("gpt_compress")):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                bad += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {n}" for n in names]
    assert not bad, "make these public, or move them to the module that uses them:\n" + "\n".join(bad)


def _names_a_backend(node: ast.AST) -> bool:
    """``backend``, ``self.backend``, ``gen.backend``, ``draft_backend``: an expression naming a backend."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "backend" in name.lower()


def test_backends_are_used_through_their_contract():
    """Every capability of a backend is declared by ``inference/base.py``'s ``Backend``: no module
    probes for one (``getattr``/``hasattr`` on a backend) or reaches into a backend's private
    attributes."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent)
        if path == PACKAGE / "inference" / "base.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args and _names_a_backend(node.args[0])):
                bad.append(f"{where}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and _names_a_backend(node.value)):
                bad.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "declare the capability on inference.base.Backend:\n" + "\n".join(bad)
