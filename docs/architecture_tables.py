"""The tables of docs/architecture.md, generated from the code: the config sections and their fields, the backend
protocol, the trainer template's hooks, and the modules of each backend.

    python docs/architecture_tables.py          # rewrite the generated tables in docs/architecture.md
    python docs/architecture_tables.py --check  # exit 1 if they differ from the code (tests/test_architecture.py)

A generated table sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; the prose around it
is written by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
BACKENDS = ("torch", "jax")


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").strip().split()).replace("``", "`")
    match = re.match(r"(.+?\.)(\s|$)", text)
    return (match.group(1) if match else text).replace("|", "\\|")


def config_table() -> str:
    from twinseq.common.config import TrainConfig

    rows = ["| section | class | fields |", "|---|---|---|"]
    top = [f.name for f in dataclasses.fields(TrainConfig) if not dataclasses.is_dataclass(f.type)
           and not (isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory))]
    sections = []
    for f in dataclasses.fields(TrainConfig):
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            sections.append((f.name, factory))
    rows.append(f"| (top) | `TrainConfig` | {', '.join(top)} |")
    for name, cls in sections:
        rows.append(f"| `{name}` | `{cls.__name__}` | {', '.join(x.name for x in dataclasses.fields(cls))} |")
    return "\n".join(rows)


def protocol_table() -> str:
    from twinseq.common.backend import PROTOCOL, Backend

    rows = ["| function | signature | what it does |", "|---|---|---|"]
    for name in PROTOCOL:
        fn = getattr(Backend, name)
        sig = inspect.signature(fn)
        sig = sig.replace(parameters=list(sig.parameters.values())[1:], return_annotation=inspect.Signature.empty)
        params = ", ".join(p.name if p.kind is not p.KEYWORD_ONLY else f"*{p.name}"
                           for p in sig.parameters.values())
        rows.append(f"| `{name}` | `({params})` | {_first_sentence(fn.__doc__)} |")
    return "\n".join(rows)


def template_table() -> str:
    from twinseq.common.run.trainer import TrainerTemplate

    rows = ["| hook | who writes it | what it does |", "|---|---|---|"]
    source = inspect.getsource(TrainerTemplate)
    task_part = source.split("# -- backend hooks")[0]
    for name, fn in TrainerTemplate.__dict__.items():
        if not callable(fn) or name.startswith("_") or name == "step":
            continue
        who = "the task" if f"def {name}(" in task_part else "the backend"
        rows.append(f"| `{name}` | {who} | {_first_sentence(fn.__doc__)} |")
    return "\n".join(rows)


def _module_doc(backend: str, module: str) -> str:
    path = ROOT / f"{backend}_backend" / f"{module}.py"
    if not path.exists():
        return "—"
    return _first_sentence(ast.get_docstring(ast.parse(path.read_text())))


def modules_table() -> str:
    names = sorted({p.stem for b in BACKENDS for p in (ROOT / f"{b}_backend").glob("*.py") if p.stem != "__init__"})
    rows = ["| module | torch | jax |", "|---|---|---|"]
    for name in names:
        rows.append(f"| `{name}` | {_module_doc('torch', name)} | {_module_doc('jax', name)} |")
    return "\n".join(rows)


def common_table() -> str:
    rows = ["| package | module | what it holds |", "|---|---|---|"]
    common = ROOT / "common"
    for path in sorted(common.rglob("*.py")):
        rel = path.relative_to(common)
        if rel.name == "__init__.py" and rel.parent == Path("."):
            continue
        package = "common" if rel.parent == Path(".") else f"common/{rel.parent}"
        module = "(package)" if rel.name == "__init__.py" else rel.stem
        rows.append(f"| `{package}` | `{module}` | {_first_sentence(ast.get_docstring(ast.parse(path.read_text())))} |")
    return "\n".join(rows)


TABLES = {"config": config_table, "protocol": protocol_table, "template": template_table,
          "modules": modules_table, "common": common_table}


def render(text: str) -> str:
    """``text`` with every generated region replaced by the table the code gives today."""
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise KeyError(f"docs/architecture.md names a generated table {name!r} that does not exist: {list(TABLES)}")
        return f"<!-- generated: {name} -->\n{TABLES[name]()}\n<!-- end generated -->"

    return re.sub(r"<!-- generated: (\w+) -->\n.*?<!-- end generated -->", replace, text, flags=re.S)


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    fresh = render(text)
    if "--check" in argv:
        if fresh != text:
            print("docs/architecture.md's generated tables differ from the code; run python docs/architecture_tables.py")
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
