"""``jax_backend.grouped.grouped_matmul``, the MoE experts' grouped matmul (block-sparse on CPU), against
``jax.lax.ragged_dot``.

Invariants (float32, matmuls at "highest" precision; bounds from parity_tests/tolerances.py, no new one):
- values equal ``ragged_dot``'s within ``logits_abs`` and the gradients of ``x`` and ``w`` within ``grad_rel`` (per
  tensor relative norm), on group sizes with an empty group, with every row in one group, and with rows past the
  group total (zeros there, zero gradient there); blocks smaller than the groups, so groups span several blocks;
  the same with output-major weights (``transposed=True``);
- swapping two experts' weights breaks the values and ``dx``, swapping their group sizes breaks ``dw`` (negative
  controls);
- the compiled forward + backward's temporaries stay below one ``[E, S, O]`` float32 buffer, which XLA:CPU's dense
  ``ragged_dot`` needs (its own compile is the negative control);
- bfloat16 inputs give ``ragged_dot``'s output and gradient dtypes.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from parity_tests.tolerances import TOLERANCES  # noqa: E402
from twinseq.jax_backend.grouped import grouped_matmul  # noqa: E402

pytestmark = pytest.mark.usefixtures("highest_precision")

F32 = TOLERANCES["float32"]
K, O = 12, 10
GROUP_SIZES = {
    "random_with_an_empty_group": [5, 0, 9, 3, 13],  # sums to S
    "every_row_in_one_group": [0, 0, 30, 0, 0],
    "rows_past_the_total": [4, 11, 0, 1, 2],  # 12 rows past the total
}
ROWS = 30


def _inputs(seed: int = 0, experts: int = 5) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    rng = np.random.default_rng(seed)
    x_SK = jnp.asarray(rng.standard_normal((ROWS, K)), jnp.float32)
    w_EKO = jnp.asarray(rng.standard_normal((experts, K, O)), jnp.float32)
    dy_SO = jnp.asarray(rng.standard_normal((ROWS, O)), jnp.float32)
    return x_SK, w_EKO, dy_SO


def _value_and_grads(fn, x_SK, w_EKO, group_sizes_E, dy_SO):
    """(y_SO, dx_SK, dw_EKO) of ``fn(x, w, group_sizes)``, the gradients of ``sum(y * dy)``, jitted."""

    def loss(x, w):
        y = fn(x, w, group_sizes_E)
        return jnp.sum(y * dy_SO), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x_SK, w_EKO)
    return y, dx, dw


def _grouped(block_rows: int):
    return lambda x, w, g: grouped_matmul(x, w, g, block_rows=block_rows)


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _errors(got, want) -> tuple[float, float, float]:
    return float(jnp.abs(got[0] - want[0]).max()), _rel(got[1], want[1]), _rel(got[2], want[2])


@pytest.mark.parametrize("case", sorted(GROUP_SIZES))
def test_values_and_gradients_equal_ragged_dot(case):
    x_SK, w_EKO, dy_SO = _inputs()
    group_sizes_E = jnp.asarray(GROUP_SIZES[case], jnp.int32)
    want = _value_and_grads(jax.lax.ragged_dot, x_SK, w_EKO, group_sizes_E, dy_SO)
    for block_rows in (4, 32):  # groups over several blocks; one block clipped to the 32 rows
        got = _value_and_grads(_grouped(block_rows), x_SK, w_EKO, group_sizes_E, dy_SO)
        value_err, dx_err, dw_err = _errors(got, want)
        assert value_err <= F32["logits_abs"], (case, block_rows, value_err)
        assert dx_err <= F32["grad_rel"] and dw_err <= F32["grad_rel"], (case, block_rows, dx_err, dw_err)
    # transposed=True: the same product from output-major weights [E, O, K], its dw output-major too
    transposed = lambda x, w, g: grouped_matmul(x, w, g, block_rows=4, transposed=True)  # noqa: E731
    y, dx, dw_EOK = _value_and_grads(transposed, x_SK, jnp.swapaxes(w_EKO, 1, 2), group_sizes_E, dy_SO)
    value_err, dx_err, dw_err = _errors((y, dx, jnp.swapaxes(dw_EOK, 1, 2)), want)
    assert value_err <= F32["logits_abs"] and dx_err <= F32["grad_rel"] and dw_err <= F32["grad_rel"], case
    total = int(group_sizes_E.sum())
    assert float(jnp.abs(got[0][total:]).max(initial=0.0)) == 0.0
    assert float(jnp.abs(got[1][total:]).max(initial=0.0)) == 0.0
    empty = [e for e, g in enumerate(GROUP_SIZES[case]) if g == 0]
    assert float(jnp.abs(got[2][jnp.asarray(empty, jnp.int32)]).max()) == 0.0


def test_swapping_two_experts_breaks_values_and_gradients():
    """Negative controls of the test above: experts 0 and 2's weights swapped -> the values and ``dx`` fail their
    bounds (``dw = x.T @ dy`` per group does not read ``w``); their group sizes swapped -> ``dw`` fails too."""
    x_SK, w_EKO, dy_SO = _inputs()
    sizes = GROUP_SIZES["random_with_an_empty_group"]
    group_sizes_E = jnp.asarray(sizes, jnp.int32)
    want = _value_and_grads(jax.lax.ragged_dot, x_SK, w_EKO, group_sizes_E, dy_SO)
    swapped = w_EKO[jnp.asarray([2, 1, 0, 3, 4])]
    value_err, dx_err, _ = _errors(_value_and_grads(_grouped(4), x_SK, swapped, group_sizes_E, dy_SO), want)
    assert value_err > F32["logits_abs"] and dx_err > F32["grad_rel"], (value_err, dx_err)
    swapped_sizes_E = jnp.asarray([sizes[2], sizes[1], sizes[0], *sizes[3:]], jnp.int32)
    value_err, _, dw_err = _errors(_value_and_grads(_grouped(4), x_SK, w_EKO, swapped_sizes_E, dy_SO), want)
    assert value_err > F32["logits_abs"] and dw_err > F32["grad_rel"], (value_err, dw_err)


def test_backward_temporaries_stay_below_one_dense_expert_buffer():
    """XLA:CPU's ``ragged_dot`` materialises ``[E, S, O]``-sized products; the block-sparse form's forward +
    backward temporaries stay below one such float32 buffer (no per-expert copy of anything)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the block-sparse form is CPU's; other platforms run ragged_dot")
    rows, experts, k, o = 512, 32, 64, 48
    rng = np.random.default_rng(0)
    x_SK = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    w_EKO = jnp.asarray(rng.standard_normal((experts, k, o)), jnp.float32)
    group_sizes_E = jnp.asarray(np.bincount(rng.integers(0, experts, rows), minlength=experts), jnp.int32)
    dense_expert_buffer = experts * rows * o * 4

    def temp_bytes(fn) -> int:
        step = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w, group_sizes_E) ** 2), argnums=(0, 1)))
        return int(step.lower(x_SK, w_EKO).compile().memory_analysis().temp_size_in_bytes)

    assert temp_bytes(grouped_matmul) < dense_expert_buffer
    assert temp_bytes(jax.lax.ragged_dot) >= dense_expert_buffer  # negative control


def test_bfloat16_dtypes_follow_ragged_dot():
    x_SK, w_EKO, dy_SO = (a.astype(jnp.bfloat16) for a in _inputs())
    group_sizes_E = jnp.asarray(GROUP_SIZES["rows_past_the_total"], jnp.int32)
    got = _value_and_grads(grouped_matmul, x_SK, w_EKO, group_sizes_E, dy_SO)
    want = _value_and_grads(jax.lax.ragged_dot, x_SK, w_EKO, group_sizes_E, dy_SO)
    assert [a.dtype for a in got] == [a.dtype for a in want] == [jnp.bfloat16] * 3
    w_EOK = jnp.swapaxes(w_EKO, 1, 2)  # output-major weights, as transformers stores them
    got_t = _value_and_grads(
        lambda x, w, g: grouped_matmul(x, w, g, transposed=True), x_SK, w_EOK, group_sizes_E, dy_SO
    )
    assert [a.dtype for a in got_t] == [jnp.bfloat16] * 3


def test_mismatched_shapes_name_the_arrays():
    x_SK, w_EKO, _ = _inputs()
    with pytest.raises(ValueError, match="group_sizes_E has shape"):
        grouped_matmul(x_SK, w_EKO, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"x_SK \(30, 5\) and w \(5, 12, 10\)"):
        grouped_matmul(x_SK[:, :5], w_EKO, jnp.zeros(5, jnp.int32))
