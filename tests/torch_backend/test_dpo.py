"""Torch DPO: log-prob kernels, the loss family, the reference model and the trainer.

Invariants:
- the fused log-prob Function equals autograd through ``log_softmax`` (float64: to rounding),
  and the three kernels give the same sequence log-probs and DPO gradients (float32: 1e-5);
- every loss type's value and gradient equal the float64 numpy reference (``common.objectives.dpo``);
- micro-batches normalised by the step's pairs add up to the full batch;
- precomputed reference log-probs equal the live frozen copy's, and the copy never trains;
- invalid combinations raise before any work; ``twinseq train --task dpo`` runs and logs
  TRL's reward metrics, and on the embedded preference data ``rewards/accuracies`` rises.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.objectives.dpo import DPO_LOSS_TYPES, dpo_loss, validate_dpo_config  # noqa: E402
from twinseq.common.data.preference_batching import collate_preference, sequence_logps_from_logits  # noqa: E402
from twinseq.common.data.preference_steps import iter_preference_batches, preference_columns  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.torch_backend import dpo as tdpo  # noqa: E402
from twinseq.torch_backend import logprobs as tlp  # noqa: E402
from twinseq.torch_backend.model import build_model, logits  # noqa: E402

LENGTHS = ((5, 7, 4), (3, 9, 6), (8, 2, 5), (4, 5, 10))


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads stall on barriers (7 s vs
    0.4 s per DPO micro-batch, measured), and the summation order no longer depends on the cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny")
    return cfg, init_weights(cfg, seed=0)


def _examples(vocab_size: int, lengths=LENGTHS, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_input_ids": rng.integers(3, vocab_size, p).tolist(),
             "chosen_input_ids": rng.integers(3, vocab_size, c).tolist(),
             "rejected_input_ids": rng.integers(3, vocab_size, r).tolist()} for p, c, r in lengths]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------------------
# Log-prob kernels
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_fused_logps_equal_autograd_log_softmax_in_float64(chunk_size):
    """Output and both input gradients of ``FusedLinearTokenLogps`` vs the naive expression."""
    gen = torch.Generator().manual_seed(0)
    n, h, v = 11, 8, 37
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)
    naive = torch.log_softmax(hidden @ weight.T, -1)[torch.arange(n), targets]
    g_naive = torch.autograd.grad(naive, (hidden, weight), upstream)
    fused = tlp.FusedLinearTokenLogps.apply(hidden, weight, targets, chunk_size)
    g_fused = torch.autograd.grad(fused, (hidden, weight), upstream)
    torch.testing.assert_close(fused, naive, rtol=1e-13, atol=1e-13)
    for a, b in zip(g_fused, g_naive):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("padding_free", [False, True])
def test_kernels_agree_on_logps_and_dpo_gradients(tiny, padding_free):
    """chunked_nll and fused_linear equal the full-logits kernel (1e-5), which equals numpy on the
    model's own logits; the DPO gradients of the three kernels agree per tensor (1e-5)."""
    cfg, weights = tiny
    model = build_model(cfg, weights)
    pb = collate_preference(_examples(cfg.vocab_size), padding_free=padding_free)
    np_c, np_r = sequence_logps_from_logits(logits(model, pb.batch), pb)
    config = validate_dpo_config(["sigmoid", "ipo"], [1.0, 0.5], beta=0.5)
    ref_c, ref_r = np_c + 0.7, np_r - 0.4
    results = {}
    # ``triton`` is left to tests/torch_backend/test_triton_ce.py (its DPO log-probs against fused_linear at a
    # vocabulary the CPU interpreter runs in a second; here, at the tiny preset's, it took a minute per case)
    for kernel in (k for k in tlp.LOGPS_LOSS_TYPES if k != "triton"):
        c, r = tdpo.compute_sequence_logps(model, pb, loss_type=kernel, chunk_size=4)
        np.testing.assert_allclose(c, np_c, rtol=0, atol=1e-5)
        np.testing.assert_allclose(r, np_r, rtol=0, atol=1e-5)
        results[kernel] = tdpo.dpo_loss_and_grads(model, pb, config, ref_chosen_logps=ref_c,
                                                  ref_rejected_logps=ref_r, loss_type=kernel, chunk_size=4)
    full_loss, full_grads, _ = results["nll"]
    for kernel in ("chunked_nll", "fused_linear"):
        loss, grads, _ = results[kernel]
        assert abs(loss - full_loss) <= 1e-6 * abs(full_loss)
        assert max(_rel(grads[k], full_grads[k]) for k in full_grads) <= 1e-5


def test_fused_kernel_under_bf16_autocast_matches_the_checkpointed_one(tiny):
    """Under CPU bf16 autocast the fused Function's backward (run outside autocast) still multiplies
    in bf16: same log-probs as the checkpointed chunks (same bf16 matmuls), gradients equal up to
    where each path rounds to bf16 (4 u = 2^-6 relative per tensor, u = 2^-8)."""
    cfg, weights = tiny
    model = build_model(cfg, weights)
    pb = collate_preference(_examples(cfg.vocab_size))
    c, r = tdpo.compute_sequence_logps(model, pb)
    config = validate_dpo_config("sigmoid", beta=0.5)
    out = {}
    for kernel in ("chunked_nll", "fused_linear"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[kernel] = tdpo.dpo_loss_and_grads(model, pb, config, ref_chosen_logps=c + 0.5,
                                                  ref_rejected_logps=r - 0.5, loss_type=kernel, chunk_size=4)
    (_, g_chunk, p_chunk), (_, g_fused, p_fused) = out["chunked_nll"], out["fused_linear"]
    np.testing.assert_allclose(p_fused["chosen_logps"], p_chunk["chosen_logps"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(p_fused["rejected_logps"], p_chunk["rejected_logps"], rtol=0, atol=1e-6)
    assert max(_rel(g_fused[k], g_chunk[k]) for k in g_chunk) <= 2.0 ** -6
    assert all(g.dtype == np.float32 for g in g_fused.values())


def test_sequence_logps_check_their_inputs(tiny):
    cfg, _ = tiny
    pb = collate_preference(_examples(cfg.vocab_size))
    hidden = torch.zeros(*pb.batch.shape, 4)
    with pytest.raises(ValueError, match="loss_type='liger'"):
        tlp.sequence_logps(hidden, torch.zeros(cfg.vocab_size, 4), pb, loss_type="liger")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tlp.sequence_logps(hidden, torch.zeros(100, 4), pb)


# --------------------------------------------------------------------------------------
# The loss family
# --------------------------------------------------------------------------------------


def _family_case(loss_type: str, beta: float):
    rng = np.random.default_rng(1)
    pc, pr = rng.normal(-40, 5, 6), rng.normal(-40, 5, 6)
    rc, rr = pc + rng.normal(0, 2, 6), pr + rng.normal(0, 2, 6)
    counts = rng.integers(1, 20, (2, 6)).astype(np.float64)
    types = list(DPO_LOSS_TYPES) if loss_type == "combined" else [loss_type]
    kwargs = dict(loss_type=types, beta=beta, loss_weights=np.linspace(1.0, 0.1, len(types)).tolist(),
                  label_smoothing=0.2 if {"robust", "exo_pair"} & set(types) else 0.0)
    return (pc, pr, rc, rr), counts, kwargs


@pytest.mark.parametrize("beta", [0.1, 1.0])
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES + ("combined",))
def test_loss_family_value_and_gradient_match_numpy(loss_type, beta):
    """float64 torch vs ``common.objectives.dpo.dpo_loss``: values to rounding, and autograd vs a central
    difference of the numpy loss (step 1e-6: truncation ~1e-12, rounding ~1e-10 relative)."""
    logps, counts, kwargs = _family_case(loss_type, beta)
    config = validate_dpo_config(**kwargs)
    tensors = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in logps]
    losses, cr, rr = tdpo.dpo_losses(*tensors, config, chosen_num_tokens=torch.tensor(counts[0]),
                                     rejected_num_tokens=torch.tensor(counts[1]))
    ref = dpo_loss(*logps, chosen_num_tokens=counts[0], rejected_num_tokens=counts[1], **kwargs)
    np.testing.assert_allclose(losses.detach().numpy(), ref.losses, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cr.detach().numpy(), ref.chosen_rewards, rtol=1e-12)
    np.testing.assert_allclose(rr.detach().numpy(), ref.rejected_rewards, rtol=1e-12)
    # allow_unused: 'sft' reads the chosen completions only; its rejected gradient is 0, as the difference says
    grads = [torch.zeros(6, dtype=torch.float64) if g is None else g
             for g in torch.autograd.grad(losses.mean(), tensors[:2], allow_unused=True)]
    for which in range(2):
        fd = np.zeros(6)
        for i in range(6):
            step = np.zeros(6)
            step[i] = 1e-6
            shifted = [list(logps), list(logps)]
            shifted[0][which], shifted[1][which] = logps[which] + step, logps[which] - step
            up, down = (dpo_loss(*s, chosen_num_tokens=counts[0], rejected_num_tokens=counts[1], **kwargs).loss
                        for s in shifted)
            fd[i] = (up - down) / 2e-6
        np.testing.assert_allclose(grads[which].numpy(), fd, rtol=1e-6, atol=1e-9)


def test_ipo_needs_the_completion_lengths():
    config = validate_dpo_config("ipo")
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="chosen_num_tokens"):
        tdpo.dpo_losses(x, x, x, x, config)


# --------------------------------------------------------------------------------------
# Accumulation and the reference model
# --------------------------------------------------------------------------------------


def test_micro_batches_add_up_to_the_full_batch(tiny):
    """Two micro-batches of 2 pairs, each normalised by the step's 4 pairs, give the loss and the
    gradients of one batch of 4 (a per-micro-batch mean would give twice the gradient)."""
    cfg, weights = tiny
    model = build_model(cfg, weights)
    examples = _examples(cfg.vocab_size)
    config = validate_dpo_config("sigmoid", beta=0.1)
    full = collate_preference(examples)
    ref_c, ref_r = (a + s for a, s in zip(tdpo.compute_sequence_logps(model, full), (0.5, -0.5)))
    loss, grads, _ = tdpo.dpo_loss_and_grads(model, full, config, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
    total_loss, total = 0.0, {k: np.zeros_like(g) for k, g in grads.items()}
    for part in (slice(0, 2), slice(2, 4)):
        pb = collate_preference(examples[part])
        micro_loss, micro, _ = tdpo.dpo_loss_and_grads(model, pb, config, ref_chosen_logps=ref_c[part],
                                                       ref_rejected_logps=ref_r[part], num_examples_in_step=4)
        total_loss += micro_loss
        total = {k: total[k] + micro[k] for k in total}
    assert abs(total_loss - loss) <= 1e-6 * loss
    assert max(_rel(total[k], grads[k]) for k in grads) <= 1e-5
    with pytest.raises(ValueError, match="num_examples_in_step"):
        tdpo.dpo_loss_and_grads(model, full, config, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r,
                                num_examples_in_step=2)


def test_precomputed_reference_equals_the_live_copy(tiny):
    """One precompute pass (batches of 3, padding-free) stores what the frozen copy computes on the
    training batches (padded, other groupings): equal to float32 rounding of |logp| <= ~100."""
    cfg, weights = tiny
    model = build_model(cfg, weights)
    examples = _examples(cfg.vocab_size, LENGTHS + ((2, 3, 3), (6, 4, 8)), seed=5)
    rows = {k: [ex[k] for ex in examples] for k in examples[0]}
    train_cfg = TrainConfig.from_flat(task="dpo", per_device_train_batch_size=3, padding_free=True, loss_type="fused_linear")
    ref = tdpo.frozen_reference(model)
    with_ref = tdpo.precompute_ref_logps(ref, rows, train_cfg, pad_token_id=0)
    columns = preference_columns(with_ref)
    for idx, pb in iter_preference_batches(rows, 2):
        live_c, live_r = tdpo.reference_logps(ref, pb, loss_type="nll")
        np.testing.assert_allclose(live_c.numpy(), np.take(columns["ref_chosen_logps"], idx), rtol=0, atol=2e-5)
        np.testing.assert_allclose(live_r.numpy(), np.take(columns["ref_rejected_logps"], idx), rtol=0, atol=2e-5)
    # the batch carries the columns, and the loss reads them when no reference is passed
    config = validate_dpo_config("sigmoid")
    pb = collate_preference([{**ex, "ref_chosen_logps": c, "ref_rejected_logps": r} for ex, c, r in
                             zip(examples, columns["ref_chosen_logps"], columns["ref_rejected_logps"])])
    loss, _, pairs = tdpo.dpo_loss_and_grads(model, pb, config)
    # reference == policy: every log-ratio is float32 rounding, so the loss is log 2 to ~1e-6
    assert abs(loss - np.log(2.0)) <= 1e-5 and np.abs(pairs["chosen_rewards"]).max() <= 1e-5


def test_frozen_reference_does_not_train(tiny):
    cfg, weights = tiny
    model = build_model(cfg, weights)
    ref = tdpo.frozen_reference(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    pb = collate_preference(_examples(cfg.vocab_size))
    c, r = tdpo.compute_sequence_logps(ref, pb)
    out = tdpo.dpo_forward(model, pb, validate_dpo_config("sigmoid"), ref_chosen_logps=c - 1, ref_rejected_logps=r)
    out.loss.backward()
    opt.step()
    assert not torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    after_c, after_r = tdpo.compute_sequence_logps(ref, pb)
    assert (after_c == c).all() and (after_r == r).all()


def test_preference_iterator_sees_every_pair_once_per_epoch_and_resumes():
    """The DPO loader (common.data.preference_steps): steps of ga x bs pairs, each pair once per epoch, the
    step's pair count as denominator, and a resumed iterator continuing the same stream."""
    from twinseq.common.data.preference_steps import PreferenceStepIterator

    rows = {"prompt_input_ids": [[1, i] for i in range(10)], "chosen_input_ids": [[100 + i] for i in range(10)],
            "rejected_input_ids": [[200 + i, 7] for i in range(10)]}
    cfg = TrainConfig.from_flat(task="dpo", per_device_train_batch_size=2, gradient_accumulation_steps=1, seed=4)
    it = PreferenceStepIterator(rows, cfg, pad_token_id=0)
    seen = [int(pb.batch.input_ids[d, 2]) - 100 for _ in range(5) for pb in it.next_step() for d in range(2)]
    assert sorted(seen) == list(range(10)) and it.examples_per_step == 2
    state = it.state_dict()
    expected = it.next_step()[0].batch.input_ids
    resumed = PreferenceStepIterator(rows, cfg, pad_token_id=0)
    resumed.load_state_dict(state)
    assert (resumed.next_step()[0].batch.input_ids == expected).all()
    with pytest.raises(ValueError, match="packing=True does not apply to DPO"):
        PreferenceStepIterator(rows, TrainConfig.from_flat(task="dpo", packing=True, max_length=8), pad_token_id=0)
    with pytest.raises(ValueError, match="one value per row"):
        from twinseq.common.data.preference_steps import with_ref_logps

        with_ref_logps(rows, np.zeros(9), np.zeros(10))


# --------------------------------------------------------------------------------------
# Invalid combinations
# --------------------------------------------------------------------------------------


def test_liger_on_cpu_raises_a_clear_error():
    from twinseq.common.run.capabilities import Runtime, check_runtime

    cfg = TrainConfig.from_flat(task="dpo", loss_type="liger")
    with pytest.raises(ValueError, match="Liger's CUDA kernel"):
        check_runtime(cfg, Runtime("torch", "cpu"))
    sigmoid = validate_dpo_config("sigmoid")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        tdpo.check_liger_dpo(sigmoid, padding_free=False, device="cpu")
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(ImportError, match=r"pip install -e '\.\[gpu\]'"):
            tdpo.check_liger_dpo(sigmoid, padding_free=False, device="cuda")


@pytest.mark.parametrize("overrides,match", [
    (dict(padding_free=True), "padded batches"),
    (dict(precompute_ref_log_probs=True), "precompute_ref_log_probs=True is not supported"),
    (dict(dpo_loss_type=["sigmoid", "ipo"]), "'sigmoid' DPO loss only"),
])
def test_liger_configuration_conflicts_raise_on_any_machine(overrides, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flat(task="dpo", loss_type="liger", **overrides)


@pytest.mark.parametrize("overrides,match", [
    ({"packing": True, "max_length": 64}, "packing=True does not apply to DPO"),
    ({"torch_compile": True}, "torch_compile"),
    ({"fsdp": True}, "FSDP"),
    ({"loss_type": "liger", "padding_free": True}, "padded batches"),
])
def test_trainer_refuses_invalid_combinations(overrides, match):
    from twinseq.common.run.capabilities import Runtime, check_runtime

    with pytest.raises(ValueError, match=match):
        check_runtime(TrainConfig.from_flat(task="dpo", **overrides), Runtime("torch", "cpu"))


# --------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_liger_dpo_matches_the_fused_kernel(tiny, device):
    """Liger's chunked DPO loss is plain torch: on CPU (liger-kernel is a test dependency) as on CUDA, it equals
    twinseq's fused path, loss and gradient."""
    pytest.importorskip("liger_kernel")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from twinseq.torch_backend.attention import forward_hidden

    cfg, weights = tiny
    model = build_model(cfg, weights, device=device)
    ref = tdpo.frozen_reference(model)
    pb = collate_preference(_examples(cfg.vocab_size))
    config = validate_dpo_config("sigmoid", beta=0.1)
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy away from the reference so the loss is not log 2
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ref_c, ref_r = tdpo.reference_logps(ref, pb)
    expected, grads, _ = tdpo.dpo_loss_and_grads(model, pb, config, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
    hidden = forward_hidden(model, pb.batch)
    with torch.no_grad():
        ref_hidden = forward_hidden(ref, pb.batch)
    loss = tdpo.liger_dpo_loss(hidden, model.lm_head.weight, ref_hidden, ref.lm_head.weight, pb, config,
                               pb.num_examples)
    loss.backward()
    assert abs(float(loss) - expected) <= 1e-5 * abs(expected)
    liger_grad = model.model.embed_tokens.weight.grad.float().cpu().numpy()
    assert _rel(liger_grad, grads["model.embed_tokens.weight"]) <= 1e-4
