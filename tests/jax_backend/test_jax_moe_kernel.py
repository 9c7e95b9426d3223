"""``jax_backend.moe.grouped_experts``, the MoE experts' CPU kernel (gather and scatter inside, a custom VJP that
saves the gate/up pre-activations only), against two independent computations.

Invariants (float32 at "highest" matmul precision; bounds from parity_tests/tolerances.py, no new one):
- the kernel equals a per-copy reference (every copy's expert weights gathered, plain jnp under autodiff): output
  within ``logits_abs``, the gradients of the input, the routing weights, both expert tensors and both biases
  within ``grad_rel``; for both layouts (Qwen3-MoE's and Mixtral's output-major experts with a GLU gate, gpt-oss's
  input-major experts with biases and a clamped SwiGLU); with an empty expert and with every
  copy on one expert; blocks of 3 rows (experts over several blocks, the last slice clamped) and of 32;
- an expert no copy reaches gets an exactly zero gradient;
- swapping two experts' weights changes the output (negative control of the comparison);
- ``SparseMoeBlock``: its CPU path (this kernel) equals its per-projection path (``grouped_matmul`` under autodiff)
  in output and every parameter's gradient, in float32 and, with the same dtypes, in bfloat16 (where Mixtral sums
  its float32-weighted copies in float32);
- nothing per copy is kept but the gate/up pre-activations: the compiled forward + backward (weights frozen) has
  temporaries below one ``[S, H]`` float32 buffer (the gathered input every copy would otherwise keep), while the
  per-projection path's exceed it (the control).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from parity_tests.tolerances import TOLERANCES  # noqa: E402
from twinseq.common.models.configs import resolve_model_config  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.jax_backend import moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("highest_precision")

F32, BF16 = TOLERANCES["float32"], TOLERANCES["bfloat16"]
N, H, I, E = 10, 8, 6, 4  # tokens, hidden, expert intermediate, experts (top-2: 20 copies)
LAYOUTS = {
    "glu": moe.Layout(True, moe.GluGate(jax.nn.silu), "float32"),
    "gpt_oss": moe.Layout(False, moe.ClampedSwiGLU(limit=1.5, alpha=1.702), "float32"),
}
EXPERT_OF_COPY = {
    "an_empty_expert": [0, 2, 3, 2, 0, 3, 3, 0, 2, 2, 3, 0, 2, 3, 0, 0, 3, 2, 2, 0],  # expert 1 gets none
    "every_copy_on_one_expert": [2] * 2 * N,
}


def _inputs(layout_name: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    output_major, biases = layout_name != "gpt_oss", layout_name == "gpt_oss"
    x = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    gate_up = rng.standard_normal((E, 2 * I, H) if output_major else (E, H, 2 * I)) * 0.5
    down = rng.standard_normal((E, H, I) if output_major else (E, I, H)) * 0.5
    b1 = jnp.asarray(rng.standard_normal((E, 2 * I)), jnp.float32) if biases else None
    b2 = jnp.asarray(rng.standard_normal((E, H)), jnp.float32) if biases else None
    weight = jnp.asarray(rng.uniform(0.1, 1.0, 2 * N), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    return x, weight, jnp.asarray(gate_up, jnp.float32), jnp.asarray(down, jnp.float32), b1, b2, dy


def _sorted(expert_of_copy: list[int]):
    """(token of each sorted copy, its expert, group sizes, sort order) for copy ``i`` of token ``i // 2``."""
    expert = np.asarray(expert_of_copy)
    order = np.argsort(expert, kind="stable")
    return jnp.asarray(order // 2), jnp.asarray(expert[order]), jnp.asarray(np.bincount(expert, minlength=E)), order


def _reference(layout, token_S, expert_S, x, weight_S, gate_up, down, b1, b2):
    """Every copy's expert weights gathered, then the gated MLP per copy (plain jnp, differentiated by jax)."""
    spec = "sfh,sh->sf" if layout.output_major else "shf,sh->sf"
    gu = jnp.einsum(spec, gate_up[expert_S], x[token_S]) + (0 if b1 is None else b1[expert_S])
    spec = "shi,si->sh" if layout.output_major else "sih,si->sh"
    out = jnp.einsum(spec, down[expert_S], layout.gate(gu)) + (0 if b2 is None else b2[expert_S])
    return jnp.zeros(x.shape, layout.sum_dtype).at[token_S].add((out * weight_S[:, None]).astype(layout.sum_dtype))


def _value_and_grads(fn, args, dy):
    """(y, gradients of ``sum(y * dy)`` w.r.t. every float argument), jitted; ``None`` arguments skipped."""
    present = [i for i, a in enumerate(args) if a is not None]

    def loss(*floats):
        full = list(args)
        for i, a in zip(present, floats):
            full[i] = a
        y = fn(*full)
        return jnp.sum(y * dy), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(present))), has_aux=True))(
        *[args[i] for i in present]
    )
    return y, grads


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("case", sorted(EXPERT_OF_COPY))
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_kernel_equals_the_per_copy_reference(layout_name, case):
    layout = LAYOUTS[layout_name]
    x, weight, gate_up, down, b1, b2, dy = _inputs(layout_name)
    token_S, expert_S, group_sizes_E, order = _sorted(EXPERT_OF_COPY[case])
    weight_S = weight[order]
    args = (x, weight_S, gate_up, down, b1, b2)
    want_y, want_grads = _value_and_grads(lambda *a: _reference(layout, token_S, expert_S, *a), args, dy)
    for block_rows in (3, 32):

        def kernel(x_, w_, gu_, dn_, b1_, b2_, block_rows=block_rows):
            return moe.grouped_experts(x_, w_, token_S, group_sizes_E, gu_, dn_, b1_, b2_, layout, block_rows)

        y, grads = _value_and_grads(kernel, args, dy)
        assert y.dtype == want_y.dtype
        value_err = float(jnp.abs(y - want_y).max())
        grad_errs = [_rel(g, w) for g, w in zip(grads, want_grads)]
        print(
            f"{layout_name} {case} block {block_rows}: value {value_err:.1e}, grads {[f'{e:.1e}' for e in grad_errs]}"
        )
        assert value_err <= F32["logits_abs"]
        assert max(grad_errs) <= F32["grad_rel"], grad_errs
        empty = np.flatnonzero(np.asarray(group_sizes_E) == 0)
        for g in grads[2:]:  # the expert tensors and biases: exactly zero where no copy went
            assert not np.asarray(g)[empty].any()
    swapped = gate_up[jnp.asarray([2, 1, 0, 3])]  # experts 0 and 2 exchange their weights
    y_swapped = moe.grouped_experts(x, weight_S, token_S, group_sizes_E, swapped, down, b1, b2, layout)
    assert float(jnp.abs(y_swapped - want_y).max()) > 1e-2


def _block(name: str, dtype: str):
    """(layer 1's MoE block of the family's tiny preset, its hidden size)."""
    import twinseq.jax_backend as jb

    cfg = resolve_model_config(f"tiny-{name.replace('_', '-')}")
    return jb.build_model(cfg, init_weights(cfg, seed=0), dtype=dtype).model.layers[1].mlp, cfg.hidden_size


def _block_value_and_grads(block, x_BTH, fused: bool):
    block.grouped_experts_kernel = fused
    graphdef, params = nnx.split(block)

    def loss(p, x):
        y = nnx.merge(graphdef, p)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x_BTH)
    return y, jax.tree.leaves(grads)


@pytest.mark.slow  # about 4 s a family (six compiled forward + backward)
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_moe_block_on_cpu_equals_its_per_projection_path(name):
    for dtype in ("float32", "bfloat16"):
        block, hidden = _block(name, dtype)
        x_BTH = jnp.asarray(np.random.default_rng(1).standard_normal((2, 12, hidden)), dtype)
        y, grads = _block_value_and_grads(block, x_BTH, fused=True)
        want_y, want_grads = _block_value_and_grads(block, x_BTH, fused=False)
        assert y.dtype == want_y.dtype and [g.dtype for g in grads] == [g.dtype for g in want_grads]
        value_err = float(jnp.abs(y.astype(jnp.float32) - want_y.astype(jnp.float32)).max())
        grad_errs = [_rel(g.astype(jnp.float32), w.astype(jnp.float32)) for g, w in zip(grads, want_grads)]
        print(f"{name} {dtype}: value {value_err:.1e}, worst grad {max(grad_errs):.1e}")
        if dtype == "float32":
            assert value_err <= F32["logits_abs"] and max(grad_errs) <= F32["grad_rel"], grad_errs
        else:
            scale = float(jnp.abs(want_y.astype(jnp.float32)).max())
            assert value_err <= BF16["logits_ulps"] * 2.0 ** (np.floor(np.log2(scale)) - 7)
            assert max(grad_errs) <= BF16["grad_rel"], grad_errs


def test_nothing_per_copy_is_kept_but_the_gate_up_pre_activations():
    """At a shape whose experts are narrow beside the hidden size (``2I = H / 4``, as Qwen3-MoE's ``0.375 H``
    experts) with Qwen3-MoE's top-8, the kernel's compiled temporaries stay below one ``[S, H]`` buffer; the per-projection path keeps
    the gathered input and the unweighted output per copy, over it."""
    import dataclasses

    from twinseq.jax_backend.model import SparseMoeBlock

    hidden, experts, top_k, inter, tokens = 128, 16, 8, 16, 256
    cfg = dataclasses.replace(
        resolve_model_config("tiny-qwen3-moe"),
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
    )
    rng = np.random.default_rng(2)
    shapes = {"gate.weight": (experts, hidden), "experts.gate_up_proj": (experts, 2 * inter, hidden),
              "experts.down_proj": (experts, hidden, inter)}  # fmt: skip
    w = {"mlp." + n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in shapes.items()}
    block = SparseMoeBlock(cfg, w, "mlp.", "float32")
    x_BTH = jnp.asarray(rng.standard_normal((1, tokens, hidden)), jnp.float32)
    one_copy_buffer = tokens * block.top_k * hidden * 4
    temps = {}
    for fused in (True, False):
        block.grouped_experts_kernel = fused
        graphdef, params = nnx.split(block)
        step = jax.jit(jax.grad(lambda x, p=params, g=graphdef: jnp.sum(nnx.merge(g, p)(x) ** 2)))
        temps[fused] = step.lower(x_BTH).compile().memory_analysis().temp_size_in_bytes
    print(f"temporaries: kernel {temps[True]:,} B, per projection {temps[False]:,} B, [S, H] {one_copy_buffer:,} B")
    assert temps[True] < one_copy_buffer < temps[False]
