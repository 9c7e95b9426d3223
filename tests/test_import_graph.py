"""The import graph of ``twinseq.*``, computed from the source (no import runs): the house rules that keep it a tree.

- no cycle among twinseq's modules, counting the imports inside functions too (an import moved into a function
  hides a cycle from Python, not from a reader);
- ``common`` imports neither backend, and the backends never import each other;
- imports inside functions are the exception. In the backends each names an optional dependency
  (``# optional dependency``), at most 20 per backend. In ``common`` none imports twinseq (that would hide a cycle);
  heavy third-party libraries (datasets, pyarrow, matplotlib, tensorboard, safetensors, tyro, jinja2) are imported
  where they are used, so that ``import twinseq`` and the CLI's parsing stay fast and framework-free.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("common", "torch_backend", "jax_backend")
MAX_FUNCTION_IMPORTS = {"torch_backend": 20, "jax_backend": 20}
OPTIONAL_MARK = "optional dependency"
STDLIB_ONLY_MARK = "stdlib-only module"  # common/data/corpus.py also runs as a script in a clean interpreter


def _modules() -> dict[str, Path]:
    out = {"twinseq": ROOT / "twinseq" / "__init__.py"}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / layer).with_suffix("").parts if p != "__init__"]
            out[".".join(["twinseq", layer, *parts])] = path
    return out


MODULES = _modules()


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _targets(node: ast.AST) -> list[str]:
    """The twinseq modules an import statement loads (``from pkg import submodule`` loads the submodule)."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("twinseq"):
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
        return subs if len(subs) == len(node.names) else [node.module, *subs]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("twinseq")]
    return []


def _graph():
    edges: dict[str, set[str]] = defaultdict(set)
    in_functions: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for name, path in MODULES.items():
        source = path.read_text()
        tree = ast.parse(source)
        skip = _type_checking_lines(tree)
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in skip:
                edges[name].update(t for t in _targets(node) if t in MODULES and t != name)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        layer = name.split(".")[1] if name.count(".") else "twinseq"
                        in_functions[layer].append((str(path.relative_to(ROOT)), node.lineno,
                                                    lines[node.lineno - 1].strip()))
    return edges, in_functions


EDGES, IN_FUNCTIONS = _graph()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(MODULES):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_graph_is_read_from_every_layer():
    assert len(MODULES) > 60
    assert "twinseq.torch_backend.trainer" in EDGES["twinseq.torch_backend.grpo"]
    assert "twinseq.common.run.trainer" in EDGES["twinseq.jax_backend.trainer"]


def test_the_cycle_finder_finds_a_cycle():
    edges = defaultdict(set, {"twinseq.common.a": {"twinseq.common.b"}, "twinseq.common.b": {"twinseq.common.a"}})
    global MODULES
    saved = MODULES
    MODULES = {**saved, "twinseq.common.a": Path("a"), "twinseq.common.b": Path("b")}
    try:
        assert _cycles(edges) == [["twinseq.common.a", "twinseq.common.b"]]
    finally:
        MODULES = saved


def test_no_import_cycle():
    cycles = _cycles(EDGES)
    detail = ["; ".join(f"{m} -> {sorted(EDGES[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, f"import cycles: {detail}"


@pytest.mark.parametrize("layer,forbidden", [("common", ("twinseq.torch_backend", "twinseq.jax_backend")),
                                             ("torch_backend", ("twinseq.jax_backend",)),
                                             ("jax_backend", ("twinseq.torch_backend",))])
def test_the_dependency_rule(layer, forbidden):
    bad = sorted(f"{m} -> {t}" for m, targets in EDGES.items() if m.startswith(f"twinseq.{layer}")
                 for t in targets if t.startswith(forbidden))
    assert not bad, bad


@pytest.mark.parametrize("layer", LAYERS)
def test_no_twinseq_import_inside_a_function(layer):
    hidden = [f"{path}:{line}: {text}" for path, line, text in IN_FUNCTIONS[layer]
              if re.match(r"(from|import) twinseq\b", text) and STDLIB_ONLY_MARK not in text
              and OPTIONAL_MARK not in text]  # a module that imports an optional library at its top
    assert not hidden, f"twinseq imports inside functions (move them to module level): {hidden}"


@pytest.mark.parametrize("layer", ["torch_backend", "jax_backend"])
def test_imports_inside_functions_are_optional_dependencies(layer):
    found = IN_FUNCTIONS[layer]
    unmarked = [f"{path}:{line}: {text}" for path, line, text in found if OPTIONAL_MARK not in text]
    assert not unmarked, f"imports inside functions that do not say '# {OPTIONAL_MARK}': {unmarked}"
    assert len(found) <= MAX_FUNCTION_IMPORTS[layer], [f"{p}:{n}" for p, n, _ in found]
