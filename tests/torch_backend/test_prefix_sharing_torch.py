"""Prefix sharing on every PyTorch attention path: a shared batch gives the unshared batch's numbers.

Invariant (``common.data.prefix_sharing``): a GRPO group's completions (or a DPO pair) written after one copy of
their prompt, each attending to it through ``Batch.parent_ids``, give the per-token log-probs of the unshared
batch (1e-6, fp32) and the same parameter gradients (1e-5 relative), on sdpa, eager, flex_attention (forward: no
CPU backward), varlen and the blocked attention, padded and padding-free, with a sliding window that bites
(Mistral) and soft-capped scores (Gemma 2). Negative control: the shared batch with ``parent_ids`` zeroed (the
completions blind to their prompt) gives clearly different log-probs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from twinseq.common.config import ModelConfig
from twinseq.common.data.preference_batching import collate_preference
from twinseq.common.errors import ConfigError
from twinseq.common.models.init import init_weights
from twinseq.common.objectives.grpo import collate_completions
from twinseq.torch_backend import attention as A
from twinseq.torch_backend import blocked_attention as BA
from twinseq.torch_backend.attention import forward_hidden
from twinseq.torch_backend.context_parallel import shard_for_rank
from twinseq.torch_backend.grpo import completion_logps
from twinseq.torch_backend.logprobs import sequence_logps
from twinseq.torch_backend.model import build_model
from twinseq.torch_backend.unwrap import lm_head_weight

# fp32 log-probs near -9.5 are spaced 9.5e-7 apart: 1e-6 per unit of |log-prob| is one or two roundings; float64
# shows that nothing but rounding separates the paths (LOGP_ABS_F64), except where the softmax itself runs in fp32
# (transformers' eager attention and the soft-capped scores: ``softmax(..., dtype=float32)``)
LOGP_REL, GRAD_REL, LOGP_ABS_F64 = 1e-6, 1e-5, 1e-12
PROMPT_LENGTHS, GROUP_SIZES = (9, 14), (3, 4)
BLOCK = 8  # blocked path: blocks of 8 tokens, taken from 8-token rows on, so every batch here runs it
# model name -> (preset, overrides, paths); "blocked" is sdpa (eager for Gemma 2) past BLOCKED_MIN_SEQ_LEN
MODELS = {
    "llama": ("tiny", {}, ("sdpa", "eager", "varlen", "blocked")),
    "mistral-window-6": ("tiny-mistral", {"sliding_window": 6}, ("sdpa", "varlen", "blocked")),
    "gemma2": ("tiny-gemma2", {}, ("eager", "varlen", "blocked")),
}
CASES = [(m, attn) for m, (_, _, paths) in MODELS.items() for attn in paths]


def _groups(vocab_size: int):
    rng = np.random.default_rng(7)
    prompts, completions = [], []
    for P, G in zip(PROMPT_LENGTHS, GROUP_SIZES):
        prompt = rng.integers(3, vocab_size, P).tolist()
        for _ in range(G):
            prompts.append(prompt)
            completions.append(rng.integers(3, vocab_size, int(rng.integers(2, 12))).tolist())
    return prompts, completions


@pytest.fixture(scope="module")
def models():
    """name -> (ModelConfig, weights), built on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            preset, overrides, _ = MODELS[name]
            cfg = ModelConfig.preset(preset, **overrides)
            cache[name] = cfg, init_weights(cfg, seed=0)
        return cache[name]

    return get


def _model(cfg, weights, attn: str, monkeypatch):
    torch.manual_seed(0)
    dense = "eager" if cfg.model_type == "gemma2" else "sdpa"
    model = build_model(cfg, weights, attn_implementation=dense if attn == "blocked" else attn)
    if attn == "blocked":
        BA.set_attention_block_size(model, BLOCK)
        monkeypatch.setattr(BA, "BLOCKED_MIN_SEQ_LEN", BLOCK)
    return model, (None if attn == "blocked" else attn)


def _logps_and_grads(model, cb, attn, weights_NC):
    model.zero_grad(set_to_none=True)
    logps_NC, _ = completion_logps(model, cb, attn_implementation=attn)
    (logps_NC * weights_NC).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps_NC.detach(), grads


def _max_grad_rel(got: dict, want: dict) -> tuple[float, str]:
    assert got.keys() == want.keys()
    errs = {n: float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)) for n in want}
    name = max(errs, key=errs.get)
    return errs[name], name


def _orphaned(cb):
    """The same shared batch with every parent cut: completions no longer see their prompt."""
    batch = dataclasses.replace(cb.batch, parent_ids=np.zeros_like(cb.batch.parent_ids))
    return dataclasses.replace(cb, batch=batch)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
@pytest.mark.parametrize("name,attn", CASES)
def test_shared_prefix_logps_and_grads_equal_unshared(models, name, attn, padding_free, monkeypatch):
    cfg, weights = models(name)
    prompts, completions = _groups(cfg.vocab_size)
    plain = collate_completions(prompts, completions, padding_free=padding_free)
    shared = collate_completions(prompts, completions, padding_free=padding_free, share_prefix=True)
    assert shared.batch.shares_prefix and shared.batch.input_ids.size < plain.batch.input_ids.size
    model, attn_arg = _model(cfg, weights, attn, monkeypatch)
    w_NC = torch.as_tensor(
        np.random.default_rng(0).standard_normal((plain.num_docs, plain.num_columns)), dtype=torch.float32
    )
    want, want_grads = _logps_and_grads(model, plain, attn_arg, w_NC)
    got, got_grads = _logps_and_grads(model, shared, attn_arg, w_NC)
    if attn == "blocked":
        assert model.config._attn_implementation == BA.BLOCKED_HF_NAME
    logp_err = float(((got - want).abs() / want.abs().clamp_min(1.0)).max())
    grad_err, grad_name = _max_grad_rel(got_grads, want_grads)
    with torch.no_grad():
        blind, _ = completion_logps(model, _orphaned(shared), attn_implementation=attn_arg)
        model.double()
        want64, got64 = (completion_logps(model, cb, attn_implementation=attn_arg)[0] for cb in (plain, shared))
    err64 = float((got64 - want64).abs().max())
    print(
        f"\n{name} {attn} padding_free={padding_free}: logp rel {logp_err:.2e} (float64 abs {err64:.1e}), "
        f"grad rel {grad_err:.2e} ({grad_name})"
    )
    assert logp_err <= LOGP_REL, (name, attn, logp_err)
    assert grad_err <= GRAD_REL, (name, attn, grad_name, grad_err)
    if attn != "eager" and name != "gemma2":
        assert err64 <= LOGP_ABS_F64, (name, attn, err64)
    assert float((blind - want).abs().max()) > 1e-2, "a completion that cannot see its prompt must differ"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mistral-window-6"])
def test_flex_attention_shared_prefix_logps_equal_unshared(models, name):
    """FlexAttention on CPU: forward only (torch has no CPU backward); HF compiles it, one shape per batch."""
    cfg, weights = models(name)
    prompts, completions = _groups(cfg.vocab_size)
    model, _ = _model(cfg, weights, "flex_attention", None)
    out = {}
    for label, share in (("plain", False), ("shared", True), ("orphaned", True)):
        cb = collate_completions(prompts, completions, padding_free=True, share_prefix=share)
        torch._dynamo.reset()  # a second shape would recompile with dynamic shapes (an inductor CPU bug)
        with torch.no_grad():
            out[label], _ = completion_logps(model, _orphaned(cb) if label == "orphaned" else cb)
    err = float(((out["shared"] - out["plain"]).abs() / out["plain"].abs().clamp_min(1.0)).max())
    print(f"\n{name} flex_attention: logp rel {err:.2e}")
    assert err <= LOGP_REL
    assert float((out["orphaned"] - out["plain"]).abs().max()) > 1e-2


@pytest.mark.parametrize("attn", ["sdpa", "varlen", "blocked"])
def test_dpo_shared_prompt_sequence_logps_and_grads_equal_unshared(models, attn, monkeypatch):
    cfg, weights = models("mistral-window-6")
    rng = np.random.default_rng(5)
    rows = [
        {
            "prompt_input_ids": rng.integers(3, cfg.vocab_size, P).tolist(),
            "chosen_input_ids": rng.integers(3, cfg.vocab_size, C).tolist(),
            "rejected_input_ids": rng.integers(3, cfg.vocab_size, R).tolist(),
        }
        for P, C, R in ((10, 4, 7), (13, 8, 3))
    ]
    model, attn_arg = _model(cfg, weights, attn, monkeypatch)
    w_D = torch.as_tensor(rng.standard_normal(2 * len(rows)), dtype=torch.float32)
    results = []
    for pbatch in (collate_preference(rows), collate_preference(rows, share_prefix=True)):
        model.zero_grad(set_to_none=True)
        hidden_BTH = forward_hidden(model, pbatch.batch, attn_arg)
        logps_D = sequence_logps(hidden_BTH, lm_head_weight(model), pbatch, "fused_linear", 1024)
        (logps_D * w_D).sum().backward()
        results.append((logps_D.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    grad_err, grad_name = _max_grad_rel(got_grads, want_grads)
    err_D = (got - want).abs()
    print(f"\nDPO {attn}: sequence logp {float(err_D.max()):.2e}, grad rel {grad_err:.2e}")
    assert float((err_D / want.abs()).max()) <= LOGP_REL, (err_D, want)
    assert grad_err <= GRAD_REL, (grad_name, grad_err)


def test_blocked_pairs_cover_every_parent_key():
    """Every block pair holding an allowed (query, parent key) pair is a candidate; without parents some are not."""
    prompts, completions = _groups(100)
    batch = collate_completions(prompts, completions, padding_free=True, share_prefix=True).batch
    seg, pos, par = (
        torch.as_tensor(x, dtype=torch.long) for x in (batch.segment_ids, batch.position_ids, batch.parent_ids)
    )
    nb = -(-seg.shape[1] // BLOCK)

    def needed(window):
        allowed_TT = A.allowed_mask(seg, pos, window, par)[0] & (seg[0] != 0)[None, :]
        return {
            (qi, kj)
            for qi in range(nb)
            for kj in range(nb)
            if allowed_TT[qi * BLOCK : (qi + 1) * BLOCK, kj * BLOCK : (kj + 1) * BLOCK].any()
        }

    def candidates(plan, window):
        return {(qi, kj) for qi, ks in enumerate(plan.pairs(window)) for kj, _ in ks}

    for window in (None, 6):
        assert needed(window) <= candidates(BA.BlockedPlan(seg, pos, seg, pos, BLOCK, par), window), window
    orphan = BA.BlockedPlan(seg, pos, seg, pos, BLOCK)
    assert not needed(None) <= candidates(orphan, None), "negative control: without parent_ids parents are pruned"


def test_shared_varlen_plan_is_the_contract_rule():
    """The varlen plan's (query, key) pairs are exactly ``Batch.attention_allowed`` on real tokens."""
    prompts, completions = _groups(100)
    for padding_free in (False, True):
        batch = collate_completions(prompts, completions, padding_free=padding_free, share_prefix=True).batch
        plan = A.shared_varlen_plan(batch.segment_ids, batch.position_ids, batch.parent_ids)
        got = np.zeros((batch.input_ids.size,) * 2, dtype=bool)
        q_at, k_at = 0, 0
        for (n, L), Lk, distance in zip(plan.bucket_shapes, plan.key_lengths, plan.distances):
            q_nL = plan.slot_index[q_at : q_at + n * L].view(n, L).numpy()
            k_nS = plan.key_index[k_at : k_at + n * Lk].view(n, Lk).numpy()
            for d in range(n):
                rows = np.unique(q_nL[d])  # padding slots repeat a real query
                for i in rows:
                    slot = int(np.flatnonzero(q_nL[d] == i)[0])
                    got[i, k_nS[d][distance[d, slot].numpy() >= 0]] = True
            q_at, k_at = q_at + n * L, k_at + n * Lk
        B, T = batch.input_ids.shape
        want = np.zeros_like(got)
        for r in range(B):
            want[r * T : (r + 1) * T, r * T : (r + 1) * T] = batch.attention_allowed()[r]
        np.testing.assert_array_equal(got, want)


def test_flash_paths_refuse_shared_prefixes():
    prompts, completions = _groups(100)
    batch = collate_completions(prompts, completions, padding_free=True, share_prefix=True).batch
    with pytest.raises(ConfigError, match="share_prefix=False"):
        A.model_inputs(batch, "flash_attention_2", "cpu")
    plain = collate_completions(prompts, completions, padding_free=True).batch
    assert "cu_seq_lens_q" in A.model_inputs(plain, "flash_attention_2", "cpu")


@pytest.mark.parametrize("attn", ["sdpa", "varlen", "blocked"])
def test_parent_ids_of_zeros_change_nothing(models, attn, monkeypatch):
    """An unshared batch with ``parent_ids`` all 0 runs bit for bit as with ``parent_ids=None``."""
    cfg, weights = models("mistral-window-6")
    prompts, completions = _groups(cfg.vocab_size)
    plain = collate_completions(prompts, completions, padding_free=True)
    zeros = dataclasses.replace(
        plain, batch=dataclasses.replace(plain.batch, parent_ids=np.zeros_like(plain.batch.segment_ids))
    )
    model, attn_arg = _model(cfg, weights, attn, monkeypatch)
    with torch.no_grad():
        want, got = (completion_logps(model, cb, attn_implementation=attn_arg)[0] for cb in (plain, zeros))
    assert plain.batch.parent_ids is None and torch.equal(got, want)


def test_context_parallel_refuses_a_shared_batch():
    """torch's context-parallel shard has no parent term: a shared batch is refused, never silently unshared."""
    prompts, completions = [[1, 5, 6, 7]] * 2, [[8, 9], [3]]
    plain = collate_completions(prompts, completions, padding_free=True, pad_to_multiple_of=4)
    assert shard_for_rank(plain.batch, cp=2, cp_rank=0).num_tokens > 0
    shared = collate_completions(prompts, completions, padding_free=True, pad_to_multiple_of=4, share_prefix=True)
    with pytest.raises(ConfigError, match="share_prefix=False"):
        shard_for_rank(shared.batch, cp=2, cp_rank=0)
