"""Invariants of ``common.run.memory_plan``'s mixture-of-experts rows: every expert resident with its gradient and
optimizer state, ``top_k`` routed copies of each token, the router's logits, the grouped matmul's sort buffers.

Arithmetic on the config only; how close the plan is to a measured MoE peak is ``benchmarks/memory_planner_check.py``'s
``*-tiny-qwen3-moe-fused`` rows.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.models.configs import ModelConfig, parameter_shapes
from twinseq.common.run.memory_plan import MOE_ROWS, MOE_SAVED, MOE_SAVED_KERNEL, plan_memory

BASE = dict(model_config="tiny-qwen3-moe", max_length=512, packing=True, per_device_train_batch_size=8)
BACKENDS = ("torch", "jax")
WORKSPACE = "grouped matmul workspace (MoE)"
ROUTED, ROUTER = MOE_ROWS


def moe_model(**changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny-qwen3-moe"), **changes)


def plan(backend="torch", model=None, **kw):
    return plan_memory(TrainConfig.from_flat(**{**BASE, "backend": backend, **kw}), model=model)


def expert_numbers(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for n, s in parameter_shapes(cfg).items() if ".mlp.experts." in n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_expert_is_resident_with_its_gradient_and_adam_moments(backend):
    """Expert rows: 4 B of weight, 4 B of gradient and 8 B of AdamW per expert number; the split keeps the total."""
    cfg = moe_model()
    p = plan(backend, model=cfg)
    n = expert_numbers(cfg)
    assert n > 0
    assert p.get("expert weights (float32)") == p.get("expert gradients (float32)") == 4 * n
    assert p.get("expert optimizer state (AdamW)") == 8 * n
    assert p.get("weights (float32)") + p.get("expert weights (float32)") == 4 * p.total_parameters


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_experts_more_weight_memory_same_routed_activations(backend):
    """Doubling the experts doubles the experts' states; each token still runs top_k experts, so the routed copies
    stay the same, and only the router's logits (one per expert) grow."""
    four, eight = plan(backend, model=moe_model(num_experts=4)), plan(backend, model=moe_model(num_experts=8))
    for row in ("expert weights (float32)", "expert gradients (float32)", "expert optimizer state (AdamW)"):
        assert eight.get(row) == 2 * four.get(row), row
    assert eight.get(ROUTED) == four.get(ROUTED) > 0
    assert eight.get(ROUTER) == 2 * four.get(ROUTER) > 0
    if backend == "torch":  # the sort buffers: one entry per token copy
        assert eight.get(WORKSPACE) == four.get(WORKSPACE) > 0
    assert eight.total > four.total


def test_the_grouped_matmul_workspace_does_not_grow_with_the_experts():
    """The grouped matmuls work in place on both backends and both devices (torch_backend.moe; jax: ragged_dot on
    CUDA, jax_backend.grouped's blockwise scan on CPU, not XLA:CPU's dense lowering of ragged_dot): the workspace is
    the sort of the copies, the same for 4 or 8 experts, and grows with top_k (the control)."""
    for backend in BACKENDS:
        for device in ("cpu", "cuda"):
            work = [
                plan_memory(
                    TrainConfig.from_flat(**{**BASE, "backend": backend}), model=moe_model(num_experts=e), device=device
                ).get(WORKSPACE)
                for e in (4, 8)
            ]
            assert work[0] == work[1] > 0, (backend, device)
    assert plan("jax", model=moe_model(num_experts_per_tok=1)).get(WORKSPACE) < plan("jax").get(WORKSPACE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_2_doubles_the_routed_activations_and_the_sort(backend):
    one, two = plan(backend, model=moe_model(num_experts_per_tok=1)), plan(backend, model=moe_model())
    assert two.get(ROUTED) == 2 * one.get(ROUTED) > 0
    assert two.get(WORKSPACE) == 2 * one.get(WORKSPACE)
    assert two.get(ROUTER) == one.get(ROUTER)  # the router scores every expert whatever top_k
    assert two.get("expert weights (float32)") == one.get("expert weights (float32)")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_routed_row_counts_the_saved_copies(backend, device):
    """tokens x MoE layers x top_k x (routed_mlp m + routed_hidden h) float32 numbers: on CPU and CUDA twinseq's
    kernels (gate/up pre-activations only); jax with LoRA on the experts runs its per-projection path, which keeps
    several times more."""
    cfg = moe_model()
    p = plan_memory(TrainConfig.from_flat(**{**BASE, "backend": backend}), model=cfg, device=device)
    copies = p.tokens * cfg.num_hidden_layers * cfg.num_experts_per_tok
    per_copy = MOE_SAVED_KERNEL.routed_mlp * cfg.expert_intermediate_size
    per_copy += MOE_SAVED_KERNEL.routed_hidden * cfg.hidden_size
    assert p.get(ROUTED) == pytest.approx(copies * per_copy * 4, rel=1e-9)
    if backend == "jax":
        flat = {**BASE, "backend": backend, "use_peft": True, "lora_dropout": 0.0,
                "lora_target_parameters": ["experts.gate_up_proj"]}
        lora = plan_memory(TrainConfig.from_flat(**flat), model=cfg, device=device)
        coef = MOE_SAVED["jax"]
        per_copy = coef.routed_mlp * cfg.expert_intermediate_size + coef.routed_hidden * cfg.hidden_size
        assert lora.get(ROUTED) == pytest.approx(lora.tokens * cfg.num_hidden_layers * cfg.num_experts_per_tok
                                                 * per_copy * 4, rel=1e-9)
        assert p.get(ROUTED) * 2 < lora.get(ROUTED)


def test_dense_layers_of_a_qwen3_moe_carry_no_routed_activations():
    """``mlp_only_layers``: only the MoE layers have routed copies (half of them here)."""
    both, one = plan(model=moe_model()), plan(model=moe_model(mlp_only_layers=[0]))
    assert one.get(ROUTED) * 2 == both.get(ROUTED)
    assert one.get("expert weights (float32)") * 2 == both.get("expert weights (float32)")


def test_checkpointing_keeps_one_moe_layer_of_routed_copies():
    full, ckpt = plan(), plan(gradient_checkpointing=True)
    assert ckpt.get(ROUTED) * moe_model().num_hidden_layers == full.get(ROUTED)


def test_lora_freezes_the_experts_so_no_expert_gradient_or_optimizer_rows():
    p = plan(use_peft=True)
    assert p.get("expert weights (float32)") > 0
    assert p.get("expert gradients (float32)") == p.get("expert optimizer state (AdamW)") == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_control_dense_model_has_no_moe_rows_and_expert_width_moves_the_routed_row(backend):
    """The invariants above could fail: a dense preset plans none of the MoE rows, and the routed row does move
    with what each copy computes (the experts' width), unlike with the number of experts."""
    dense = plan_memory(TrainConfig.from_flat(**{**BASE, "model_config": "tiny", "backend": backend}))
    names = {r.component for r in dense.rows}
    assert not names & {*MOE_ROWS, WORKSPACE, "expert weights (float32)"}
    narrow, wide = plan(backend, model=moe_model()), plan(backend, model=moe_model(moe_intermediate_size=128))
    assert wide.get(ROUTED) > narrow.get(ROUTED)
    assert wide.get("expert weights (float32)") > narrow.get("expert weights (float32)")
