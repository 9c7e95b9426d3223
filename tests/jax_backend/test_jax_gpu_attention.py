"""JAX attention on the GPU against the dense reference; each body also runs on the CPU (CI: proves its logic).

Invariants:
- ``blocked_document_attention`` (online softmax over tiles, custom VJP) equals the dense reference
  (``document_causal_mask`` + ``dot_product_attention``) within 1e-5 for the output and dq, dk, dv, on the GPU as
  on the CPU (float32, matmul precision "highest": no TF32), on packed rows with GQA, a window and a soft-cap.
- ``jax.nn.dot_product_attention(implementation="cudnn")`` (on the CPU: ``"xla"``, the same call) equals the
  dense reference where the segment ids allow a fused kernel: one document per row, starting at column 0,
  positions 0..n-1, padding after it, i.e. ``is_causal`` plus one length per row. bfloat16 inputs; the output
  within 2 bf16 ulps of the largest |v| (the probabilities are rounded to bf16 before P @ V: <= u max|v| = 1 ulp,
  the output once more: <= 0.5 ulp), the gradients within the bf16 ``grad_rel`` row. Packed rows are refused
  by ``fused_expressible`` (cuDNN takes no segment ids), which is why the model does not use it.

The GPU cases are marked ``gpu`` and skip unless JAX itself sees a GPU: the root conftest.py pins
``JAX_PLATFORMS=cpu`` unless it is set, so ``benchmarks/gpu/run_all.sh`` sets ``JAX_PLATFORMS=""``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from _packed_rows import packed_ids  # noqa: E402
from parity_tests.tolerances import bf16_ulp, tol  # noqa: E402
from twinseq.jax_backend.attention import (blocked_document_attention, document_causal_mask,  # noqa: E402
                                           dot_product_attention)

TOL = 1e-5
PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def _device(platform: str):
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if not devices:
        pytest.skip(f"JAX sees no {platform} (jax.default_backend()={jax.default_backend()!r}; run with "
                    f"JAX_PLATFORMS='' and jax's CUDA plugin, as benchmarks/gpu/run_all.sh does)")
    return devices[0]


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield



def _vjp_run(attend, q, k, v, dout):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(dout))


@pytest.mark.parametrize("options", [{}, {"sliding_window": 7, "softcap": 1.5}], ids=["gqa", "window_softcap"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_blocked_attention_equals_dense_on_device(platform, options):
    device = _device(platform)
    b, t, n, kv, d, block = 2, 200, 4, 2, 32, 64  # 200 = 3 blocks + 8: a padded tail block
    rng = np.random.default_rng(0)
    seg, pos = (jax.device_put(x, device) for x in packed_ids([[20, 100, 9, 50], [141]], t))
    q, dout = (jax.device_put(rng.standard_normal((b, n, t, d)).astype(np.float32), device) for _ in range(2))
    k, v = (jax.device_put(rng.standard_normal((b, kv, t, d)).astype(np.float32), device) for _ in range(2))
    scale = d ** -0.5

    def dense(q, k, v):
        mask = document_causal_mask(seg, pos, options.get("sliding_window"))
        return dot_product_attention(q, k, v, mask, scale, softcap=options.get("softcap"))

    def blocked(q, k, v):
        return blocked_document_attention(q, k, v, seg, pos, scale, block_size=block, **options)

    want = jax.jit(lambda *a: _vjp_run(dense, *a))(q, k, v, dout)
    got = jax.jit(lambda *a: _vjp_run(blocked, *a))(q, k, v, dout)
    assert {x.devices().pop().platform for x in got} == {device.platform}
    for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
        err = float(jnp.max(jnp.abs(w - g)))
        print(f"jax blocked on {platform} {options}: {name} {err:.2e}")
        assert err <= TOL, f"{name} differs by {err:.2e}"


def fused_expressible(segment_ids_BT: np.ndarray, position_ids_BT: np.ndarray) -> np.ndarray | None:
    """Per-row document lengths when every row holds at most one document, starting at column 0 with
    positions 0..n-1 and padding (segment 0) after it: what ``is_causal`` plus ``query_seq_lengths`` can
    express. None for packed rows (a fused kernel without segment ids would attend across documents)."""
    lengths = (segment_ids_BT != 0).sum(axis=1)
    cols = np.arange(segment_ids_BT.shape[1])[None, :]
    inside = cols < lengths[:, None]
    if not (np.all(segment_ids_BT[inside] == 1) and np.all(segment_ids_BT[~inside] == 0)
            and np.all(np.where(inside, position_ids_BT == cols, True))):
        return None
    return lengths.astype(np.int32)


def test_fused_expressible_refuses_packed_rows():
    assert fused_expressible(*packed_ids([[5], [3]], 6)).tolist() == [5, 3]
    assert fused_expressible(*packed_ids([[2, 3]], 6)) is None  # two documents in a row
    seg, pos = packed_ids([[4]], 6)
    assert fused_expressible(seg, pos + 1) is None  # positions not from 0


@pytest.mark.parametrize("platform, implementation", [("cpu", "xla"),
                                                      pytest.param("gpu", "cudnn", marks=pytest.mark.gpu)])
def test_fused_dot_product_attention_equals_the_reference(platform, implementation):
    device = _device(platform)
    b, t, n, kv, d = 3, 128, 4, 2, 64  # cuDNN: bf16, head_dim a multiple of 8
    seg_np, pos_np = packed_ids([[128], [77], [5]], t)
    lengths = fused_expressible(seg_np, pos_np)
    assert lengths is not None
    rng = np.random.default_rng(0)
    q, dout = (jax.device_put(rng.standard_normal((b, n, t, d)).astype(jnp.bfloat16), device) for _ in range(2))
    k, v = (jax.device_put(rng.standard_normal((b, kv, t, d)).astype(jnp.bfloat16), device) for _ in range(2))
    seg, pos, lengths = (jax.device_put(x, device) for x in (seg_np, pos_np, lengths))
    scale = d ** -0.5
    valid = (seg_np != 0)[:, None, :, None]  # padding queries: the reference gives zeros, cuDNN its own

    def reference(q, k, v):  # float32 on the same bf16 inputs
        mask = document_causal_mask(seg, pos)
        out = dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask,
                                    scale)
        return jnp.where(valid, out, 0.0)

    def fused(q, k, v):  # jax.nn takes [B, T, N, D]
        out = jax.nn.dot_product_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), scale=scale,
                                           is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                           implementation=implementation).transpose(0, 2, 1, 3)
        return jnp.where(valid, out.astype(jnp.float32), 0.0)

    want = jax.jit(lambda *a: _vjp_run(reference, *a))(q, k, v, dout.astype(jnp.float32))
    got = jax.jit(lambda *a: _vjp_run(fused, *a))(q, k, v, dout.astype(jnp.float32))
    ulp = bf16_ulp(float(jnp.max(jnp.abs(v.astype(jnp.float32)))))
    out_err = float(jnp.max(jnp.abs(got[0] - want[0])))
    grads = {name: float(jnp.linalg.norm((g.astype(jnp.float32) - w.astype(jnp.float32)).ravel())
                         / jnp.linalg.norm(w.astype(jnp.float32).ravel()))
             for name, w, g in zip(("dq", "dk", "dv"), want[1:], got[1:])}
    print(f"jax {implementation} on {platform}: out {out_err:.2e} ({out_err / ulp:.2f} bf16 ulps at max|v|); "
          f"grads rel {grads}")
    assert out_err <= 2 * ulp
    assert max(grads.values()) <= tol("bfloat16", "grad_rel"), grads
    # the same kernel on packed rows would leak: the reference on one packed row differs from causal attention
    packed_seg, packed_pos = (jnp.asarray(x) for x in packed_ids([[60, 68]], t))
    assert fused_expressible(np.asarray(packed_seg), np.asarray(packed_pos)) is None
    causal = jax.nn.dot_product_attention(*(x[:1].astype(jnp.float32).transpose(0, 2, 1, 3) for x in (q, k, v)),
                                          scale=scale, is_causal=True, implementation="xla").transpose(0, 2, 1, 3)
    packed = dot_product_attention(*(x[:1].astype(jnp.float32) for x in (q, k, v)),
                                   document_causal_mask(packed_seg, packed_pos), scale)
    assert float(jnp.max(jnp.abs(causal - packed))) > 100 * ulp
