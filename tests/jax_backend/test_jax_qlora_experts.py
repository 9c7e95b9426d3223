"""QLoRA on a MoE model, JAX backend: refused, naming the field, the value and the fix.

The jax backend's QLoRA (``jax_backend.peft``) quantises the decoder's linear layers with qwix; the fused expert
tensors, almost all of a MoE model's weights, have no NF4 storage there yet, so ``load_in_4bit`` would leave them
float32 while the torch backend stores them as NF4 (tests/torch_backend/test_qlora_experts.py). Rather than a
silently different QLoRA, ``add_adapters`` and the memory planner refuse it.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("qwix")

from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.models.peft import PeftConfig  # noqa: E402
from twinseq.common.run.memory_plan import plan_memory  # noqa: E402
from twinseq.jax_backend import build_model  # noqa: E402
from twinseq.jax_backend import peft as jpeft  # noqa: E402

REFUSAL = r"load_in_4bit=True on the jax backend: this \w+ model's experts .* --backend torch .* drop --load-in-4bit"


def _peft(**kw) -> PeftConfig:
    return PeftConfig(use_peft=True, lora_r=4, lora_alpha=8.0, lora_target_modules=["q_proj"], **kw)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_qlora_on_a_moe_model_is_refused_on_jax(preset):
    """load_in_4bit on a model with experts: ConfigError naming load_in_4bit, the experts' share and both fixes; the
    same model without load_in_4bit takes its adapters (control: the refusal is about the NF4 experts only)."""
    cfg = ModelConfig.preset(preset)
    base = build_model(cfg, init_weights(cfg, seed=0))
    with pytest.raises(ConfigError, match=REFUSAL):
        jpeft.add_adapters(base, cfg, _peft(load_in_4bit=True))
    assert jpeft.peft_config(jpeft.add_adapters(base, cfg, _peft())).use_peft


def test_the_planner_refuses_jax_qlora_on_experts_and_plans_torch():
    """The planner refuses what the jax trainer refuses, and plans the same config on torch (NF4 experts row)."""
    flat = dict(model_config="tiny-qwen3-moe", use_peft=True, load_in_4bit=True, lora_target_modules=["q_proj"])
    config = TrainConfig.from_flat(**flat)
    with pytest.raises(ConfigError, match=REFUSAL):
        plan_memory(config, backend="jax")
    assert plan_memory(config, backend="torch").get("expert weights (NF4 + absmax)") > 0
    dense = TrainConfig.from_flat(**{**flat, "model_config": "tiny"})
    assert plan_memory(dense, backend="jax").get("weights (NF4 + absmax)") > 0  # control: dense QLoRA plans on jax
