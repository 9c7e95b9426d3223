"""Torch KTO (``torch_backend.kto``) against the float64 numpy reference, on the tiny model.

Invariants:
- the loss and per-row losses equal ``common.objectives.kto.kto_loss`` fed the sequence log-probs of the model's own
  full logits (numpy), for both loss types, padded and padding-free;
- padded and padding-free batches give the same loss and gradients;
- the KL estimate carries no gradient: the gradient equals that of the loss with z replaced by its value;
- without the KL term ('apo_zero_unpaired') two micro-batches normalised by the step's rows add up to the full
  batch's loss and gradients;
- precomputed reference columns equal the live frozen copy's log-probs.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.data.preference_batching import sequence_logps_from_logits  # noqa: E402
from twinseq.common.data.unpaired import KL_FIELD, collate_unpaired  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.objectives.kto import kto_loss, validate_kto_config  # noqa: E402
from twinseq.torch_backend import kto as tkto  # noqa: E402
from twinseq.torch_backend.dpo import frozen_reference  # noqa: E402
from twinseq.torch_backend.model import build_model, logits  # noqa: E402

LENGTHS = ((5, 7), (3, 9), (8, 2), (4, 5), (6, 3), (2, 4))
LABELS = (True, False, False, True, True, False)


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny")
    return cfg, init_weights(cfg, seed=0)


def _examples(vocab_size: int, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = [
        {
            "prompt_input_ids": rng.integers(3, vocab_size, p).tolist(),
            "completion_input_ids": rng.integers(3, vocab_size, c).tolist(),
            "label": lab,
        }
        for (p, c), lab in zip(LENGTHS, LABELS)
    ]
    for i, row in enumerate(rows):  # the rotation of add_kl_completions over one block
        row[KL_FIELD] = rows[i - 1]["completion_input_ids"]
    return rows


def _grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().double().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _run(model, kb, config, ref_D, **kw):
    model.zero_grad(set_to_none=True)
    out = tkto.kto_forward(model, kb, config, ref_logps_D=torch.as_tensor(ref_D, dtype=torch.float32), **kw)
    out.loss.backward()
    return out, _grads(model)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_the_loss_equals_the_numpy_reference(tiny, loss_type, padding_free):
    cfg, weights = tiny
    model = build_model(cfg, weights)
    config = validate_kto_config(loss_type, beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)
    kb = collate_unpaired(_examples(cfg.vocab_size), with_kl=config.uses_kl, padding_free=padding_free)
    main, mismatched = sequence_logps_from_logits(logits(model, kb.batch), kb)
    ref_D = np.concatenate([main + np.linspace(-1.0, 1.0, main.size), mismatched - 0.8])
    want = kto_loss(
        main,
        ref_D[: main.size],
        kb.labels,
        policy_kl_logps=mismatched,
        ref_kl_logps=ref_D[main.size :],
        loss_type=loss_type,
        beta=0.5,
        desirable_weight=1.3,
        undesirable_weight=0.7,
    )
    if config.uses_kl:
        assert want.kl > 0.1  # the estimate is exercised, not clamped away
    out, _ = _run(model, kb, config, ref_D, loss_type="fused_linear", chunk_size=4)
    np.testing.assert_allclose(out.losses.detach().double().numpy(), want.losses, rtol=0, atol=1e-6)
    assert out.kl == pytest.approx(want.kl, abs=1e-5)
    assert float(out.loss.detach()) == pytest.approx(want.loss, abs=1e-6)


def test_padded_and_padding_free_give_the_same_loss_and_gradients(tiny):
    cfg, weights = tiny
    model = build_model(cfg, weights)
    config = validate_kto_config("kto", beta=0.5)
    kb = collate_unpaired(_examples(cfg.vocab_size), with_kl=True)
    ref_D = np.full(kb.num_docs, -60.0)
    out_p, g_p = _run(model, kb, config, ref_D)
    out_f, g_f = _run(
        model, collate_unpaired(_examples(cfg.vocab_size), with_kl=True, padding_free=True), config, ref_D
    )
    assert float(out_f.loss.detach()) == pytest.approx(float(out_p.loss.detach()), rel=1e-6)
    assert max(_rel(g_f[k], g_p[k]) for k in g_p) <= 1e-5


def test_the_kl_estimate_carries_no_gradient(tiny):
    """The same gradient as a loss whose z is a constant: the mismatched documents only set its value."""
    cfg, weights = tiny
    model = build_model(cfg, weights)
    config = validate_kto_config("kto", beta=0.5)
    examples = _examples(cfg.vocab_size)
    kb = collate_unpaired(examples, with_kl=True)
    ref_D = np.full(kb.num_docs, -60.0)
    out, grads = _run(model, kb, config, ref_D)
    assert out.kl > 0
    # the same z, as a constant: the policy's completions alone, and the family evaluated with the stored value
    alone = collate_unpaired(examples, with_kl=False)
    model.zero_grad(set_to_none=True)
    hidden = tkto.forward_hidden(model, alone.batch, None)
    logps = tkto.sequence_logps(hidden, tkto.lm_head_weight(model), alone, "fused_linear", 256, logit_softcap=None)
    labels = torch.as_tensor(alone.labels).double()
    losses, _ = tkto.kto_family(logps.double() + 60.0, labels, out.kl, config, tkto.TORCH_OPS)
    (losses.sum() / len(examples)).backward()
    constant = _grads(model)
    assert max(_rel(grads[k], constant[k]) for k in constant) <= 1e-5
    # negative control: a z that followed the mismatched documents' gradient would differ
    model.zero_grad(set_to_none=True)
    hidden = tkto.forward_hidden(model, kb.batch, None)
    logps_D = tkto.sequence_logps(hidden, tkto.lm_head_weight(model), kb, "fused_linear", 256, logit_softcap=None)
    n = len(examples)
    z = torch.clamp((logps_D[n:] + 60.0).mean(), min=0)
    live, _ = tkto.kto_family(logps_D[:n] + 60.0, labels.float(), z, config, tkto.TORCH_OPS)
    (live.sum() / n).backward()
    assert max(_rel(_grads(model)[k], constant[k]) for k in constant) > 1e-3


def test_micro_batches_add_up_to_the_full_batch_without_the_kl_term(tiny):
    cfg, weights = tiny
    model = build_model(cfg, weights)
    config = validate_kto_config("apo_zero_unpaired", beta=0.5)
    examples = _examples(cfg.vocab_size)
    full = collate_unpaired(examples, with_kl=False)
    ref_D = np.linspace(-70.0, -50.0, len(examples))
    out, grads = _run(model, full, config, ref_D)
    total_loss, total = 0.0, {k: np.zeros_like(g) for k, g in grads.items()}
    for part in (slice(0, 4), slice(4, 6)):
        micro_out, micro = _run(
            model,
            collate_unpaired(examples[part], with_kl=False),
            config,
            ref_D[part],
            num_examples_in_step=len(examples),
        )
        total_loss += float(micro_out.loss.detach())
        total = {k: total[k] + micro[k] for k in total}
    assert total_loss == pytest.approx(float(out.loss.detach()), rel=1e-6)
    assert max(_rel(total[k], grads[k]) for k in grads) <= 1e-5


def test_precomputed_reference_columns_equal_the_live_copy(tiny):
    cfg, weights = tiny
    model = build_model(cfg, weights)
    examples = _examples(cfg.vocab_size)
    from datasets import Dataset

    rows = Dataset.from_list(examples)
    train_cfg = TrainConfig.from_flat(
        task="kto", per_device_train_batch_size=4, padding_free=True, loss_type="fused_linear"
    )
    ref = frozen_reference(model)
    with_ref = tkto.precompute_kto_ref_logps(ref, rows, train_cfg, pad_token_id=0)
    live = tkto.reference_logps_D(ref, collate_unpaired(examples, with_kl=True), loss_type="nll").numpy()
    n = len(examples)
    np.testing.assert_allclose(with_ref["ref_logps"], live[:n], rtol=0, atol=2e-5)
    np.testing.assert_allclose(with_ref["ref_KL_logps"], live[n:], rtol=0, atol=2e-5)
    kb = collate_unpaired(with_ref.to_list(), with_kl=True)  # the batch carries them; the loss reads them
    out = tkto.kto_forward(model, kb, validate_kto_config("kto", 0.1))
    assert abs(float(out.loss.detach()) - 0.5) < 1e-4  # the policy is its reference: r = 0, z = 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_liger_kto_equals_the_fused_path(tiny, device):
    """Liger's fused KTO loss (``loss_type='liger'``; its chunked loss is plain torch, so it runs on CPU too) gives
    twinseq's loss, per-row outputs, KL estimate and gradients on the same micro-batch and reference; a wrong KL
    (the negative control) moves the loss."""
    pytest.importorskip("liger_kernel")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from twinseq.torch_backend.attention import forward_hidden

    cfg, weights = tiny
    model = build_model(cfg, weights, device=device)
    ref = frozen_reference(model)
    kb = collate_unpaired(_examples(cfg.vocab_size), with_kl=True)
    # move the policy away from the reference: up the mismatched pairs (a KL estimate above 0), and at random
    from twinseq.torch_backend.logprobs import sequence_logps

    (-sequence_logps(forward_hidden(model, kb.batch), model.lm_head.weight, kb)[kb.num_examples:].sum()).backward()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.sub_(0.02 * p.grad + 0.02 * torch.randn(p.shape, generator=gen).to(device))
    model.zero_grad(set_to_none=True)
    config = validate_kto_config("kto", beta=0.1)
    with torch.no_grad():
        ref_hidden = forward_hidden(ref, kb.batch)
        ref_D = tkto.reference_logps_D(ref, kb)
    want, want_grads = _run(model, kb, config, ref_D.cpu().numpy(), num_examples_in_step=8)
    assert want.kl > 1e-4
    model.zero_grad(set_to_none=True)
    got = tkto.liger_kto_forward(model, ref_hidden, ref.lm_head.weight, kb, config, num_examples_in_step=8)
    got.loss.backward()
    got_grads = _grads(model)
    assert abs(float(got.loss) - float(want.loss)) <= 1e-5 * abs(float(want.loss))
    assert got.kl == pytest.approx(want.kl, rel=1e-6)
    np.testing.assert_allclose(got.rewards.cpu().numpy(), want.rewards.cpu().numpy(), rtol=1e-5, atol=1e-7)
    for name, g in want_grads.items():
        assert _rel(got_grads[name], g) <= 1e-4, name
    with torch.no_grad():  # negative control: the KL estimate left out
        wrong = tkto.liger_kto_loss(forward_hidden(model, kb.batch), model.lm_head.weight, ref_hidden,
                                    ref.lm_head.weight, kb, config, 0.0, 8)
    assert abs(float(wrong) - float(want.loss)) > 1e-4


def test_liger_kto_refuses_what_it_does_not_compute():
    from twinseq.common.errors import ConfigError

    base = dict(task="kto", model_config="tiny", loss_type="liger")
    for extra, match in [
        (dict(kto_loss_type="apo_zero_unpaired"), "kto_loss_type='apo_zero_unpaired'.*--loss-type fused_linear"),
        (dict(desirable_weight=1.5), "desirable_weight=1.5.*--loss-type fused_linear"),
        (dict(padding_free=True), "needs padded batches.*drop --padding-free"),
        (dict(precompute_ref_log_probs=True), "precompute_ref_log_probs=True.*--loss-type fused_linear"),
    ]:
        with pytest.raises(ConfigError, match=match):
            TrainConfig.from_flat(**base, **extra)
    TrainConfig.from_flat(**base)  # padded 'kto' with unit weights is Liger's


def test_the_liger_trainer_step_equals_the_fused_ones():
    """The trainer's Liger micro-step (reference hidden states, Liger's loss, the metrics' no-grad pass) against the
    fused one: one optimizer step each, same data and weights, built as a run builds them (on CPU here: a run asks
    for CUDA before it builds, ``common.run.capabilities``)."""
    pytest.importorskip("liger_kernel")
    from twinseq.torch_backend.kto import build_kto

    metrics = {}
    for kernel in ("fused_linear", "liger"):
        cfg = TrainConfig.from_yaml("configs/kto.yaml", padding_free=False, loss_type=kernel, max_steps=1,
                                    per_device_train_batch_size=4, gradient_accumulation_steps=2, output_dir="unused")
        trainer, source, _, _ = build_kto(cfg, torch.device("cpu"), None)
        metrics[kernel] = trainer.step(source.next_step())
        metrics[kernel]["weight"] = trainer.causal_lm.model.embed_tokens.weight.detach().double().numpy().copy()
    fused, liger = metrics["fused_linear"], metrics["liger"]
    for key in ("loss", "kl", "rewards/margins", "grad_norm"):
        assert liger[key] == pytest.approx(fused[key], rel=1e-4, abs=1e-7), key
    assert _rel(liger["weight"], fused["weight"]) <= 1e-6
