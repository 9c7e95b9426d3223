"""PEFT on the torch backend: adapters through the real ``peft`` library, interchangeable with it both ways,
on every attention path and loss, merged, trained (LoRA, QLoRA, DPO), checkpointed, and refused clearly.

Adapters that start non-zero (``init_adapters(..., lora_b_std=0.02)``, perturbed token rows) make every test
able to fail: an adapter that were ignored, mis-scaled or mis-keyed would change the logits by far more than
the tolerances (each test also checks that the adapters do move the logits, its negative control).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from twinseq.common.batching import collate  # noqa: E402
from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.dpo import validate_dpo_config  # noqa: E402
from twinseq.common.dpo_batching import collate_preference  # noqa: E402
from twinseq.common.errors import ConfigError, MissingDependencyError  # noqa: E402
from twinseq.common.hf_checkpoint import write_hf_checkpoint  # noqa: E402
from twinseq.common.init import init_weights  # noqa: E402
from twinseq.common.peft import (PeftConfig, TOKENS_KEY, adapter_shapes, init_adapters, read_adapters,  # noqa: E402
                                 save_adapters)
from twinseq.torch_backend import dpo as tdpo  # noqa: E402
from twinseq.torch_backend import peft as tpeft  # noqa: E402
from twinseq.torch_backend.model import build_model, export_weights, logits, loss_and_grads  # noqa: E402
from twinseq.torch_backend.peft import add_adapters, export_adapters, merge_adapters  # noqa: E402

VARIANTS = {
    "lora": dict(),
    "dora": dict(use_dora=True),
    "rslora": dict(use_rslora=True),
    "tokens": dict(trainable_token_indices=[3, 7, 100]),
}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the machine is shared, and the summation order then does not depend on it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _peft(**kw) -> PeftConfig:
    return PeftConfig(use_peft=True, **{"lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, **kw})


def _adapters(cfg: ModelConfig, peft: PeftConfig, weights, seed: int = 1) -> dict[str, np.ndarray]:
    """Non-zero adapters: lora_B ~ N(0, 0.02), DoRA magnitudes and token rows moved off their start."""
    adapters = init_adapters(cfg, peft, seed=seed, base_weights=weights, lora_b_std=0.02)
    rng = np.random.default_rng(seed + 100)
    for key, value in adapters.items():
        if key.endswith("lora_magnitude_vector") or key == TOKENS_KEY:
            adapters[key] = (value + rng.normal(0, 0.05, value.shape)).astype(np.float32)
    return adapters


def _docs(cfg: ModelConfig, lengths=(9, 17, 5), seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    # token 3 and 7 (trainable tokens) appear in every document, as inputs and as targets
    return [{"input_ids": [3, *rng.integers(8, cfg.vocab_size, n - 2).tolist(), 7]} for n in lengths]


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --------------------------------------------------------------------------------------
# Interchange with the peft library, both ways
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, variant", [("tiny", v) for v in VARIANTS] + [("tiny-qwen2", "lora"),
                                                                               ("tiny-qwen2", "dora"),
                                                                               ("tiny-gemma2", "tokens")])
def test_adapters_interchange_with_peft_both_ways(preset, variant, tmp_path):
    """twinseq's adapter folder -> ``PeftModel.from_pretrained`` gives twinseq's logits (1e-5), and an adapter
    folder written by peft's ``save_pretrained`` -> ``read_adapters`` -> ``add_adapters`` gives peft's."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.preset(preset)
    weights = init_weights(cfg, seed=0)
    peft = _peft(**VARIANTS[variant])
    base_dir = write_hf_checkpoint(cfg, weights, tmp_path / "base")
    doc = _docs(cfg, lengths=(23,))
    batch = collate(doc)
    ids = torch.tensor([doc[0]["input_ids"]])

    def hf_logits(model) -> np.ndarray:
        with torch.no_grad():
            return model(input_ids=ids).logits.float().numpy()

    # twinseq -> peft
    ours = add_adapters(build_model(cfg, weights, attn_implementation="eager"), cfg, peft,
                        _adapters(cfg, peft, weights))
    save_adapters(tmp_path / "ours", cfg, peft, export_adapters(ours), str(base_dir))
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager"),
                                       tmp_path / "ours").eval()
    ours_logits = logits(ours, batch)
    assert _max_diff(ours_logits, hf_logits(theirs)) <= 1e-5
    base_logits = logits(build_model(cfg, weights, attn_implementation="eager"), batch)
    assert _max_diff(ours_logits, base_logits) > 1e-3  # negative control: the adapters matter

    # peft -> twinseq
    hf = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    kw = dict(VARIANTS[variant])
    if "trainable_token_indices" in kw:
        kw["trainable_token_indices"] = {"embed_tokens": kw["trainable_token_indices"]}
    made = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                         init_lora_weights=False, **kw))
    with torch.no_grad():  # init_lora_weights=False gives a random lora_B; move the other adapters too
        for name, p in made.named_parameters():
            if "lora_magnitude_vector" in name or "trainable_tokens_delta" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    made.save_pretrained(tmp_path / "theirs")
    read_peft, read = read_adapters(tmp_path / "theirs", cfg)
    assert set(read) == set(adapter_shapes(cfg, read_peft))
    loaded = add_adapters(build_model(cfg, weights, attn_implementation="eager"), cfg, read_peft, read)
    made_logits = hf_logits(made.eval())
    assert _max_diff(logits(loaded, batch), made_logits) <= 1e-5
    assert _max_diff(made_logits, base_logits) > 1e-3


def test_adapter_model_structure_and_keys():
    """A PeftModel whose trainable tensors are exactly common.peft's adapter tensors (PEFT saved keys, the same
    set peft's own ``get_peft_model_state_dict`` saves), the base frozen and exported unchanged."""
    from peft import get_peft_model_state_dict

    cfg = ModelConfig.preset("tiny")
    weights = init_weights(cfg, seed=0)
    peft = _peft(use_dora=True, trainable_token_indices=[5])
    model = add_adapters(build_model(cfg, weights), cfg, peft)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == len(adapter_shapes(cfg, peft))
    assert set(export_adapters(model)) == set(adapter_shapes(cfg, peft)) == set(get_peft_model_state_dict(model))
    start = init_adapters(cfg, peft, seed=0, base_weights=weights)
    assert all(np.array_equal(start[k], v) for k, v in export_adapters(model).items())  # bitwise: JAX's start
    exported = export_weights(model)
    assert all(np.array_equal(exported[k], weights[k]) for k in weights)
    batch = collate(_docs(cfg))
    # B = 0 and DoRA's magnitude = the row norms: the adapted model starts as its base
    assert _max_diff(logits(model, batch), logits(build_model(cfg, weights), batch)) <= 1e-5
