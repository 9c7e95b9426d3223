"""QLoRA's NF4 base for the experts of MoE layers, jax backend (``load_in_4bit``, with and without LoRA on the experts):
the fused expert tensors stored as NF4 codes + one float32 absmax per 64 numbers (``common.models.nf4``), dequantised
one expert per scan step inside ``moe.grouped_experts``, LoRA factors trained through it, saved under PEFT's keys.

Every equality is checked against a reference that does not use the code under test (a float model built from the
dequantised numbers, NF4 by its definition, an explicit loop over ``W + scaling * B @ A`` under autodiff, the float
expert-LoRA path of ``SparseMoeBlock``), and each has a control showing that the compared quantity is not trivially
equal. torch vs jax: parity_tests/test_qlora_experts_parity.py.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("qwix")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from parity_tests.tolerances import tol  # noqa: E402
from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.models.nf4 import NF4_CODE  # noqa: E402
from twinseq.common.models.peft import NF4_BLOCKSIZE, PeftConfig, init_adapters  # noqa: E402
from twinseq.common.run.memory_plan import plan_memory  # noqa: E402
from twinseq.jax_backend import build_model, logits, loss_and_grads, moe  # noqa: E402
from twinseq.jax_backend import peft as jpeft  # noqa: E402
from twinseq.jax_backend.model import NF4ExpertAbsmax, NF4ExpertCodes, SparseMoeBlock, base_weights  # noqa: E402

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
LOGITS_ABS = tol("float32", "logits_abs")
GRAD_REL = tol("float32", "grad_rel")


def _peft(**kw) -> PeftConfig:
    base = {"lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "lora_target_modules": ["q_proj"]}
    return PeftConfig(use_peft=True, **{**base, "load_in_4bit": True, **kw})


def _batch(cfg: ModelConfig, n: int = 23):
    rng = np.random.default_rng(0)
    return collate([{"input_ids": rng.integers(3, cfg.vocab_size, n).tolist()}])


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _blocks(model) -> list[SparseMoeBlock]:
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoeBlock)]


def _nf4_reference(w: np.ndarray) -> np.ndarray:
    """NF4 by its definition: per block of 64 numbers, ``code[nearest(w / absmax)] * absmax`` (float64)."""
    blocks = np.asarray(w, np.float64).reshape(-1, NF4_BLOCKSIZE)
    absmax = np.abs(blocks).max(1, keepdims=True)
    nearest = np.abs(blocks[..., None] / absmax[..., None] - NF4_CODE.astype(np.float64)).argmin(-1)
    return (NF4_CODE[nearest] * absmax).reshape(w.shape)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_nf4_experts_are_a_float_model_of_their_dequantised_values(preset, caplog):
    """The NF4 model's logits equal those of a float model built from its dequantised weights (1e-5); the dequantised
    expert numbers are NF4 by definition (blocks of 64 of the flattened tensor); the float original differs
    (control: NF4 really applied), and every expert tensor was quantised (the log says how many)."""
    cfg = ModelConfig.preset(preset)
    weights = init_weights(cfg, seed=0)
    batch = _batch(cfg)
    with caplog.at_level(logging.INFO, logger="twinseq.jax_backend.peft"):
        model = jpeft.add_adapters(build_model(cfg, weights), cfg, _peft())
    assert f"{2 * cfg.num_hidden_layers} expert tensors quantised to NF4" in caplog.text
    got = logits(model, batch)
    dequantised = base_weights(model)
    assert _max_diff(logits(build_model(cfg, dequantised), batch), got) <= LOGITS_ABS
    assert _max_diff(logits(build_model(cfg, weights), batch), got) > 1e-2  # negative control: NF4 applied
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        np.testing.assert_allclose(dequantised[name], _nf4_reference(weights[name]), rtol=1e-6, atol=1e-7)
        assert _max_diff(dequantised[name], weights[name]) > 1e-3
    if cfg.expert_biases:  # gpt_oss's biases stay float, exactly
        bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
        np.testing.assert_array_equal(dequantised[bias], weights[bias])


def test_one_expert_dequantises_alone_and_the_storage_is_half_a_byte_per_number():
    """Expert ``e`` dequantised by the kernel's ``NF4Experts.expert`` equals the whole tensor's slice, bitwise; the
    storage is 0.5 byte per number plus one float32 absmax per 64 (0.5625 B/number), exactly, and no float copy of an
    expert tensor is left among the parameters."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    model = jpeft.add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft())
    float_bytes = 0
    for block in _blocks(model):
        whole = block.dequantized_experts()
        for name, shape in block.nf4_shapes:
            nf4 = block._stored(name)
            assert isinstance(nf4, moe.NF4Experts) and nf4.lora_A is None
            assert nf4.codes_EC.dtype == jnp.uint8 and nf4.absmax_EK.dtype == jnp.float32
            numbers = cfg.num_experts * shape[0] * shape[1]
            assert nf4.codes_EC.size == numbers // 2 and nf4.absmax_EK.size == numbers // NF4_BLOCKSIZE
            float_bytes += 4 * numbers
            np.testing.assert_array_equal(np.asarray(nf4.expert(jnp.int32(2))), whole[name][2])
            assert not np.array_equal(whole[name][2], whole[name][1])  # control: the experts differ
    nf4_bytes = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(model, NF4ExpertCodes)))
    nf4_bytes += sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(model, NF4ExpertAbsmax)))
    assert nf4_bytes == float_bytes * (0.5 + 4 / NF4_BLOCKSIZE) / 4
    float_experts = [p for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if v.get_value().ndim == 3]
    assert not float_experts, float_experts


def _routing(num_tokens: int, num_experts: int, seed: int = 0):
    """(top_k_index_TK, top_k_weights_TK): two distinct experts per token among 0, 1 and 3 (expert 2 gets none)."""
    rng = np.random.default_rng(seed)
    index = np.stack([rng.permutation(3)[:2] for _ in range(num_tokens)])
    index[index == 2] = 3
    assert num_experts == 4
    return jnp.asarray(index, jnp.int32), jnp.asarray(rng.uniform(size=(num_tokens, 2)), jnp.float32)


def _kernel(x_TH, weights_TK, index_TK, gate_up, down, block_rows):
    """``moe.grouped_experts`` over the copies sorted by expert, as ``SparseMoeBlock`` sorts them (Qwen3 layout)."""
    k = index_TK.shape[1]
    order = jnp.argsort(index_TK.reshape(-1), stable=True)
    sizes = jnp.bincount(index_TK.reshape(-1), length=gate_up.shape[0]).astype(jnp.int32)
    layout = moe.Layout(True, moe.GluGate(jax.nn.silu), "float32")
    weight_S = weights_TK.reshape(-1)[order]
    return moe.grouped_experts(x_TH, weight_S, order // k, sizes, gate_up, down, None, None, layout, block_rows)


def _explicit(x_TH, weights_TK, index_TK, w_gate_up, w_down):
    """The naive loop of ``moe``'s docstring over every expert and token, dense: ``sum_j w[t, j] * MLP_e(x[t])``."""
    gate_up_ETF = jnp.einsum("th,efh->etf", x_TH, w_gate_up)
    gate, up = jnp.split(gate_up_ETF, 2, axis=-1)
    out_ETH = jnp.einsum("eti,ehi->eth", jax.nn.silu(gate) * up, w_down)
    picked_TKH = out_ETH[index_TK, jnp.arange(x_TH.shape[0])[:, None]]
    return jnp.sum(picked_TKH * weights_TK[..., None], axis=1)


def test_lora_on_nf4_experts_gradients_equal_autodiff_through_the_explicit_reference():
    """The kernel over NF4 experts with LoRA (blocks of 4 rows: several per expert) and its gradients of x, the
    routing weights and each tensor's A and B equal autodiff through an explicit dense loop over ``dequantised W +
    scaling * B_e @ A_e`` (grad_rel 1e-5); expert 2, which no token reaches, gets exactly zero A and B gradients."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    peft = _peft(lora_target_parameters=list(EXPERTS))
    adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    model = jpeft.add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, peft, adapters)
    block = _blocks(model)[0]
    nf4 = {name: block._stored(name) for name in ("gate_up_proj", "down_proj")}
    base = block.dequantized_experts()
    num_tokens = 40
    index_TK, weights_TK = _routing(num_tokens, cfg.num_experts)
    x_TH = jax.random.normal(jax.random.key(0), (num_tokens, cfg.hidden_size), jnp.float32)
    dy_TH = jax.random.normal(jax.random.key(1), (num_tokens, cfg.hidden_size), jnp.float32)
    factors = {n: (t.lora_A, t.lora_B) for n, t in nf4.items()}

    def with_factors(name, fs):
        return dataclasses.replace(nf4[name], lora_A=fs[0], lora_B=fs[1])

    def kernel(x, w, fs):
        y = _kernel(x, w, index_TK, with_factors("gate_up_proj", fs["gate_up_proj"]),
                    with_factors("down_proj", fs["down_proj"]), block_rows=4)  # fmt: skip
        return jnp.sum(y * dy_TH), y

    def explicit(x, w, fs):
        dense = {}
        for name, (a, b) in fs.items():
            a_ERI = a.reshape(cfg.num_experts, -1, a.shape[-1])
            b_EOR = jnp.transpose(b.reshape(b.shape[0], -1, cfg.num_experts), (2, 0, 1))
            dense[name] = jnp.asarray(base[name]) + peft.scaling * jnp.einsum("eor,eri->eoi", b_EOR, a_ERI)
        y = _explicit(x, w, index_TK, dense["gate_up_proj"], dense["down_proj"])
        return jnp.sum(y * dy_TH), y

    with jax.default_matmul_precision("highest"):
        (_, got_y), got = jax.value_and_grad(kernel, argnums=(0, 1, 2), has_aux=True)(x_TH, weights_TK, factors)
        (_, want_y), want = jax.value_and_grad(explicit, argnums=(0, 1, 2), has_aux=True)(x_TH, weights_TK, factors)
    assert _rel(got_y, want_y) <= GRAD_REL
    pairs = {"x": (got[0], want[0]), "weights": (got[1], want[1])}
    for name in factors:
        for i, part in enumerate("AB"):
            pairs[f"{name}.{part}"] = (got[2][name][i], want[2][name][i])
    for key, (g, w) in pairs.items():
        assert _rel(g, w) <= GRAD_REL, (key, _rel(g, w))
        assert float(jnp.abs(w).max()) > 0, key  # control: a gradient flows to every compared tensor
    for name in factors:  # expert 2, reached by no token, gets no update
        da_ERI = np.asarray(got[2][name][0]).reshape(cfg.num_experts, peft.lora_r, -1)
        db_ORE = np.asarray(got[2][name][1]).reshape(-1, peft.lora_r, cfg.num_experts)
        assert not da_ERI[2].any() and not db_ORE[..., 2].any() and da_ERI[3].any()


@pytest.mark.slow
def test_lora_on_nf4_experts_equals_float_expert_lora_on_the_dequantised_base():
    """The whole NF4 model with LoRA on its experts gives the loss and every adapter gradient (PEFT's keys) of a float
    model of its dequantised weights with the same adapters, run by the float expert-LoRA path (per-projection grouped
    matmuls): loss_rel 1e-6, grad_rel 1e-5; the float original's differ (control)."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    weights = init_weights(cfg, seed=0)
    batch = _batch(cfg)
    peft = _peft(lora_target_parameters=list(EXPERTS))
    adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    model = jpeft.add_adapters(build_model(cfg, weights), cfg, peft, adapters)
    assert sorted(jpeft.export_adapters(model)) == sorted(adapters)  # PEFT's keys, as without NF4
    loss, grads = loss_and_grads(model, batch)
    float_peft = dataclasses.replace(peft, load_in_4bit=False)
    ref = jpeft.add_adapters(build_model(cfg, base_weights(model)), cfg, float_peft, adapters)
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    assert abs(loss - ref_loss) <= tol("float32", "loss_rel") * abs(ref_loss)
    assert set(grads) == set(ref_grads) == set(adapters)
    for key, value in ref_grads.items():
        assert _rel(grads[key], value) <= GRAD_REL, key
        assert np.abs(value).max() > 0, key
    original_loss, _ = loss_and_grads(jpeft.add_adapters(build_model(cfg, weights), cfg, float_peft, adapters), batch)
    assert abs(original_loss - loss) > 1e-4 * abs(loss)  # control: the NF4 base is what both compute


def test_zero_lora_b_on_nf4_experts_starts_at_the_base():
    """Zero-initialised lora_B (PEFT's start): the logits equal the NF4 base's without expert LoRA, bitwise, and
    ``adapters_disabled`` gives the base back; non-zero B changes them (control), ``merge_adapters`` folds them into a
    float model of the same logits, and every expert factor gets a gradient."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    weights = init_weights(cfg, seed=0)
    batch = _batch(cfg)
    peft = _peft(lora_target_parameters=list(EXPERTS))
    base = logits(jpeft.add_adapters(build_model(cfg, weights), cfg, _peft()), batch)
    fresh = jpeft.add_adapters(build_model(cfg, weights), cfg, peft)
    np.testing.assert_array_equal(logits(fresh, batch), base)
    moved_adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    moved = jpeft.add_adapters(build_model(cfg, weights), cfg, peft, moved_adapters)
    assert _max_diff(logits(moved, batch), base) > 1e-3
    with jpeft.adapters_disabled(moved):
        np.testing.assert_array_equal(logits(moved, batch), base)
    assert _max_diff(logits(moved, batch), base) > 1e-3  # enabled again after the block
    assert _max_diff(logits(jpeft.merge_adapters(moved), batch), logits(moved, batch)) <= LOGITS_ABS  # a float model
    _, grads = loss_and_grads(moved, batch)
    expert_grads = {k: g for k, g in grads.items() if ".experts." in k}
    assert len(expert_grads) == 8 and all(np.abs(g).max() > 0 for g in expert_grads.values())


def test_nf4_experts_whose_blocks_would_straddle_experts_are_refused():
    """An expert whose number of weights is not a multiple of 64 cannot dequantise alone: refused, naming the field,
    the tensor and the fix; the same model 32 wide (whole blocks) quantises (control)."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny-qwen3-moe"), hidden_size=20, moe_intermediate_size=4)
    match = r"load_in_4bit=True: model\.layers\.0\.mlp\.experts\.\w+_proj has \d+ numbers per expert.*--load-in-4bit"
    with pytest.raises(ConfigError, match=match):
        jpeft.add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft())
    control = dataclasses.replace(cfg, hidden_size=32)
    jpeft.add_adapters(build_model(control, init_weights(control, seed=0)), control, _peft())


def test_the_planner_counts_the_nf4_experts_as_the_jax_model_stores_them():
    """``plan_memory(backend="jax")``'s ``expert weights (NF4 + absmax)`` row is the jax model's codes + absmax bytes
    (the torch plan's row, the same storage); its workspace row holds one expert of each tensor (the scan step), less
    than torch's chunk; without load_in_4bit neither row exists (control)."""
    for preset in ("tiny-qwen3-moe", "tiny-gpt-oss"):
        cfg = ModelConfig.preset(preset)
        model = jpeft.add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft())
        stored = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(model, NF4ExpertCodes)))
        stored += sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(model, NF4ExpertAbsmax)))
        flat = dict(model_config=preset, use_peft=True, lora_target_modules=["q_proj"], lora_dropout=0.0)
        plan = plan_memory(TrainConfig.from_flat(**flat, load_in_4bit=True), backend="jax")
        torch_plan = plan_memory(TrainConfig.from_flat(**flat, load_in_4bit=True), backend="torch")
        assert plan.get("expert weights (NF4 + absmax)") == stored == torch_plan.get("expert weights (NF4 + absmax)")
        one_expert = sum(a * b for _, (a, b) in _blocks(model)[0].nf4_shapes)
        workspace = plan.get("NF4 experts workspace (transient)")
        assert 4 * one_expert <= workspace < torch_plan.get("NF4 experts workspace (transient)")
        plain = plan_memory(TrainConfig.from_flat(**flat), backend="jax")
        assert plain.get("expert weights (NF4 + absmax)") == plain.get("NF4 experts workspace (transient)") == 0


@pytest.mark.slow
def test_the_compiled_step_never_holds_a_layer_of_float_experts():
    """The compiled training step (``grads_jit``, from compilation alone) of the NF4 model with LoRA on its experts
    takes the experts as NF4 codes + absmax (arguments smaller by the float experts less their NF4 bytes and LoRA
    factors) and needs no more temporaries than the float model without expert LoRA plus two experts of each tensor,
    far below one layer's float experts (32 of them, 12.6 MB). Control: the float model's expert LoRA (per-projection
    grouped matmuls under autodiff) breaks that bound. Measured on XLA:CPU: 5,635,560 bytes (float, no expert LoRA),
    5,735,936 (NF4 + expert LoRA), 9,125,712 (float + expert LoRA)."""
    from twinseq.jax_backend.model import grads_jit, split_trainable

    cfg = dataclasses.replace(
        ModelConfig.preset("tiny-qwen3-moe"), num_experts=32, moe_intermediate_size=256, hidden_size=128
    )
    base = build_model(cfg, init_weights(cfg, seed=0))
    ids = jax.ShapeDtypeStruct((1, 64), np.int32)
    step = {}
    for qlora, targets in ((False, None), (True, EXPERTS), (False, EXPERTS)):
        peft = _peft(load_in_4bit=qlora, lora_target_parameters=targets)
        graphdef, params, frozen = split_trainable(jpeft.add_adapters(base, cfg, peft))
        compiled = grads_jit.lower(graphdef, params, (ids,) * 4, jax.ShapeDtypeStruct((), np.int32),
                                   loss_type="fused_linear", chunk_size=64, frozen=frozen).compile()  # fmt: skip
        memory = compiled.memory_analysis()
        step[qlora, targets is not None] = (memory.argument_size_in_bytes, memory.temp_size_in_bytes)
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size  # gate_up + down numbers of one expert
    layer_float = 4 * cfg.num_experts * per_expert
    lora = 4 * 4 * cfg.num_experts * (2 * cfg.hidden_size + 3 * cfg.moe_intermediate_size)  # A and B of both, r=4
    (arg_f, temp_f), (arg_q, temp_q) = step[False, False], step[True, True]
    assert arg_f - arg_q >= cfg.num_hidden_layers * (layer_float * (1 - 0.5625 / 4) - lora)
    bound = temp_f + 2 * 4 * per_expert
    assert temp_q <= bound < temp_f + layer_float, (temp_f, temp_q)
    assert step[False, True][1] > bound  # negative control: the measure sees more temporaries where there are

