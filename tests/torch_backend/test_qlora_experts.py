"""QLoRA's NF4 base for the experts of MoE layers, torch backend (``load_in_4bit``, with and without LoRA on the
experts): the fused expert tensors stored as NF4 codes + one float32 absmax per 64 numbers, dequantised a chunk of
experts at a time inside twinseq's grouped kernel, LoRA factors trained through it, saved as PEFT's folder.

Every equality is checked against a reference that does not use the code under test (a float model built from the
dequantised numbers, an explicit eager loop over ``W + scaling * B @ A``, PEFT's own ``ParamWrapper``), and each
has a control showing that the compared quantity is not trivially equal.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from parity_tests.tolerances import tol  # noqa: E402
from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.hf_folder import write_hf_checkpoint  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.models.peft import NF4_BLOCKSIZE, PeftConfig, init_adapters, save_adapters  # noqa: E402
from twinseq.torch_backend.model import base_weights, build_model, logits, loss_and_grads  # noqa: E402
from twinseq.torch_backend.moe import NF4ExpertLoRA, dequantize_experts, experts_modules, route  # noqa: E402
from twinseq.torch_backend.peft import adapters_disabled, add_adapters, export_adapters, merge_adapters  # noqa: E402
from twinseq.torch_backend.unwrap import causal_lm_of  # noqa: E402

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
LOGITS_ABS = tol("float32", "logits_abs")
GRAD_REL = tol("float32", "grad_rel")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the machine is shared, and the summation order then does not depend on it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _peft(**kw) -> PeftConfig:
    base = {
        "lora_r": 4,
        "lora_alpha": 8.0,
        "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj"],
        "load_in_4bit": True,
    }
    return PeftConfig(use_peft=True, **{**base, **kw})


def _batch(cfg: ModelConfig, n: int = 23):
    rng = np.random.default_rng(0)
    return collate([{"input_ids": rng.integers(3, cfg.vocab_size, n).tolist()}])


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _nf4_reference(w: np.ndarray, code: np.ndarray) -> np.ndarray:
    """NF4 by its definition: per block of 64 numbers, ``code[nearest(w / absmax)] * absmax`` (float64)."""
    blocks = np.asarray(w, np.float64).reshape(-1, NF4_BLOCKSIZE)
    absmax = np.abs(blocks).max(1, keepdims=True)
    nearest = np.abs(blocks[..., None] / absmax[..., None] - code).argmin(-1)
    return (code[nearest] * absmax).reshape(w.shape)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_nf4_experts_are_a_float_model_of_their_dequantised_values(preset, caplog):
    """The NF4 model's logits equal those of a float model built from its dequantised weights (1e-5); the dequantised
    expert numbers are NF4 by definition (blocks of 64 of the flattened tensor); the float original differs
    (control: NF4 really applied), and every expert tensor was quantised (the log says how many)."""
    cfg = ModelConfig.preset(preset)
    weights = init_weights(cfg, seed=0)
    batch = _batch(cfg)
    with caplog.at_level(logging.INFO, logger="twinseq.torch_backend.peft"):
        model = add_adapters(build_model(cfg, weights), cfg, _peft())
    assert f"and {2 * cfg.num_hidden_layers} expert tensors quantised to NF4" in caplog.text
    got = logits(model, batch)
    dequantised = base_weights(model)
    assert _max_diff(logits(build_model(cfg, dequantised), batch), got) <= LOGITS_ABS
    assert _max_diff(logits(build_model(cfg, weights), batch), got) > 1e-2  # negative control: NF4 applied
    experts = experts_modules(causal_lm_of(model))
    assert len(experts) == cfg.num_hidden_layers
    code = experts[0].gate_up_proj.quant_state.code.double().numpy()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        np.testing.assert_allclose(dequantised[name], _nf4_reference(weights[name], code), rtol=1e-6, atol=1e-7)
        assert _max_diff(dequantised[name], weights[name]) > 1e-3
    if cfg.expert_biases:  # gpt_oss's biases stay float, exactly
        bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
        np.testing.assert_array_equal(dequantised[bias], weights[bias])


def test_one_expert_dequantises_alone_and_the_storage_is_half_a_byte_per_number():
    """Experts ``e0:e1`` dequantise to the same numbers as the whole tensor's slice; the storage is 0.5 byte per
    number plus one float32 absmax per 64 (0.5625 B/number, 14% of float32), exactly."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    model = add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft())
    float_bytes = nf4_bytes = 0
    for experts in experts_modules(causal_lm_of(model)):
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            shape = tuple(weight.quant_state.shape)
            numbers = int(np.prod(shape))
            assert weight.dtype == torch.uint8 and weight.numel() == numbers // 2 and not weight.requires_grad
            assert weight.quant_state.absmax.dtype == torch.float32
            assert weight.quant_state.absmax.numel() == numbers // NF4_BLOCKSIZE
            nf4_bytes += weight.numel() * weight.element_size() + weight.quant_state.absmax.nbytes
            float_bytes += 4 * numbers
            whole = dequantize_experts(weight, 0, shape[0])
            torch.testing.assert_close(dequantize_experts(weight, 2, 3), whole[2:3], rtol=0, atol=0)
            assert not torch.equal(whole[2], whole[1])  # control: the slices differ
    assert nf4_bytes == float_bytes * (0.5 + 4 / NF4_BLOCKSIZE) / 4
    float_params = {n for n, p in model.named_parameters() if p.dtype == torch.float32 and p.dim() == 3}
    assert not float_params, float_params  # no float copy of an expert tensor left behind


def _eager_reference(experts, x_TH, top_k_index, top_k_weights, lora):
    """The module docstring's naive loop of torch_backend.moe over ``W_e + scaling * B_e @ A_e`` (Qwen3-MoE
    layout), with autograd through every input; ``lora``: {name: (A, B, scaling)} in PEFT's layout."""
    y = torch.zeros_like(x_TH)
    w = {}
    for name in ("gate_up_proj", "down_proj"):
        base = dequantize_experts(getattr(experts, name), 0, experts.num_experts)
        a, b, scaling = lora[name]
        a_ERI = a.reshape(experts.num_experts, -1, a.shape[-1])
        b_EOR = b.reshape(b.shape[0], -1, experts.num_experts).permute(2, 0, 1)
        w[name] = base + scaling * torch.einsum("eor,eri->eoi", b_EOR, a_ERI)
    for e in range(experts.num_experts):
        t, j = torch.where(top_k_index == e)
        gate, up = (x_TH[t] @ w["gate_up_proj"][e].T).chunk(2, -1)
        y = y.index_add(0, t, (experts.act_fn(gate) * up) @ w["down_proj"][e].T * top_k_weights[t, j, None])
    return y


def test_lora_on_nf4_experts_gradients_equal_autograd_through_the_float_reference():
    """The kernel's output and its gradients of x, the routing weights and each expert's A and B equal autograd
    through an explicit eager loop over ``dequantised W + scaling * B @ A`` (grad_rel 1e-5), in chunks of whole
    experts with one expert that no token reaches (its A and B get exactly zero)."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    peft = _peft(lora_target_parameters=list(EXPERTS))
    adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    model = add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, peft, adapters)
    outer = causal_lm_of(model).model.layers[0].mlp.experts
    assert isinstance(outer, NF4ExpertLoRA) and isinstance(outer.base_layer, NF4ExpertLoRA)
    experts = outer.base_layer.base_layer
    generator = torch.Generator().manual_seed(0)
    num_tokens = 40
    x_TH = torch.randn(num_tokens, cfg.hidden_size, generator=generator).requires_grad_(True)
    top_k_index = torch.stack([torch.randperm(3, generator=generator)[:2] for _ in range(num_tokens)])
    top_k_index[top_k_index == 2] = 3  # experts 0, 1 and 3: expert 2 gets no token
    top_k_weights = torch.rand(num_tokens, 2, generator=generator).requires_grad_(True)
    assert len(route(top_k_index, cfg.num_experts).chunks) > 1  # several chunks are walked
    dy_TH = torch.randn(num_tokens, cfg.hidden_size, generator=generator)

    wrappers = {"gate_up_proj": outer.base_layer, "down_proj": outer}
    y = outer(x_TH, top_k_index, top_k_weights)
    got = dict(zip(["x", "weights"], torch.autograd.grad(y, [x_TH, top_k_weights], dy_TH, retain_graph=True)))
    (y * dy_TH).sum().backward()
    for name, wrapper in wrappers.items():
        got[name + ".A"] = wrapper.lora_A["default"].weight.grad.clone()
        got[name + ".B"] = wrapper.lora_B["default"].weight.grad.clone()

    lora = {
        n: (
            w.lora_A["default"].weight.detach().clone().requires_grad_(True),
            w.lora_B["default"].weight.detach().clone().requires_grad_(True),
            w.scaling,
        )
        for n, w in wrappers.items()
    }
    want_y = _eager_reference(experts, x_TH, top_k_index, top_k_weights, lora)
    leaves = [x_TH, top_k_weights] + [t for n in wrappers for t in lora[n][:2]]
    grads = torch.autograd.grad(want_y, leaves, dy_TH)
    want = dict(zip(["x", "weights"] + [f"{n}.{p}" for n in wrappers for p in "AB"], grads))
    assert _rel(y.detach(), want_y.detach()) <= GRAD_REL
    for key, value in want.items():
        assert _rel(got[key], value) <= GRAD_REL, key
        assert float(value.abs().max()) > 0, key  # control: a gradient flows to every compared tensor
    for name in wrappers:  # expert 2, reached by no token, gets no update
        a_ERI = got[name + ".A"].reshape(cfg.num_experts, peft.lora_r, -1)
        b_OR_E = got[name + ".B"].reshape(-1, peft.lora_r, cfg.num_experts)
        assert not a_ERI[2].any() and not b_OR_E[..., 2].any() and a_ERI[3].any()


def test_zero_lora_b_on_nf4_experts_starts_at_the_base():
    """Zero-initialised lora_B (PEFT's start): the logits equal the NF4 base's without expert LoRA, bitwise, and
    ``adapters_disabled`` gives the base back; non-zero B changes them (control), and every expert factor gets a
    gradient."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    weights = init_weights(cfg, seed=0)
    batch = _batch(cfg)
    peft = _peft(lora_target_parameters=list(EXPERTS))
    base = logits(add_adapters(build_model(cfg, weights), cfg, _peft()), batch)
    fresh = add_adapters(build_model(cfg, weights), cfg, peft)
    np.testing.assert_array_equal(logits(fresh, batch), base)
    moved = add_adapters(build_model(cfg, weights), cfg, peft, init_adapters(cfg, peft, seed=1, lora_b_std=0.02))
    assert _max_diff(logits(moved, batch), base) > 1e-3
    with adapters_disabled(moved):
        np.testing.assert_array_equal(logits(moved, batch), base)
    assert _max_diff(logits(moved, batch), base) > 1e-3  # enabled again after the block
    _, grads = loss_and_grads(moved, batch)
    expert_grads = {k: g for k, g in grads.items() if ".experts." in k}
    assert len(expert_grads) == 8 and all(np.abs(g).max() > 0 for g in expert_grads.values())


def test_saved_nf4_expert_adapters_load_into_peft_on_the_dequantised_float_base(tmp_path):
    """The adapter folder is PEFT's (``target_parameters``, ParamWrapper's keys): ``PeftModel.from_pretrained`` on a
    float checkpoint of the dequantised base reproduces the NF4 adapter model's logits (1e-5), as does
    ``merge_adapters``; the same folder on
    the float original does not (control: the base really is NF4), nor the base without the adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.preset("tiny-qwen3-moe")
    weights = init_weights(cfg, seed=0)
    batch = _batch(cfg)
    ids = torch.tensor(batch.input_ids)
    peft = _peft(lora_target_parameters=list(EXPERTS))
    model = add_adapters(build_model(cfg, weights), cfg, peft, init_adapters(cfg, peft, seed=1, lora_b_std=0.02))
    ours = logits(model, batch)
    dequantised_dir = write_hf_checkpoint(cfg, base_weights(model), tmp_path / "dequantised")
    save_adapters(tmp_path / "adapter", cfg, peft, export_adapters(model), str(dequantised_dir))

    def peft_logits(base_dir) -> np.ndarray:
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
        assert sum(".experts." in n and "lora_" in n for n, _ in loaded.named_parameters()) == 8
        with torch.no_grad():
            return loaded.eval()(input_ids=ids).logits.float().numpy()

    assert _max_diff(peft_logits(dequantised_dir), ours) <= LOGITS_ABS
    assert _max_diff(logits(merge_adapters(model), batch), ours) <= LOGITS_ABS  # twinseq's merge, the same numbers
    original_dir = write_hf_checkpoint(cfg, weights, tmp_path / "original")
    assert _max_diff(peft_logits(original_dir), ours) > 1e-2
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(dequantised_dir).eval()(input_ids=ids).logits.float().numpy()
    assert _max_diff(plain, ours) > 1e-3  # control: the saved adapters are what moves the logits


def test_nf4_experts_whose_blocks_would_straddle_experts_are_refused():
    """An expert whose number of weights is not a multiple of 64 cannot dequantise alone: refused, naming the field,
    the tensor and the fix; the same model 32 wide (whole blocks) quantises (control)."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny-qwen3-moe"), hidden_size=20, moe_intermediate_size=4)
    match = r"load_in_4bit=True: model\.layers\.0\.mlp\.experts\.\w+_proj has \d+ numbers per expert.*--load-in-4bit"
    with pytest.raises(ConfigError, match=match):
        add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft())
    control = dataclasses.replace(cfg, hidden_size=32)
    add_adapters(build_model(control, init_weights(control, seed=0)), control, _peft())


def test_the_planner_counts_the_nf4_experts_as_the_model_stores_them():
    """``plan_memory``'s ``expert weights (NF4 + absmax)`` row is the NF4 model's expert codes + absmax bytes, the
    float32 rows hold exactly the numbers that stayed float (gpt_oss's expert biases split off), and the kernel's
    chunk of dequantised experts is a row of its own; without load_in_4bit neither row exists (control)."""
    from twinseq.common.config import TrainConfig
    from twinseq.common.models.configs import parameter_shapes
    from twinseq.common.models.peft import LINEAR_MODULES
    from twinseq.common.run.memory_plan import plan_memory

    for preset in ("tiny-qwen3-moe", "tiny-gpt-oss"):
        cfg = ModelConfig.preset(preset)
        model = add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft())
        experts = experts_modules(causal_lm_of(model))
        stored = sum(getattr(e, n).nbytes + getattr(e, n).quant_state.absmax.nbytes
                     for e in experts for n in ("gate_up_proj", "down_proj"))
        flat = dict(model_config=preset, use_peft=True, lora_target_modules=["q_proj"], lora_dropout=0.0)
        plan = plan_memory(TrainConfig.from_flat(**flat, load_in_4bit=True), backend="torch")
        assert plan.get("expert weights (NF4 + absmax)") == stored
        float_numbers = sum(int(np.prod(s)) for n, s in parameter_shapes(cfg).items()
                            if not (len(s) == 2 and n.split(".")[-2] in LINEAR_MODULES) and len(s) != 3)
        assert plan.get("weights (float32)") + plan.get("expert weights (float32)") == 4 * float_numbers
        assert (plan.get("expert weights (float32)") > 0) == cfg.expert_biases
        one_layer = sum(int(np.prod(getattr(experts[0], n).quant_state.shape)) for n in ("gate_up_proj", "down_proj"))
        assert plan.get("NF4 experts workspace (transient)") >= 4 * one_layer  # the 4 experts fit one chunk
        plain = plan_memory(TrainConfig.from_flat(**flat), backend="torch")
        assert plain.get("expert weights (NF4 + absmax)") == plain.get("NF4 experts workspace (transient)") == 0


def test_no_more_than_a_chunk_of_experts_is_ever_dequantised(monkeypatch):
    """The kernel dequantises at most ``NF4_EXPERTS_PER_CHUNK`` experts at a time, forward and backward (here 1 of
    the 4: each call asks for one expert), and the loss and gradients equal those of the default chunks (1e-5);
    with the default cap (8) a call takes several experts (control: the cap is what splits them)."""
    from twinseq.torch_backend import moe

    cfg = ModelConfig.preset("tiny-qwen3-moe")
    peft = _peft(lora_target_parameters=list(EXPERTS))
    adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    model = add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, peft, adapters)
    batch = _batch(cfg)
    sizes: list[int] = []

    def recorded(weight, e0, e1):
        sizes.append(e1 - e0)
        return dequantize_experts(weight, e0, e1)

    monkeypatch.setattr(moe, "dequantize_experts", recorded)
    loss, grads = loss_and_grads(model, batch)
    assert max(sizes) > 1, sizes  # control: the default chunk (8) takes several experts per call
    sizes.clear()
    monkeypatch.setattr(moe, "NF4_EXPERTS_PER_CHUNK", 1)
    one_loss, one_grads = loss_and_grads(model, batch)
    assert max(sizes) == 1 and len(sizes) >= 2 * 2 * cfg.num_hidden_layers * 2, sizes  # fwd + bwd, 2 tensors
    assert abs(one_loss - loss) <= tol("float32", "loss_rel") * abs(loss)
    for key, value in grads.items():
        assert _rel(one_grads[key], value) <= GRAD_REL, key
