"""twinseq's grouped-matmul MoE experts (``torch_backend.moe``) against transformers' eager per-expert loop.

Forward and every gradient (input, router, expert tensors and biases) of one MoE block, qwen3_moe, mixtral and
gpt_oss layouts (gpt_oss: transposed, interleaved gate/up, biases, clamped SwiGLU), on the same weights and input,
within the float32 parity tolerances. The router is rigged so that expert 0 is in every
token's top-k and the last expert in none: the empty expert's gradient must be exactly zero, the full one's right.
A negative control (two experts' weights swapped in one run) shows the comparison catches a mislabelled expert.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from parity_tests.tolerances import tol  # noqa: E402
from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.models.peft import PeftConfig, init_adapters  # noqa: E402
from twinseq.torch_backend.model import build_model, loss_and_grads  # noqa: E402
from twinseq.torch_backend.moe import EXPERTS_HF_NAME, register_experts, route  # noqa: E402
from twinseq.torch_backend.peft import add_adapters  # noqa: E402

H, E, K, I, T = 32, 6, 2, 16, 24


def _block(family: str) -> torch.nn.Module:
    """A standalone MoE block, weights N(0, 0.1), the router rigged on feature 0: expert 0 always chosen, the last
    expert never."""
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, norm_topk_prob=True
        )
        block = Qwen3MoeSparseMoeBlock(config)
    elif family == "mixtral":
        config = MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K, intermediate_size=I)
        block = MixtralSparseMoeBlock(config)
    else:  # a limit some pre-activations pass, so that both sides of the clamps are taken
        config = GptOssConfig(
            hidden_size=H, num_local_experts=E, num_experts_per_tok=K, intermediate_size=I, swiglu_limit=0.5
        )
        block = GptOssMLP(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        _router(block).weight[0, 0], _router(block).weight[-1, 0] = 2.0, -2.0
    return block


def _router(block: torch.nn.Module) -> torch.nn.Module:
    return block.router if isinstance(block, GptOssMLP) else block.gate


def _forward_backward(block: torch.nn.Module, implementation: str, x_TH: torch.Tensor) -> dict[str, np.ndarray]:
    """Output and gradients of ``sum(y * r)`` (``r`` fixed) under ``implementation``."""
    register_experts()
    block.experts.config._experts_implementation = implementation
    block.zero_grad(set_to_none=True)
    x = x_TH.clone()[None].requires_grad_(True)
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y  # gpt_oss's block also returns its router scores
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    (y * r).sum().backward()
    out = {"y": y.detach()[0].numpy(), "x": x.grad[0].numpy()}
    return out | {name: p.grad.numpy().copy() for name, p in block.named_parameters()}


def _input() -> torch.Tensor:
    x_TH = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    x_TH[:, 0] = 3.0  # with the rigged router row: logit +6 for expert 0, -6 for the last
    return x_TH


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_grouped_experts_equal_the_eager_loop(family):
    block, x_TH = _block(family), _input()
    top_k_index = _router(block)(x_TH)[2]
    assert (top_k_index == 0).any(-1).all() and not (top_k_index == E - 1).any()  # the rig holds
    ours, eager = _forward_backward(block, EXPERTS_HF_NAME, x_TH), _forward_backward(block, "eager", x_TH)
    assert float(np.abs(ours["y"] - eager["y"]).max()) <= tol("float32", "logits_abs")
    experts = [n for n, _ in block.named_parameters() if n.startswith("experts.")]
    assert len(experts) == (4 if family == "gpt_oss" else 2) and ours.keys() == eager.keys()
    for name in ours.keys() - {"y"}:
        assert _rel(ours[name], eager[name]) <= tol("float32", "grad_rel"), name
    for name in experts:
        assert not ours[name][E - 1].any() and ours[name][0].any(), name  # the empty expert's gradient is zero


def test_a_mislabelled_expert_is_caught():
    """Negative control: the same comparison, with experts 0 and 1 swapped in our run only, fails it."""
    block, x_TH = _block("qwen3_moe"), _input()
    eager = _forward_backward(block, "eager", x_TH)
    with torch.no_grad():
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            p[[0, 1]] = p[[1, 0]].clone()
    ours = _forward_backward(block, EXPERTS_HF_NAME, x_TH)
    assert float(np.abs(ours["y"] - eager["y"]).max()) > 100 * tol("float32", "logits_abs")
    assert _rel(ours["x"], eager["x"]) > 100 * tol("float32", "grad_rel")


def test_route_sorts_every_copy_once_into_chunks_of_whole_experts():
    top_k_index = torch.tensor([[2, 0], [0, 3], [3, 2], [0, 1], [2, 3]])
    r = route(top_k_index, 5, chunk_rows=3)
    assert sorted(r.perm_S.tolist()) == list(range(10))
    assert r.token_S.tolist() == (r.perm_S // 2).tolist()
    expert_S = top_k_index.reshape(-1)[r.perm_S]
    assert expert_S.tolist() == sorted(expert_S.tolist())
    starts = [c[2] for c in r.chunks] + [10]
    assert [c[3] for c in r.chunks] == starts[1:] and [c[0] for c in r.chunks[1:]] == [c[1] for c in r.chunks[:-1]]
    for (e0, e1, r0, r1), offs in zip(r.chunks, r.offsets):
        assert set(expert_S[r0:r1].tolist()) <= set(range(e0, e1)) and int(offs[-1]) == r1 - r0
    assert max(c[3] - c[2] for c in r.chunks) == 3  # expert 0 alone (3 copies); no chunk past the limit


def _peft() -> PeftConfig:
    targets = ["experts.gate_up_proj", "experts.down_proj"]
    return PeftConfig(
        use_peft=True,
        lora_r=4,
        lora_alpha=8.0,
        lora_dropout=0.0,
        lora_target_modules=["q_proj"],
        lora_target_parameters=targets,
    )


@pytest.mark.parametrize("preset, lora", [("tiny-qwen3-moe", False), ("tiny-mixtral", True), ("tiny-gpt-oss", False)])
def test_build_model_runs_the_grouped_experts_and_matches_eager(preset, lora):
    """``build_model`` selects ``twinseq_grouped`` on CPU; the model's loss and every gradient (LoRA on the experts:
    the adapters', through peft's parametrized expert tensors) equal the eager loop's."""
    cfg = ModelConfig.preset(preset)
    batch = collate([{"input_ids": np.random.default_rng(0).integers(3, cfg.vocab_size, 23).tolist()}])
    results = []
    for implementation in (EXPERTS_HF_NAME, "eager"):
        model = build_model(cfg, init_weights(cfg, seed=0))
        assert model.config._experts_implementation == EXPERTS_HF_NAME
        model.set_experts_implementation(implementation)
        if lora:
            model = add_adapters(model, cfg, _peft(), init_adapters(cfg, _peft(), seed=1, lora_b_std=0.02))
        results.append(loss_and_grads(model, batch))
    (loss, grads), (eager_loss, eager_grads) = results
    assert abs(loss - eager_loss) <= tol("float32", "loss_rel") * abs(eager_loss)
    assert grads.keys() == eager_grads.keys() and (not lora or any("experts" in k for k in grads))
    for name in grads:
        assert _rel(grads[name], eager_grads[name]) <= tol("float32", "grad_rel"), name


def test_sizes_grouped_mm_cannot_stride_run_the_eager_loop_and_say_why(caplog):
    cfg = ModelConfig.preset("tiny-qwen3-moe", moe_intermediate_size=30)  # 120 bytes: not a multiple of 16
    with caplog.at_level(logging.INFO, logger="twinseq.torch_backend.moe"):
        model = build_model(cfg, init_weights(cfg, seed=0))
    assert model.config._experts_implementation == "eager"
    assert "'eager' loop" in caplog.text and "not a multiple of 16 bytes" in caplog.text
    assert build_model(ModelConfig.preset("tiny-gpt-oss")).config._experts_implementation == EXPERTS_HF_NAME
