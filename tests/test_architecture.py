"""The shape of the house: one protocol, mirrored backends, one step loop, nothing outside the repo.

- Both backends export every name of ``common.backend.Backend`` with the protocol's signature.
- Both backends have the same modules, up to a listed set of differences, each with its reason.
- No backend runs its own step loop: ``common.run.runner.run`` is the only one.
- ``common`` imports no framework (tests/common/test_no_framework_imports.py runs it blocked).
- No file of the repository points outside it.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
from pathlib import Path

import pytest

from twinseq.common.backend import PROTOCOL, Backend

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("torch", "jax")

# module -> why only one backend has it. Empty today: every concept has the same module name.
ALLOWED_DIFFERENCES: dict[str, str] = {}
ALLOWED_DIFFERENCES["deepspeed"] = "DeepSpeed ZeRO-3 is a torch library; jax shards over its device mesh (sharding.py)"
ALLOWED_DIFFERENCES["zero3_grpo"] = "GRPO under DeepSpeed ZeRO-3, a torch library (see deepspeed)"
ALLOWED_DIFFERENCES["vllm_engine"] = "vLLM runs torch models; the jax backend generates with its own model"
ALLOWED_DIFFERENCES["blocked_attention"] = ("torch registers its blocked kernel (an autograd Function) as an HF attention "
                                          "function; jax reuses the ring's block kernel (context_parallel.py) from attention.py")
ALLOWED_DIFFERENCES["triton_ce"] = "twinseq's Triton loss kernel (loss_type='triton') is torch/CUDA; jax runs fused_linear"
ALLOWED_DIFFERENCES["triton_ce_kernels"] = "the Triton sources of triton_ce"
ALLOWED_DIFFERENCES["bf16_adamw"] = ("optimizer='adamw_bf16' (bfloat16 weights and moments, stochastic rounding) is "
                                    "torch only today; jax refuses it (trainer.check_optimizer)")
ALLOWED_DIFFERENCES["in_backward"] = ("optimizer_in_backward: a per-parameter step in each gradient's hook is torch's; "
                                     "jax's step is one compiled program with donated buffers (capabilities refuses it)")
ALLOWED_DIFFERENCES["bf16_adamw_kernel"] = "the Triton source of bf16_adamw's CUDA update"
ALLOWED_DIFFERENCES["distributed"] = ("torch's process group, launcher environment and reductions over ranks; jax is "
                                     "one process driving its device mesh (parallel.py)")
ALLOWED_DIFFERENCES["grouped"] = "jax's CPU grouped matmul; torch's grouped_mm is torch.nn.functional's"
ALLOWED_DIFFERENCES["unwrap"] = ("reaching the HF model and lm_head inside the peft package's wrapper; jax's adapters "
                                 "are its own modules (model.py, peft.py)")


def _protocol_signature(name: str) -> inspect.Signature:
    sig = inspect.signature(getattr(Backend, name))
    return sig.replace(parameters=list(sig.parameters.values())[1:])  # drop self


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", PROTOCOL)
def test_backend_functions_have_the_protocol_signature(backend, name):
    pytest.importorskip({"torch": "torch", "jax": "jax"}[backend])
    from twinseq.common.backend import load_backend

    fn = getattr(load_backend(backend), name)
    assert inspect.signature(fn) == _protocol_signature(name), (backend, name, str(inspect.signature(fn)))


def test_protocol_covers_what_users_call():
    assert {"build_model", "export_weights", "logits", "loss_and_grads", "train"} <= set(PROTOCOL)


def _modules(backend: str) -> set[str]:
    return {p.stem for p in (ROOT / f"{backend}_backend").glob("*.py") if p.stem != "__init__"}


def test_backends_mirror_each_others_module_names():
    torch_modules, jax_modules = _modules("torch"), _modules("jax")
    unexplained = (torch_modules ^ jax_modules) - set(ALLOWED_DIFFERENCES)
    assert not unexplained, f"modules in one backend only, with no reason given: {sorted(unexplained)}"
    assert {"attention", "checkpoint", "context_parallel", "dpo", "logprobs", "losses", "memory", "model",
            "parallel", "trainer", "recipes", "grpo", "generation", "peft"} <= torch_modules & jax_modules


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_init_files_are_plain_re_exports(backend):
    """Only a docstring, ``from ... import ...`` and ``__all__``: no logic, no import hooks."""
    tree = ast.parse((ROOT / f"{backend}_backend" / "__init__.py").read_text())
    for node in tree.body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        dunder_all = isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]
        assert docstring or dunder_all or isinstance(node, ast.ImportFrom), ast.dump(node)[:120]
    exported = next(n for n in tree.body if isinstance(n, ast.Assign)).value
    assert set(PROTOCOL) <= {elt.value for elt in exported.elts}


def test_no_step_loop_outside_the_runner():
    hits = subprocess.run(["git", "grep", "-nE", r"for step in range", "--", "torch_backend", "jax_backend"],
                          cwd=ROOT, capture_output=True, text=True).stdout
    assert hits == "", hits
    assert "for step in range" in (ROOT / "common" / "run" / "runner.py").read_text()


def test_the_two_checkpoint_meanings_have_distinct_names():
    """A model folder is ``save_pretrained``/``load_pretrained`` (both backends); a resumable training
    checkpoint is ``common.run.checkpoint.save_training_checkpoint`` (one writer for every trainer)."""
    for backend in BACKENDS:
        source = (ROOT / f"{backend}_backend" / "checkpoint.py").read_text()
        assert "def save_pretrained" in source and "def load_pretrained" in source
        assert not re.search(r"def (save|load)_checkpoint\b", source), backend


def test_nothing_in_the_repository_points_outside_it():
    hits = subprocess.run(["git", "grep", "-nF", "../" + "shared", "--", ".", ":(exclude)tests/test_architecture.py"],
                          cwd=ROOT, capture_output=True, text=True).stdout
    assert hits == "", hits


def test_the_architecture_page_tables_are_generated_from_the_code():
    """docs/architecture.md's generated tables (config sections, protocol, template hooks, modules, common's
    packages) equal what ``docs/architecture_tables.py`` writes from the code today."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("architecture_tables", ROOT / "docs" / "architecture_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert text.count("<!-- generated:") == len(tables.TABLES), "every table is on the page once"
    assert tables.render(text) == text, "run python docs/architecture_tables.py and commit the page"
    assert "| `run` |" not in text and "| `common/run` | `trainer` |" in text
