"""The MoE and Gemma 3 families on JAX's GPU backend (marked ``gpu``; skipped unless JAX itself sees a GPU:
``benchmarks/gpu/run_all.sh`` sets ``JAX_PLATFORMS=""``, the root conftest.py pins ``cpu`` otherwise).

On the GPU the experts run as one ``jax.lax.ragged_dot`` per projection under autodiff (the CPU runs
``moe.grouped_experts``), so the CPU suite never reaches that path. Invariants, float32 at matmul precision "highest":

- twinseq's logits of padded and packed batches equal transformers' eager forward of each document alone (torch,
  CPU) within ``logits_abs``, for Qwen3-MoE, Mixtral, gpt-oss (sinks, biased experts, clamped SwiGLU) and Gemma 3;
- a MoE block's output and its gradients (input and every parameter) on the GPU's ragged_dot path equal the CPU's
  ``grouped_experts`` kernel on the same weights within the float32 ``logits_abs`` / ``grad_rel``; two experts'
  weights swapped on the GPU side fail that (the control).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

torch = pytest.importorskip("torch")

from parity_tests.families import (  # noqa: E402
    FAMILY_CASES,
    family_batches,
    family_examples,
    hf_document_logits,
    hf_random_checkpoint,
)
from parity_tests.tolerances import tol  # noqa: E402


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu() is None, reason="JAX sees no GPU (the GPU lane)")]

NEW_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "gemma3")


@pytest.fixture(autouse=True)
def highest_precision():
    saved = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", saved)


def _doc_rows(batch, i: int) -> tuple[int, np.ndarray]:
    if batch.shape[0] == 1:
        return 0, np.flatnonzero(batch.segment_ids[0] == i + 1)
    return i, np.flatnonzero(batch.segment_ids[i] == 1)


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_gpu_logits_equal_transformers_per_document(tmp_path, name):
    from transformers import AutoModelForCausalLM

    from twinseq.jax_backend.checkpoint import load_pretrained
    from twinseq.jax_backend.model import logits

    path = hf_random_checkpoint(name, tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    refs = [hf_document_logits(hf, ex["input_ids"]) for ex in family_examples()]
    model = load_pretrained(path, device=_gpu())
    assert FAMILY_CASES[name].rope_type != "dynamic"
    batches = family_batches()
    for layout in ("padded", "packed"):
        out = logits(model, batches[layout])
        diff = max(float(np.abs(out[_doc_rows(batches[layout], i)] - r).max()) for i, r in enumerate(refs))
        print(f"jax gpu logits vs transformers {name} {layout}: {diff:.2e}")
        assert diff <= tol("float32", "logits_abs"), (name, layout, diff)


def _block_value_and_grads(preset: str, platform: str, swap: bool = False):
    """Output and gradients (input, every block parameter) of ``sum(y ** 2)`` of layer 1's MoE block of ``preset``,
    built on ``platform``'s device; ``swap`` exchanges experts 0 and 1's gate/up weights first."""
    from flax import nnx

    import twinseq.jax_backend as jb
    from twinseq.common.models.configs import resolve_model_config
    from twinseq.common.models.init import init_weights

    cfg = resolve_model_config(preset)
    weights = init_weights(cfg, seed=0)
    if swap:
        key = next(k for k in weights if k.startswith("model.layers.1.") and k.endswith("experts.gate_up_proj"))
        weights[key] = weights[key][[1, 0, *range(2, weights[key].shape[0])]]
    device = jax.devices(platform)[0]
    block = jb.build_model(cfg, weights, dtype="float32", device=device).model.layers[1].mlp
    x_BTH = jax.device_put(
        np.random.default_rng(1).standard_normal((2, 24, cfg.hidden_size)).astype(np.float32), device
    )
    graphdef, params = nnx.split(block)

    def loss(p, x):
        y = nnx.merge(graphdef, p)(x)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y**2), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x_BTH)
    return np.asarray(y), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"])
def test_gpu_ragged_dot_experts_equal_the_cpu_kernel(preset):
    y_cpu, grads_cpu = _block_value_and_grads(preset, "cpu")
    y_gpu, grads_gpu = _block_value_and_grads(preset, "gpu")
    assert len(grads_cpu) == len(grads_gpu) >= 4
    value_err = float(np.abs(y_gpu - y_cpu).max())
    grad_errs = [float(np.linalg.norm(g - c) / max(np.linalg.norm(c), 1e-30)) for g, c in zip(grads_gpu, grads_cpu)]
    print(f"jax gpu ragged_dot vs cpu kernel {preset}: value {value_err:.1e}, worst grad {max(grad_errs):.1e}")
    assert value_err <= tol("float32", "logits_abs") and max(grad_errs) <= tol("float32", "grad_rel"), grad_errs
    y_swapped, _ = _block_value_and_grads(preset, "gpu", swap=True)  # the control
    assert float(np.abs(y_swapped - y_cpu).max()) > 100 * tol("float32", "logits_abs")
