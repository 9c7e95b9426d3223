"""LoRA on the experts of MoE layers, torch backend: PEFT's ``target_parameters`` (``lora.ParamWrapper``) on
transformers 5's fused expert tensors, interchangeable with PEFT both ways, merged, and refused where PEFT cannot.

Adapters start non-zero (``lora_B ~ N(0, 0.02)``), so a mis-keyed, mis-reshaped or ignored expert adapter changes the
logits by far more than the tolerances; each test also checks that the expert adapters move the logits.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.hf_folder import write_hf_checkpoint  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.models.peft import (  # noqa: E402
    PeftConfig,
    adapter_shapes,
    init_adapters,
    read_adapters,
    save_adapters,
)
from twinseq.torch_backend.model import build_model, logits, loss_and_grads  # noqa: E402
from twinseq.torch_backend.peft import adapters_disabled, add_adapters, export_adapters, merge_adapters  # noqa: E402

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the machine is shared, and the summation order then does not depend on it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _peft(**kw) -> PeftConfig:
    base = {"lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "lora_target_modules": ["q_proj"]}
    return PeftConfig(use_peft=True, **{**base, "lora_target_parameters": list(EXPERTS), **kw})


def _batch(cfg: ModelConfig, n: int = 23):
    rng = np.random.default_rng(0)
    return collate([{"input_ids": rng.integers(3, cfg.vocab_size, n).tolist()}])


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_expert_adapter_keys_are_peft_saved_keys():
    """The adapter tensors PEFT builds for target_parameters are exactly common.models.peft's (keys and shapes,
    ``base_layer`` nesting included), and only they train."""
    from peft import get_peft_model_state_dict

    cfg = ModelConfig.preset("tiny-qwen3-moe")
    peft = _peft()
    model = add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, peft)
    saved = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    assert saved == adapter_shapes(cfg, peft)
    p = "base_model.model.model.layers.0.mlp.experts."
    e, r, h, m = cfg.num_experts, peft.lora_r, cfg.hidden_size, cfg.expert_intermediate_size
    assert saved[p + "base_layer.lora_A.weight"] == (e * r, h)  # gate_up_proj, the inner wrapper
    assert saved[p + "base_layer.lora_B.weight"] == (2 * m, r * e)
    assert saved[p + "lora_B.weight"] == (h, r * e)  # down_proj, the outer one
    trainable = {n for n, q in model.named_parameters() if q.requires_grad}
    assert len(trainable) == len(saved) and all("lora_" in n for n in trainable)
    # negative control: without expert targets there is no expert adapter
    assert not any("experts" in k for k in adapter_shapes(cfg, _peft(lora_target_parameters=None)))


@pytest.mark.parametrize("preset, targets", [("tiny-qwen3-moe", EXPERTS), ("tiny-mixtral", EXPERTS[1:])])
def test_expert_adapters_interchange_with_peft_both_ways(preset, targets, tmp_path):
    """twinseq's folder -> ``PeftModel.from_pretrained`` gives twinseq's logits (1e-5); a folder PEFT's
    ``save_pretrained`` wrote -> ``read_adapters`` -> ``add_adapters`` gives PEFT's, and its tensors bitwise."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.preset(preset)
    weights = init_weights(cfg, seed=0)
    peft = _peft(lora_target_parameters=list(targets))
    base_dir = write_hf_checkpoint(cfg, weights, tmp_path / "base")
    batch = _batch(cfg)
    ids = torch.tensor(batch.input_ids)

    ours = add_adapters(build_model(cfg, weights), cfg, peft, init_adapters(cfg, peft, seed=1, lora_b_std=0.02))
    save_adapters(tmp_path / "ours", cfg, peft, export_adapters(ours), str(base_dir))
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "ours").eval()
    with torch.no_grad():
        theirs_logits = theirs(input_ids=ids).logits.float().numpy()
    ours_logits = logits(ours, batch)
    assert _max_diff(ours_logits, theirs_logits) <= 1e-5
    no_experts = _peft(lora_target_parameters=None)
    attn_only = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    attn_only = {k: v for k, v in attn_only.items() if k in adapter_shapes(cfg, no_experts)}
    control = logits(add_adapters(build_model(cfg, weights), cfg, no_experts, attn_only), batch)
    assert _max_diff(ours_logits, control) > 1e-3  # negative control: the expert adapters matter

    made = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=list(targets), init_lora_weights=False),
    )
    made.save_pretrained(tmp_path / "theirs")
    read_peft, read = read_adapters(tmp_path / "theirs", cfg)
    assert read_peft.lora_target_parameters == list(targets) and read_peft.lora_target_modules == []
    loaded = add_adapters(build_model(cfg, weights), cfg, read_peft, read)
    with torch.no_grad():
        made_logits = made(input_ids=ids).logits.float().numpy()
    assert _max_diff(logits(loaded, batch), made_logits) <= 1e-5
    assert all(np.array_equal(v, read[k]) for k, v in export_adapters(loaded).items())


def test_merged_experts_equal_the_adapter_model():
    """``merge_adapters`` folds ``scaling * B_e @ A_e`` into each expert: the plain merged model gives the adapter
    model's logits (1e-5) and, adapters disabled, the base's; a merge with the expert factors' layout swapped does
    not (negative control)."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    peft = _peft()
    weights = init_weights(cfg, seed=0)
    adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    model = add_adapters(build_model(cfg, weights), cfg, peft, adapters)
    batch = _batch(cfg)
    want = logits(model, batch)
    assert _max_diff(logits(merge_adapters(model), batch), want) <= 1e-5
    with adapters_disabled(model):  # PEFT's switch reaches the ParamWrappers: the base model's logits, bitwise
        np.testing.assert_array_equal(logits(model, batch), logits(build_model(cfg, weights), batch))
    swapped = dict(adapters)
    for key in [k for k in adapters if "experts" in k and "lora_A" in k]:  # A's rows as r-major: the wrong experts
        a = adapters[key]
        swapped[key] = a.reshape(-1, cfg.num_experts, a.shape[-1]).transpose(1, 0, 2).reshape(a.shape).copy()
    wrong = add_adapters(build_model(cfg, weights), cfg, peft, swapped)
    assert _max_diff(logits(merge_adapters(wrong), batch), want) > 1e-4


def test_expert_adapters_get_gradients_and_the_base_none():
    """Every expert adapter tensor gets a non-zero gradient; the loss moves when they change."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    peft = _peft()
    model = add_adapters(
        build_model(cfg, init_weights(cfg, seed=0)), cfg, peft, init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    )
    loss, grads = loss_and_grads(model, _batch(cfg))
    expert_grads = {k: g for k, g in grads.items() if "experts" in k}
    assert len(expert_grads) == 8  # 2 layers x 2 tensors x (A, B)
    assert all(float(np.abs(g).max()) > 0 for g in expert_grads.values())
    assert np.isfinite(loss)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(lora_dropout=0.05), "lora_dropout"),
        (dict(use_dora=True), "use_dora"),
        (dict(lora_target_parameters=["experts.up_proj"]), "lora_target_parameters"),
        (dict(lora_target_parameters=[]), "lora_target_parameters"),
    ],
)
def test_what_peft_cannot_do_on_experts_is_refused(kw, field):
    """PEFT's ParamWrapper has no dropout and no DoRA; an unknown tensor is named (an NF4 base works:
    test_qlora_experts.py)."""
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    with pytest.raises(ConfigError, match=field):
        add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft(**kw))


def test_expert_targets_on_a_dense_model_are_refused():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ConfigError, match="no expert tensors"):
        add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft())
    add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, _peft(lora_target_parameters=None))  # control
