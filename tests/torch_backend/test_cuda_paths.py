"""CUDA paths against their references, each test body run on "cpu" (CI: proves the test's logic) and on
"cuda" (marked ``gpu``: the GPU lane, ``pytest -m gpu``; skipped without CUDA).

Invariants:
- FlexAttention with ``document_block_mask`` equals SDPA with the dense ``document_mask`` (float32, output
  and, on CUDA, dq/dk/dv), eager and under ``torch.compile``, plain and within a sliding window; the block
  mask skips blocks, and the dense mask is not plain causal attention on these rows (a leak would show).
- A training step's loss and gradients under bfloat16 autocast (float32 parameters, bf16 matmuls) equal the
  float32 step within the committed bfloat16 rows of ``parity_tests/tolerances.py``.
- FSDP2 in one process (a one-rank group: gloo on CPU, NCCL on CUDA) trains like the plain model: per-step
  loss and pre-clip gradient norm within ``adamw_rel``, final parameters within ``adamw_rel``; with
  ``dtype=bfloat16`` (on CUDA: bf16 parameters in compute, fp32 reduction) the first step within the bf16 rows.
- ``twinseq train`` on CUDA (gpu only) with Liger, offloading and bf16 on: a run resumed from its step-4
  checkpoint logs the uninterrupted run's losses within ``adamw_rel``.
- twinseq's Triton linear cross-entropy (``loss_type="triton"``), compiled with its GPU tiles on shapes ragged
  against every tile, equals float64 autograd within the float32 rows (on CPU: Triton's interpreter).

The other CUDA paths have their gpu tests next to their CPU ones: Liger and the chunked losses
(test_losses.py), activation offloading (test_offload.py), ZeRO-3 (test_zero3.py), ``torch_compile``
(tests/test_memory_knobs.py), the flash/flex/varlen model paths (test_attention.py), JAX
(tests/jax_backend/test_jax_gpu_attention.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity_tests.inputs import rel_norm  # noqa: E402
from parity_tests.tolerances import bf16_ulp, tol  # noqa: E402
from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.torch_backend import attention as A  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LENGTHS = (7, 23, 5, 40, 12, 64, 31)


@pytest.fixture
def ieee_fp32():
    """float32 parity needs true float32 matmuls on CUDA (no TF32), restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _docs(vocab_size: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(3, vocab_size, n).tolist()} for n in LENGTHS]


# --------------------------------------------------------------------------------------
# FlexAttention's BlockMask vs the dense document mask
# --------------------------------------------------------------------------------------

FLEX_TOL = 1e-5
"""max |flex - dense| of the attention output and of dq, dk, dv (float32). Each output is a convex
combination of at most 64 value rows (|v| < 5); the two kernels sum in other orders and FlexAttention
uses exp2 with a pre-scaled log2(e): a few float32 ulps (1e-6 at 5) per term, far below 1e-5. A key
leaking across a document or a window moves outputs by O(0.1) (the check below)."""


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("device", DEVICES)
def test_flex_block_mask_equals_the_dense_document_mask(device, compiled, window, ieee_fp32):
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    train = device == "cuda"  # torch has no FlexAttention backward on CPU
    batch = collate(_docs(512), padding_free=True, pad_to_multiple_of=128)  # 182 tokens -> T = 256, 2 rows of blocks
    seg = torch.as_tensor(batch.segment_ids, dtype=torch.long, device=device)
    pos = torch.as_tensor(batch.position_ids, dtype=torch.long, device=device)
    B, T = seg.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, n, T, 16, generator=gen).to(device) for n in (4, 2, 2, 4))
    for x in (q, k, v):
        x.requires_grad_(train)

    def run(attend):
        out = attend(q, k, v)
        if not train:
            return (out.detach(),)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    mask = A.document_mask(seg, pos, torch.float32, window)
    want = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    block_mask = A.document_block_mask(seg, pos, window)
    if compiled:
        # flex_attention compiled earlier in the process (HF's flex path, the window=None case) would recompile with
        # dynamic shapes, which inductor's CPU flex template fails to build in torch 2.13 (a torch bug, see
        # test_attention.py); static shapes from a clean dynamo cache compile per shape
        torch._dynamo.reset()
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False) if compiled else flex_attention
    with torch.no_grad() if not train else torch.enable_grad():
        got = run(lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True))
    for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
        err = float((w - g).abs().max())
        print(f"flex {device} {'compiled' if compiled else 'eager'} window={window}: {name} {err:.2e}")
        assert err <= FLEX_TOL, (name, err)
    assert block_mask.sparsity() > 0, "the block mask must skip blocks outside the documents"
    causal = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True, enable_gqa=True)
    assert float((causal - want[0]).abs().max()) > 1e4 * FLEX_TOL, "plain causal attention must differ here"


# --------------------------------------------------------------------------------------
# bfloat16 autocast vs float32: one training step's loss and gradients
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_step_is_within_the_bf16_rows_of_fp32(device, attn, ieee_fp32):
    """Float32 parameters, bf16 compute under ``torch.autocast`` (what ``dtype=bfloat16`` trains with) against
    the float32 step. Bounds: the bfloat16 table (TOLERANCES.md): the mean loss moves at most as much as a
    per-token NLL, ``token_loss_ulps`` bf16 ulps at the largest |logit|; gradients ``grad_rel`` per tensor."""
    from twinseq.torch_backend.model import build_model, compute_loss

    cfg = ModelConfig.preset("tiny", vocab_size=512)
    model = build_model(cfg, init_weights(cfg, seed=0), attn_implementation=attn, device=device)
    batch = collate(_docs(cfg.vocab_size), padding_free=True, pad_to_multiple_of=64)

    def step(bf16: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            loss = compute_loss(model, batch, "nll")
        loss.backward()
        grads = {n: p.grad.double().cpu().numpy() for n, p in model.named_parameters()}
        return float(loss.detach()), grads

    from twinseq.torch_backend.model import logits

    max_logit = float(np.abs(logits(model, batch)).max())
    want_loss, want_grads = step(False)
    got_loss, got_grads = step(True)
    assert all(g.dtype == np.float64 for g in got_grads.values())
    loss_err = abs(got_loss - want_loss)
    rel = {n: rel_norm(got_grads[n], want_grads[n]) for n in want_grads}
    worst = max(rel, key=rel.get)
    ulp = bf16_ulp(max_logit)
    print(f"bf16 autocast {device} {attn}: loss {want_loss:.5f} vs {got_loss:.5f} (|d| {loss_err:.2e}, "
          f"{loss_err / ulp:.2f} ulps at |logit| {max_logit:.2f}); worst grad rel {rel[worst]:.2e} ({worst})")
    assert loss_err <= tol("bfloat16", "token_loss_ulps") * ulp
    assert rel[worst] <= tol("bfloat16", "grad_rel"), worst
    assert loss_err > 0 and rel[worst] > tol("float32", "grad_rel"), "autocast must have computed in bf16"


# --------------------------------------------------------------------------------------
# FSDP2 on one rank
# --------------------------------------------------------------------------------------

FSDP_STEPS = 3


def _steps(trainer, cfg, device):
    from twinseq.common.data.sft_steps import StepIterator

    iterator = StepIterator(W.synthetic_rows(seed=0), cfg, pad_token_id=0)
    out = [trainer.step(iterator.next_step()) for _ in range(FSDP_STEPS)]
    return [o["loss"] for o in out], [o["grad_norm"] for o in out]


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_on_one_rank_trains_like_the_plain_model(device, ieee_fp32, monkeypatch):
    import torch.distributed as dist

    from twinseq.torch_backend.distributed import full_model_state, init_runtime
    from twinseq.torch_backend.parallel import parallelize
    from twinseq.torch_backend.trainer import SFTTrainer

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    if device == "cpu":  # init_runtime picks CUDA whenever it exists
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = dict(max_steps=FSDP_STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_grad_norm=0.5)
    cfg = W.make_config(**base)
    torch.manual_seed(0)
    plain = SFTTrainer(cfg, parallelize(W._model(cfg).to(device), None, cfg), torch.device(device))
    want_losses, want_norms = _steps(plain, cfg, device)
    want_params = {k: v.detach().double().cpu().numpy() for k, v in plain.causal_lm.state_dict().items()}

    fsdp_cfg = W.make_config(**base, fsdp=True)
    runtime = init_runtime(fsdp_cfg, env={"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})
    try:
        assert runtime.device.type == device and dist.get_backend() == ("nccl" if device == "cuda" else "gloo")
        trainer = W._trainer(fsdp_cfg, runtime)
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(trainer.module, FSDPModule)
        assert all(isinstance(layer, FSDPModule) for layer in trainer.causal_lm.model.layers)
        got_losses, got_norms = _steps(trainer, fsdp_cfg, device)
        got_params = {k: v.double().cpu().numpy() for k, v in full_model_state(trainer.module).items()}
    finally:
        dist.destroy_process_group()
    bound = tol("float32", "adamw_rel")
    print(f"fsdp2 {device}: losses {got_losses} vs {want_losses}; norms {got_norms} vs {want_norms}")
    for got, want in ((got_losses, want_losses), (got_norms, want_norms)):
        np.testing.assert_allclose(got, want, rtol=bound)
    prefix = "causal_lm."
    got_params = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in got_params.items()}
    rel = {k: rel_norm(got_params[k], want_params[k]) for k in want_params}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= bound, (worst, rel[worst])
    assert want_losses[-1] < want_losses[0], "the steps must train"


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_bf16_mixed_precision_on_one_rank_is_within_the_bf16_rows(device, ieee_fp32, monkeypatch):
    """``dtype=bfloat16`` under FSDP2: on CUDA bf16 parameters in compute (``MixedPrecisionPolicy``, fp32
    reduction) plus autocast; on CPU autocast alone. Against the plain trainer's bf16 autocast step (float32
    parameters): the first step's loss within ``token_loss_ulps`` bf16 ulps at the largest |logit| and its
    pre-clip gradient norm within ``grad_rel`` (the bfloat16 rows), every step finite and training."""
    import torch.distributed as dist

    from twinseq.common.data.sft_steps import StepIterator
    from twinseq.torch_backend.model import logits
    from twinseq.torch_backend.distributed import init_runtime
    from twinseq.torch_backend.parallel import parallelize
    from twinseq.torch_backend.trainer import SFTTrainer

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    if device == "cpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = dict(max_steps=FSDP_STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_grad_norm=0.5, dtype="bfloat16")
    cfg = W.make_config(**base)
    first = StepIterator(W.synthetic_rows(seed=0), cfg, pad_token_id=0).next_step()
    with torch.no_grad():
        ref_model = W._model(cfg).to(device)
        max_logit = max(float(np.abs(logits(ref_model, b)).max()) for b in first)
    torch.manual_seed(0)
    plain = SFTTrainer(cfg, parallelize(W._model(cfg).to(device), None, cfg), torch.device(device))
    want_losses, want_norms = _steps(plain, cfg, device)

    fsdp_cfg = W.make_config(**base, fsdp=True)
    runtime = init_runtime(fsdp_cfg, env={"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})
    try:
        trainer = W._trainer(fsdp_cfg, runtime)
        seen = []
        trainer.causal_lm.model.layers[0].mlp.down_proj.register_forward_pre_hook(
            lambda module, args: seen.append(module.weight.dtype))
        got_losses, got_norms = _steps(trainer, fsdp_cfg, device)
    finally:
        dist.destroy_process_group()
    assert set(seen) == {torch.bfloat16 if device == "cuda" else torch.float32}, seen
    ulp = bf16_ulp(max_logit)
    loss_err, norm_rel = abs(got_losses[0] - want_losses[0]), abs(got_norms[0] - want_norms[0]) / want_norms[0]
    print(f"fsdp2 bf16 {device}: first loss {got_losses[0]:.5f} vs {want_losses[0]:.5f} ({loss_err / ulp:.2f} ulps "
          f"at |logit| {max_logit:.2f}); grad norm rel {norm_rel:.2e}; losses {got_losses}")
    assert loss_err <= tol("bfloat16", "token_loss_ulps") * ulp
    assert norm_rel <= tol("bfloat16", "grad_rel")
    assert np.isfinite(got_losses + got_norms).all() and got_losses[-1] < got_losses[0]


# --------------------------------------------------------------------------------------
# `twinseq train` on CUDA with the CUDA features on, stopped and resumed
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
def test_train_on_cuda_with_its_features_resumes_where_it_stopped(tmp_path):
    """``train`` picks CUDA; packing, padding-free varlen attention, Liger's loss (fused_linear without
    liger-kernel), activation offloading on CUDA streams, bf16 autocast. 8 steps straight against 4, a stop and
    4 more from checkpoint-4 (its CUDA RNG state included): every logged loss within ``adamw_rel`` (not bitwise:
    CUDA's atomics sum in any order), the loss falls, the peak memory is the CUDA allocator's. The CPU run of the
    same resume is tests/torch_backend/test_train.py::test_resume_is_bitwise_identical."""
    import importlib.util
    import json
    import shutil

    from twinseq.common.config import TrainConfig
    from twinseq.common.data.corpus import load_embedded
    from twinseq.common.run.report import read_metrics
    from twinseq.torch_backend.recipes import train

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n"
                            for r in load_embedded("embedded-sft").select(range(160))))
    loss_type = "liger" if importlib.util.find_spec("liger_kernel") else "fused_linear"

    def cfg(out, **kw):
        return TrainConfig.from_flat(dataset_name=str(data), model_config="tiny", max_length=96, seed=3,
                                     per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
                                     warmup_steps=2, max_steps=8, save_steps=4, packing=True, padding_free=True,
                                     attn_implementation="varlen", loss_type=loss_type, activation_offloading=True,
                                     dtype="bfloat16", output_dir=str(out), disable_tqdm=True, **kw)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torch.cuda.reset_peak_memory_stats()
    train(cfg(straight))
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-4", resumed / "checkpoint-4")
    lines = (straight / "metrics.jsonl").read_text().splitlines()[:4]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    train(cfg(resumed, resume_from_checkpoint=str(resumed / "checkpoint-4")))
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 9))
    la, lb = np.array([r["loss"] for r in a]), np.array([r["loss"] for r in b])
    print(f"train on cuda ({loss_type}): straight {la.tolist()}; resumed {lb.tolist()}; "
          f"peak {a[-1]['peak_memory_bytes'] / 2**20:.0f} MiB")
    np.testing.assert_allclose(lb, la, rtol=tol("float32", "adamw_rel"))
    assert la[-1] < la[0]
    assert 0 < a[-1]["peak_memory_bytes"] <= torch.cuda.max_memory_allocated()


# --------------------------------------------------------------------------------------
# twinseq's Triton linear cross-entropy, compiled, on ragged shapes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("device", DEVICES)
def test_triton_kernel_fp32_matches_fp64_autograd_on_ragged_shapes(device, cap, ieee_fp32, monkeypatch):
    """``triton_ce.linear_logps`` in float32 (compiled on CUDA with its GPU tiles; on CPU under Triton's
    interpreter with small tiles) against float64 autograd of the naive equivalent: every dimension ragged
    against the tiles, ignored rows, a soft-cap, entropy. Bounds: the float32 rows (log-probs 1e-6 relative to
    the largest, entropy and gradients 1e-5 relative), as tests/torch_backend/test_triton_ce.py holds the
    interpreter to; argmax hits exactly."""
    pytest.importorskip("triton")
    from twinseq.torch_backend import triton_ce

    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        if triton_ce.kernel_mode(torch.device("cpu")) != "interpret":
            pytest.skip("triton was imported before TRITON_INTERPRET=1 (set by the root conftest.py without a GPU)")
    n, V, D = (37, 101, 40) if device == "cpu" else (1000, 5003, 72)  # GPU tiles: 64 rows, 128 words, 64 dims
    gen = torch.Generator().manual_seed(0)
    h64 = torch.randn(n, D, generator=gen, dtype=torch.float64)
    w64 = torch.randn(V, D, generator=gen, dtype=torch.float64) * D ** -0.5 * 2.0
    targets = torch.randint(0, V, (n,), generator=gen)
    targets[::7] = -100
    g_logp, g_ent = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2))

    h, w = h64.detach().clone().requires_grad_(), w64.detach().clone().requires_grad_()
    z = h @ w.T
    z = z if cap is None else torch.tanh(z / cap) * cap
    logp_all = torch.log_softmax(z, -1)
    valid = targets != -100
    want_logp = torch.where(valid, logp_all.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    want_ent = -(logp_all.exp() * logp_all).sum(-1)
    (want_logp * g_logp + torch.where(valid, want_ent, 0.0) * g_ent).sum().backward()
    want_hit = (z.argmax(-1) == targets) & valid

    hk = h64.float().to(device).requires_grad_()
    wk = w64.float().to(device).requires_grad_()
    logp, ent, hit = triton_ce.linear_logps(hk, wk, targets.to(device), logit_softcap=cap, with_entropy=True)
    (logp * g_logp.float().to(device) + ent * g_ent.float().to(device)).sum().backward()

    def rel(a, b):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        return float((a - b).abs().max() / b.abs().max())

    errs = {"logp": rel(logp, want_logp), "entropy": rel(ent.cpu()[valid], want_ent[valid]),
            "dh": rel(hk.grad, h.grad), "dw": rel(wk.grad, w.grad)}
    print(f"triton {device} cap={cap} n={n} V={V} D={D}: {errs}")
    assert errs["logp"] <= 1e-6 and errs["entropy"] <= 1e-5, errs
    assert errs["dh"] <= 1e-5 and errs["dw"] <= 1e-5, errs
    assert torch.equal(hit.bool().cpu(), want_hit)
    assert (logp.detach().cpu()[~valid] == 0).all() and (hk.grad.cpu()[~valid] == 0).all()
