"""Expert parallelism (``jax_backend.expert_parallel``) on a 4-device submesh of the 8 host devices, the tiny MoE
presets.

Invariants (float32, matmuls at "highest" precision):
- with the experts sharded over 4 devices (their tensors placed ``P("expert")``) and the tokens exchanged with
  ``all_to_all`` in ``shard_map``, the model's loss equals the unsharded model's within 1e-5 relative and every
  gradient within 1e-5 relative, on packed documents whose token count is not a multiple of 4 (padded tokens);
- one MoE block: outputs and expert gradients equal ``SparseMoeBlock``'s (1e-5 relative), and every token copy
  reaches its expert: the copies each expert computed equal the router's top-k histogram (no capacity drop);
- negative control: the same exchange with a capacity of ``tokens * top_k / 4`` copies per peer (capacity factor 1,
  the usual dropping rule) drops copies, and both the histogram check and the output check see it.
- what expert parallelism cannot shard is refused, naming the field, the value and the fix.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.jax_backend import build_model, loss_and_grads  # noqa: E402
from twinseq.jax_backend import expert_parallel as ep  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multi_device, pytest.mark.usefixtures("highest_precision")]

VOCAB = 256
EP = 4
REL = 1e-5
PRESETS = ("tiny-qwen3-moe", "tiny-mixtral")
DOC_LENGTHS = (13, 7, 11, 11)  # 42 tokens: not a multiple of EP


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {k: v + (rng.standard_normal(v.shape) * 0.05).astype(np.float32) for k, v in init_weights(cfg, 0).items()}


def _batch():
    rng = np.random.default_rng(0)
    return collate([{"input_ids": rng.integers(3, VOCAB, n).tolist()} for n in DOC_LENGTHS], padding_free=True)


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < EP:
        pytest.skip(f"needs {EP} devices (the root conftest sets 8 host devices)")
    return ep.expert_mesh(EP)


@pytest.mark.parametrize("preset", PRESETS)
def test_expert_parallel_model_equals_the_unsharded_model(mesh, preset):
    cfg = ModelConfig.preset(preset, vocab_size=VOCAB)
    ref_loss, ref_grads = loss_and_grads(build_model(cfg, _weights(cfg)), _batch())
    model = build_model(cfg, _weights(cfg))
    assert ep.shard_experts(model, mesh) == cfg.num_hidden_layers
    experts = model.model.layers[0].mlp.experts["gate_up_proj"][...]
    assert experts.sharding.spec == jax.sharding.PartitionSpec(ep.EXPERT_AXIS)  # sharded, not replicated
    loss, grads = loss_and_grads(model, _batch())
    worst = max(_rel(grads[k], ref_grads[k]) for k in ref_grads)
    print(f"{preset} ep={EP}: loss rel {abs(loss - ref_loss) / ref_loss:.2e}, worst grad rel {worst:.2e}")
    assert abs(loss - ref_loss) <= REL * ref_loss
    assert grads.keys() == ref_grads.keys() and worst <= REL


def _block_outputs(block, x_BTH, dy_BTH) -> tuple[jax.Array, ...]:
    """(y_BTH, gradient of <y, dy> by gate_up_proj, by down_proj) of one MoE block, jitted afresh (a new closure:
    no cached trace survives a monkeypatch)."""
    graphdef, state = nnx.split(block)

    def run(state, x_BTH, dy_BTH):
        y_BTH, vjp = jax.vjp(lambda s: nnx.merge(graphdef, s)(x_BTH), state)
        (grads,) = vjp(dy_BTH)
        return y_BTH, grads["experts"]["gate_up_proj"][...], grads["experts"]["down_proj"][...]

    return jax.jit(run)(state, x_BTH, dy_BTH)


def _received_counts(block, x_BTH) -> np.ndarray:
    graphdef, state = nnx.split(block)
    return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s).received_counts(x))(state, x_BTH))


def _capacity_one(original):
    """Control: ``_dispatch_slots`` keeping only the first ``C / world`` copies for each peer."""

    def capped(owner_C, world):
        slot_C, c = original(owner_C, world), owner_C.shape[0]
        return jnp.where(slot_C % c < c // world, slot_C, world * c)

    return capped


def test_block_keeps_every_copy_and_a_capacity_drop_is_seen(mesh, monkeypatch):
    cfg = ModelConfig.preset("tiny-qwen3-moe", vocab_size=VOCAB)
    model = build_model(cfg, _weights(cfg))
    rng = np.random.default_rng(2)
    x_BTH, dy_BTH = (jnp.asarray(rng.standard_normal((1, 42, cfg.hidden_size)), jnp.float32) for _ in range(2))
    dense = model.model.layers[0].mlp
    want = _block_outputs(dense, x_BTH, dy_BTH)
    routed_E = np.bincount(np.asarray(dense.route(x_BTH[0])[2]).reshape(-1), minlength=cfg.num_experts)
    ep.shard_experts(model, mesh)
    block = model.model.layers[0].mlp
    got = _block_outputs(block, x_BTH, dy_BTH)
    assert max(_rel(g, w) for g, w in zip(got, want)) <= REL
    np.testing.assert_array_equal(_received_counts(block, x_BTH), routed_E)
    assert routed_E.sum() == 42 * cfg.num_experts_per_tok
    monkeypatch.setattr(ep, "_dispatch_slots", _capacity_one(ep._dispatch_slots))
    dropped = _received_counts(block, x_BTH)
    capped_rel = _rel(_block_outputs(block, x_BTH, dy_BTH)[0], want[0])
    print(
        f"capacity-1 control: {routed_E.sum() - dropped.sum()} of {routed_E.sum()} copies dropped, "
        f"y rel {capped_rel:.2e}"
    )
    assert dropped.sum() < routed_E.sum()  # the routing is uneven enough to overflow a capacity of C / 4
    assert capped_rel > 100 * REL


def test_what_cannot_be_sharded_is_refused(mesh):
    with pytest.raises(ConfigError, match="num_experts=6 .*expert_parallel_size=4"):
        ep.check_expert_parallel(6, 4, [object()])
    with pytest.raises(ConfigError, match="no MoE layer"):
        ep.shard_experts(build_model(ModelConfig.preset("tiny", vocab_size=VOCAB)), mesh)
    with pytest.raises(ConfigError, match="expert_parallel_size=9 exceeds"):
        ep.expert_mesh(9)
    nf4 = build_model(ModelConfig.preset("tiny-qwen3-moe", vocab_size=VOCAB))
    blocks = [layer.mlp for layer in nf4.model.layers if hasattr(layer.mlp, "quantize_experts_nf4")]
    assert blocks and all(block.quantize_experts_nf4() for block in blocks)
    with pytest.raises(ConfigError, match="does not yet shard NF4 experts.*drop --load-in-4bit"):
        ep.shard_experts(nf4, mesh)
