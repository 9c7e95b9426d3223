"""The dependency rule: ``twinseq.common`` imports and runs with torch and jax unavailable.

A meta-path finder claims every blocked top-level package and hands back a loader that
raises ``ImportError``, so even ``import torch`` inside a try/except, or a lazy import deep in
a library, fails. It runs in a fresh subprocess so this test process is untouched.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import twinseq.common

BLOCKED = ("torch", "jax", "jaxlib", "flax", "optax")
COMMON_DIR = Path(twinseq.common.__file__).parent
MODULES = sorted(".".join(p.relative_to(COMMON_DIR).with_suffix("").parts) for p in COMMON_DIR.rglob("*.py")
                 if p.stem != "__init__")

BLOCKER = textwrap.dedent(f"""
    import importlib.abc, importlib.machinery, sys
    BLOCKED = {BLOCKED!r}

    class _Refuse(importlib.abc.Loader):
        def create_module(self, spec):
            raise ImportError(f"{{spec.name}} is blocked: twinseq.common must not import it")
        def exec_module(self, module):
            raise ImportError("blocked")

    class _Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                return importlib.machinery.ModuleSpec(name, _Refuse())
            return None

    sys.meta_path.insert(0, _Blocker())

    def _check():
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not leaked, f"framework modules imported: {{leaked}}"
""")


def _run(body: str) -> subprocess.CompletedProcess:
    code = BLOCKER + textwrap.dedent(body) + "\n_check()\nprint('OK')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_blocker_really_blocks():
    proc = _run("""
        try:
            import torch
        except ImportError as err:
            assert "blocked" in str(err)
        else:
            raise AssertionError("torch imported")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr


def test_every_common_module_imports_without_frameworks():
    assert {"data.corpus", "data.prepare", "data.tokenizer", "data.truncation", "data.lengths",
            "run.trainer", "run.rollout", "objectives.grpo", "models.peft"} <= set(MODULES)
    imports = "\n".join(f"import twinseq.common.{name}" for name in MODULES)
    proc = _run("import twinseq.common\n" + imports)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_data_pipeline_runs_without_frameworks(embedded_tokenizer):
    """Loading, tokenising and profiling never reach for torch or jax at run time either."""
    proc = _run("""
        from twinseq.common.config import TrainConfig
        from twinseq.common.data.prepare import prepare_sft_dataset, prepare_dpo_dataset
        from twinseq.common.data.lengths import profile_lengths
        rows, tok, stats = prepare_sft_dataset(TrainConfig.from_flat(dataset_split="train[:50]", max_length=64))
        assert len(rows) > 0
        rows, tok, stats = prepare_dpo_dataset(TrainConfig.from_flat(task="dpo", dataset_split="train[:50]"))
        assert len(rows) > 0
        profile_lengths([len(x) for x in rows["chosen_input_ids"]], [64], 4)
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("name", MODULES)
def test_module_source_names_no_framework(name):
    """A cheap static guard next to the runtime one: no ``import torch``-style line in common/."""
    source = (COMMON_DIR / (name.replace(".", "/") + ".py")).read_text()
    pattern = re.compile(rf"^\s*(import|from)\s+({'|'.join(BLOCKED)})\b", re.MULTILINE)
    assert not pattern.findall(source), name
