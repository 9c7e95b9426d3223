"""Every model family on CUDA: the GPU lane's half of ``test_families.py`` and ``test_moe_kernel.py`` (``pytest -m
gpu``; every test here is marked ``gpu`` and skips without CUDA). The CPU suite proves these paths on CPU; what only a
GPU shows is checked here:

- The MoE and Gemma 3 families (Qwen3-MoE, Mixtral, gpt-oss, Gemma 3): twinseq's float32 logits (TF32 off) on every
  CUDA attention path, ``eager``, ``sdpa``, ``varlen`` and
  ``flex_attention`` (compiled by transformers), padded and packed, equal transformers' own eager forward of each
  document alone on CPU, within ``logits_abs``. gpt-oss's attention sinks run on CUDA's flex path (transformers
  rescales the kernel's output by its log-sum-exp), which the CPU suite can only refuse; the sinks are shown to matter
  (zeroing them moves the reference by far more than the bound).
- Packed equals separate on CUDA, forward and backward, on ``flex_attention`` (CPU flex has no backward) and
  ``varlen``: per-token loss within ``token_loss_abs``, the summed gradients within ``grad_rel``.
- twinseq's grouped MoE kernel on CUDA in bfloat16 (``torch.nn.functional.grouped_mm``'s CUDA kernel) equals
  transformers' eager per-expert loop on the same device, output and every gradient within the bfloat16 ``grad_rel``;
  two experts swapped in our run alone fail that comparison (the control).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity_tests.families import (  # noqa: E402
    FAMILY_CASES,
    family_batches,
    family_examples,
    hf_document_logits,
    hf_random_checkpoint,
)
from parity_tests.tolerances import tol  # noqa: E402
from twinseq.common.objectives.nll import shift_labels  # noqa: E402
from twinseq.torch_backend.attention import forward_hidden  # noqa: E402
from twinseq.torch_backend.checkpoint import load_pretrained  # noqa: E402
from twinseq.torch_backend.model import final_logit_softcap, logits, loss_and_grads  # noqa: E402
from twinseq.torch_backend.moe import EXPERTS_HF_NAME, register_experts  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane, pytest -m gpu)"),
]

CUDA_PATHS = ("eager", "sdpa", "varlen", "flex_attention")
NEW_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "gemma3")
"""The MoE and Gemma 3 families; the others' CUDA paths are covered by test_attention.py and test_cuda_paths.py."""
LOGITS_ABS, TOKEN_LOSS_ABS = tol("float32", "logits_abs"), tol("float32", "token_loss_abs")
LOSS_REL, GRAD_REL = tol("float32", "loss_rel"), tol("float32", "grad_rel")


@pytest.fixture(autouse=True)
def ieee_fp32():
    """float32 parity needs true float32 matmuls on CUDA (no TF32), restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root, paths = tmp_path_factory.mktemp("families_cuda"), {}

    def get(name: str):
        if name not in paths:
            paths[name] = hf_random_checkpoint(name, root / name)
        return paths[name]

    return get


@pytest.fixture(scope="module")
def batches():
    return family_batches()


def _reference_logits(path, name: str, zero_sinks: bool = False) -> list[np.ndarray]:
    """transformers' eager logits of each document alone, float32 on CPU (dynamic RoPE pads each document to the
    batch's longest position, as test_families.py explains)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    if zero_sinks:
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith("sinks"):
                    p.zero_()
    longest = max(len(ex["input_ids"]) for ex in family_examples())
    dynamic = FAMILY_CASES[name].rope_type == "dynamic"
    if dynamic:
        hf_document_logits(hf, [3] * 4)
    out = []
    for ex in family_examples():
        ids = ex["input_ids"] + ([3] * (longest - len(ex["input_ids"])) if dynamic else [])
        out.append(hf_document_logits(hf, ids)[: len(ex["input_ids"])])
    return out


def _doc_rows(batch, i: int) -> tuple[int, np.ndarray]:
    if batch.shape[0] == 1:
        return 0, np.flatnonzero(batch.segment_ids[0] == i + 1)
    return i, np.flatnonzero(batch.segment_ids[i] == 1)


def _max_diff(out_BTV: np.ndarray, batch, refs: list[np.ndarray]) -> float:
    return max(
        float(np.abs(out_BTV[_doc_rows(batch, i)[0], _doc_rows(batch, i)[1]] - r).max()) for i, r in enumerate(refs)
    )


def _token_losses(model, batch) -> np.ndarray:
    """float32 [B, T] per-token NLL of the (soft-capped) logits on the model's device, 0 where there is no target."""
    with torch.no_grad():
        logits_BTV = model.lm_head(forward_hidden(model, batch)).float()
        cap = final_logit_softcap(model)
        if cap is not None:
            logits_BTV = torch.tanh(logits_BTV / cap) * cap
        targets = torch.as_tensor(shift_labels(batch.labels), dtype=torch.long, device=logits_BTV.device)
        nll = torch.nn.functional.cross_entropy(
            logits_BTV.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none"
        )
    return nll.view(batch.shape).cpu().numpy()


@pytest.mark.parametrize("attn", CUDA_PATHS)
@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_cuda_logits_equal_transformers_per_document(checkpoint, batches, name, attn):
    model = load_pretrained(checkpoint(name), attn_implementation=attn, device="cuda")
    refs = _reference_logits(checkpoint(name), name)
    for layout in ("padded", "packed"):
        diff = _max_diff(logits(model, batches[layout]), batches[layout], refs)
        print(f"cuda logits vs transformers {name} {attn} {layout}: {diff:.2e}")
        assert diff <= LOGITS_ABS, (name, attn, layout, diff)


def test_the_sinks_checked_on_cuda_flex_matter(checkpoint, batches):
    """Control for gpt-oss on flex: without its sinks the reference moves by far more than the bound, so a path that
    dropped them would fail the test above."""
    with_sinks = _reference_logits(checkpoint("gpt_oss"), "gpt_oss")
    without = _reference_logits(checkpoint("gpt_oss"), "gpt_oss", zero_sinks=True)
    assert max(float(np.abs(a - b).max()) for a, b in zip(with_sinks, without)) > 100 * LOGITS_ABS


@pytest.mark.parametrize("attn", ("flex_attention", "varlen"))
@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_cuda_packed_equals_separate_loss_and_grads(checkpoint, batches, name, attn):
    model = load_pretrained(checkpoint(name), attn_implementation=attn, device="cuda")
    refs = [batches["padded"]] if FAMILY_CASES[name].rope_type == "dynamic" else batches["separate"]
    packed = batches["packed"]
    got = _token_losses(model, packed)
    want = []
    for b in refs:
        out = _token_losses(model, b)
        want += [out[i, b.segment_ids[i] == 1] for i in range(b.shape[0])]
    loss_diff = max(float(np.abs(got[0, packed.segment_ids[0] == i + 1] - w).max()) for i, w in enumerate(want))
    loss, grads = loss_and_grads(model, packed)
    ref_loss, ref_grads = 0.0, None
    for b in refs:
        part, g = loss_and_grads(model, b)
        ref_loss += part
        ref_grads = g if ref_grads is None else {k: ref_grads[k] + g[k] for k in g}
    worst = max(
        (float(np.linalg.norm(grads[k] - ref_grads[k]) / max(np.linalg.norm(ref_grads[k]), 1e-30)), k) for k in grads
    )
    print(f"cuda packed vs separate {name} {attn}: token loss {loss_diff:.2e}, grad_rel {worst[0]:.2e} ({worst[1]})")
    assert loss_diff <= TOKEN_LOSS_ABS, (name, attn, loss_diff)
    assert abs(loss - ref_loss) <= LOSS_REL * abs(ref_loss), (name, attn, loss, ref_loss)
    assert worst[0] <= GRAD_REL, (name, attn, worst)


# --------------------------------------------------------------------------------------
# The grouped MoE kernel on CUDA
# --------------------------------------------------------------------------------------

H, E, K, I, T = 256, 8, 2, 128, 512


def _moe_block(family: str) -> torch.nn.Module:
    """A standalone bfloat16 MoE block on CUDA, weights N(0, 0.05)."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if family == "qwen3_moe":
        block = Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I)
        )
    elif family == "mixtral":
        block = MixtralSparseMoeBlock(
            MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K, intermediate_size=I)
        )
    else:
        block = GptOssMLP(
            GptOssConfig(
                hidden_size=H, num_local_experts=E, num_experts_per_tok=K, intermediate_size=I, swiglu_limit=1.0
            )
        )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return block.to(device="cuda", dtype=torch.bfloat16)


def _moe_forward_backward(block, implementation: str) -> dict[str, np.ndarray]:
    register_experts()
    block.experts.config._experts_implementation = implementation
    block.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(1, T, H, generator=generator).to("cuda", torch.bfloat16).requires_grad_(True)
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y
    r = torch.randn(y.shape, generator=generator).to("cuda", torch.bfloat16)
    (y * r).sum().backward()
    out = {"y": y.detach().float()[0].cpu().numpy(), "x": x.grad.float()[0].cpu().numpy()}
    return out | {n: p.grad.float().cpu().numpy() for n, p in block.named_parameters()}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_cuda_bf16_grouped_experts_equal_the_eager_loop(family):
    block = _moe_block(family)
    eager = _moe_forward_backward(block, "eager")
    ours = _moe_forward_backward(block, EXPERTS_HF_NAME)
    bound = tol("bfloat16", "grad_rel")
    worst = {name: _rel(ours[name], eager[name]) for name in eager}
    print(f"cuda bf16 {family}: " + ", ".join(f"{n} {v:.1e}" for n, v in worst.items()))
    assert ours.keys() == eager.keys() and all(v <= bound for v in worst.values()), worst
    # the control: experts 0 and 1 swapped in our run alone
    with torch.no_grad():
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            p[[0, 1]] = p[[1, 0]].clone()
    swapped = _moe_forward_backward(block, EXPERTS_HF_NAME)
    assert _rel(swapped["y"], eager["y"]) > 4 * bound
