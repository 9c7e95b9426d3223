"""Attention sinks (gpt-oss's ``s_aux``: a learned logit per query head in every softmax denominator, with no value)
on every torch attention path, against transformers' own gpt-oss eager attention.

Invariants:

- one attention layer, float64: ``varlen`` (bucketed, shared-prefix and dense-fallback plans), ``sink_attention``,
  the blocked attention and the allgather CP attention (2 ranks simulated in one process) give transformers'
  ``eager_attention_forward`` of gpt-oss (1e-12), and so do the gradients of q, k, v and the sinks; the same calls
  without ``s_aux`` do not (the negative control);
- the whole model (the ``gpt_oss`` case of ``parity_tests.families``) on every CPU training path, eager, sdpa (which
  runs eager), varlen and the blocked attention, packed: the loss and every gradient, the sinks' included, equal
  transformers' own forward and backward of each document alone (``loss_rel``, ``grad_rel``); with the sinks
  pushed to -inf (dropped) the logits move far past ``logits_abs``;
- prefix sharing with sinks: the shared batch gives the unshared batch's log-probs and gradients;
- greedy generation through the KV cache (``varlen``'s decode mask) equals transformers' eager generation;
- what cannot carry sinks refuses, naming attention sinks and the fix: the flash paths, FlexAttention on CPU, the
  ring, and expert parallelism of gpt-oss's biased experts.

The 2-rank gloo CP run (allgather and ulysses) is ``test_cp_with_sinks_on_two_gloo_ranks_equals_one_process``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from parity_tests.families import FAMILY_CASES, family_batches, hf_random_checkpoint
from parity_tests.tolerances import tol
from twinseq.common.data.batching import collate
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.grpo import collate_completions
from twinseq.torch_backend import attention as A
from twinseq.torch_backend import blocked_attention as BA
from twinseq.torch_backend import context_parallel as cpmod
from twinseq.torch_backend.checkpoint import load_pretrained
from twinseq.torch_backend.generation import complete_prompts
from twinseq.torch_backend.grpo import completion_logps
from twinseq.torch_backend.model import logits, loss_and_grads

sys.path.insert(0, str(Path(__file__).parent))
import _sinks_cp_workers as S  # noqa: E402

LOGITS_ABS, LOSS_REL, GRAD_REL = tol("float32", "logits_abs"), tol("float32", "loss_rel"), tol("float32", "grad_rel")
F64_ABS = 1e-12  # float64 throughout (transformers' gpt-oss eager takes its softmax in the inputs' dtype)
NAME = "gpt_oss"
BLOCK = 8  # the blocked path: blocks of 8 tokens, taken from 8-token rows on


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf_random_checkpoint(NAME, tmp_path_factory.mktemp("sinks") / NAME)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    """transformers' own gpt-oss (eager attention; from_pretrained leaves it in eval mode): the reference."""
    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager", dtype=torch.float32)


# --------------------------------------------------------------------------------------
# One attention layer, float64
# --------------------------------------------------------------------------------------


def _reference(q, k, v, sinks, mask_B1TT):
    """transformers' gpt-oss eager attention [B, T, H, D] under an additive document mask."""
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, q, k, v, mask_B1TT, scaling=0.3)
    return out


def _grads(out_BTHD, weights_BTHD, *tensors):
    return torch.autograd.grad((out_BTHD * weights_BTHD).sum(), tensors)


def _layer_paths(batch, window):
    """name -> f(q, k, v, sinks or None) -> [B, T, H, D]: every path one layer of gpt-oss can take."""
    seg, pos = (torch.as_tensor(x, dtype=torch.long) for x in (batch.segment_ids, batch.position_ids))
    par = torch.as_tensor(batch.parent_ids, dtype=torch.long) if batch.shares_prefix else None
    module = SimpleNamespace(training=False, num_key_value_groups=2)  # the control's dense call repeats K/V by it
    mask = A.document_mask(seg, pos, torch.float64, window, par)
    plan = (
        A.shared_varlen_plan(batch.segment_ids, batch.position_ids, batch.parent_ids)
        if batch.shares_prefix
        else A.varlen_plan(batch.segment_ids, batch.position_ids)
    )
    blocked_plan = BA.BlockedPlan(seg, pos, seg, pos, BLOCK, par)

    def varlen(q, k, v, s, plan=plan, mask=None):
        return A.varlen_attention_forward(
            module,
            q,
            k,
            v,
            mask,
            scaling=0.3,
            sliding_window=window,
            s_aux=s,
            **({} if plan is None else {A.PLAN_KWARG: plan}),
        )[0]

    paths = {
        "varlen": varlen,
        "varlen dense fallback": lambda q, k, v, s: varlen(q, k, v, s, plan=None, mask=mask),
        "blocked": lambda q, k, v, s: BA.blocked_attention(q, k, v, blocked_plan, 0.3, window, None, s).transpose(1, 2),
    }
    if not batch.shares_prefix:  # context parallelism does not carry parent segments
        paths["allgather CP (2 ranks in one process)"] = lambda q, k, v, s: _allgather_two_ranks(
            batch, q, k, v, s, window
        )
    return paths, mask


def _allgather_two_ranks(batch, q, k, v, sinks, window):
    """Both ranks' ``twinseq_cp_allgather`` outputs (zigzag shards, keys gathered by hand), back in token order."""
    from twinseq.common.data.context_parallel import cp_permutation

    cp, T = 2, batch.shape[1]
    order = cp_permutation(T, cp)  # the gathered keys: rank 0's shard, then rank 1's
    seg_k, pos_k = (torch.as_tensor(x[:, order], dtype=torch.long) for x in (batch.segment_ids, batch.position_ids))
    out = q.new_zeros(q.shape[0], T, q.shape[1], v.shape[-1])
    for rank, mine in enumerate(torch.as_tensor(order).reshape(cp, -1)):
        shard = cpmod.shard_for_rank(batch, cp, rank)
        plan = BA.BlockedPlan(shard.segment_ids, shard.position_ids, seg_k, pos_k, BLOCK)
        got, _ = cpmod.allgather_attention_forward(
            SimpleNamespace(training=False),
            q[:, :, mine],
            k[:, :, order],
            v[:, :, order],
            None,
            scaling=0.3,
            sliding_window=window,
            s_aux=sinks,
            **{cpmod.CP_KWARG: cpmod.CPAttentionContext(None, plan, window)},
        )
        out = out.index_copy(1, mine, got)
    return out


def _shared_batch():
    rng = np.random.default_rng(7)
    prompts, completions = [], []
    for P, G in ((9, 3), (14, 2)):
        prompt = rng.integers(3, 100, P).tolist()
        for _ in range(G):
            prompts.append(prompt)
            completions.append(rng.integers(3, 100, int(rng.integers(2, 12))).tolist())
    return prompts, completions


LAYER_BATCHES = {
    "packed": lambda: collate(
        [{"input_ids": [5] * n} for n in (23, 9, 14, 3)], padding_free=True, pad_to_multiple_of=8
    ),
    "padded": lambda: collate([{"input_ids": [5] * n} for n in (23, 9, 14)], pad_to_multiple_of=8),
    "shared prefix": lambda: collate_completions(*_shared_batch(), padding_free=True, share_prefix=True).batch,
}


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("layout", list(LAYER_BATCHES))
def test_every_layer_path_equals_transformers_gpt_oss_eager_with_sinks(layout, window):
    batch = LAYER_BATCHES[layout]()
    B, T = batch.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, 8, generator=gen, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    real = torch.as_tensor(batch.segment_ids != 0)[:, :, None, None]  # padding outputs are don't-care
    w = torch.randn(B, T, 4, 8, generator=gen, dtype=torch.float64) * real
    paths, mask = _layer_paths(batch, window)
    want = _reference(q, k, v, sinks, mask)
    want_grads = _grads(want, w, q, k, v, sinks)
    for name, path in paths.items():
        got = path(q, k, v, sinks)
        out_err = float(((got - want) * real).abs().max().detach())
        grad_errs = [float((g - h).abs().max()) for g, h in zip(_grads(got, w, q, k, v, sinks), want_grads)]
        print(f"{layout} window={window} {name}: out {out_err:.1e}, dq dk dv dsinks {grad_errs}")
        assert out_err <= F64_ABS and max(grad_errs) <= F64_ABS, (name, out_err, grad_errs)
        # the control: the same path without s_aux is another function
        assert float(((path(q, k, v, None) - want) * real).abs().max().detach()) > 1e-2, name
    sdpa = A.sink_attention(q, k, v, mask, 0.3, sinks).transpose(1, 2)
    assert float(((sdpa - want) * real).abs().max().detach()) <= F64_ABS


# --------------------------------------------------------------------------------------
# The whole model, every CPU training path
# --------------------------------------------------------------------------------------


def _model(checkpoint, attn: str, monkeypatch):
    model = load_pretrained(checkpoint, attn_implementation="sdpa" if attn == "blocked" else attn)
    if attn == "blocked":
        BA.set_attention_block_size(model, BLOCK)
        monkeypatch.setattr(BA, "BLOCKED_MIN_SEQ_LEN", BLOCK)
    return model


def _hf_loss_and_grads(hf, separate) -> tuple[float, dict[str, np.ndarray]]:
    """transformers' loss of each document alone (normalised by the step's label count), summed, and its grads."""
    hf.zero_grad(set_to_none=True)
    total = 0.0
    for b in separate:
        out = hf(
            input_ids=torch.as_tensor(b.input_ids, dtype=torch.long),
            labels=torch.as_tensor(b.labels, dtype=torch.long),
            num_items_in_batch=b.num_items_in_batch,
            use_cache=False,
        )
        out.loss.backward()
        total += float(out.loss.detach())
    grads = {n: p.grad.numpy().copy() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)
    return total, grads


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("attn", ["eager", "varlen", "blocked"])  # sdpa runs eager (test_paths_without_a_sink_...)
def test_packed_loss_and_sink_gradients_equal_transformers(checkpoint, hf_model, attn, monkeypatch):
    batches = family_batches()
    want_loss, want = _hf_loss_and_grads(hf_model, batches["separate"])
    model = _model(checkpoint, attn, monkeypatch)
    loss, grads = loss_and_grads(model, batches["packed"])
    if attn == "blocked":
        assert model.config._attn_implementation == BA.BLOCKED_HF_NAME
    sinks = [n for n in grads if n.endswith("self_attn.sinks")]
    assert len(sinks) == FAMILY_CASES[NAME].num_hidden_layers and all(np.abs(grads[n]).max() > 1e-4 for n in sinks)
    worst = max((rel_err(grads[n], want[n]), n) for n in grads)
    sink_worst = max(rel_err(grads[n], want[n]) for n in sinks)
    print(
        f"{attn}: loss {loss:.7f} vs transformers {want_loss:.7f}; grad_rel {worst[0]:.1e} ({worst[1]}), "
        f"sinks {sink_worst:.1e}"
    )
    assert abs(loss - want_loss) <= LOSS_REL * abs(want_loss), (loss, want_loss)
    assert worst[0] <= GRAD_REL, worst
    if attn == "blocked":  # a row shorter than BLOCKED_MIN_SEQ_LEN on the switched model: the dense fallback (eager)
        short = collate([{"input_ids": [7, 9, 11, 13, 15]}])
        with torch.no_grad():
            ref = hf_model(input_ids=torch.as_tensor(short.input_ids), use_cache=False).logits.numpy()
        assert np.abs(logits(model, short) - ref).max() <= LOGITS_ABS


def test_dropping_the_sinks_moves_the_logits_past_the_bound(checkpoint, hf_model):
    """The model-level control: sinks at -1e9 (exp = 0: no sink) give logits far from transformers' own, on the
    eager and varlen paths alike, so the comparisons above can fail."""
    batch = family_batches()["padded"]
    with torch.no_grad():
        want = hf_model(input_ids=torch.as_tensor(batch.input_ids[:1]), use_cache=False).logits[0].numpy()
    real = batch.segment_ids[0] != 0
    for attn in ("eager", "varlen"):
        model = load_pretrained(checkpoint, attn_implementation=attn)
        assert np.abs(logits(model, batch)[0][real] - want[real]).max() <= LOGITS_ABS
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e9)
        diff = float(np.abs(logits(model, batch)[0][real] - want[real]).max())
        print(f"{attn} without sinks: {diff:.1e} from transformers")
        assert diff > 1e-3, (attn, diff)


@pytest.mark.parametrize("attn", ["eager", "varlen", pytest.param("blocked", marks=pytest.mark.slow)])
def test_prefix_sharing_with_sinks_equals_the_unshared_batch(checkpoint, attn, monkeypatch):
    prompts, completions = _shared_batch()
    plain = collate_completions(prompts, completions, padding_free=True)
    shared = collate_completions(prompts, completions, padding_free=True, share_prefix=True)
    model = _model(checkpoint, attn, monkeypatch)
    w_NC = torch.as_tensor(
        np.random.default_rng(0).standard_normal((plain.num_docs, plain.num_columns)), dtype=torch.float32
    )
    out = []
    for cb in (plain, shared):
        model.zero_grad(set_to_none=True)
        logps, _ = completion_logps(model, cb, attn_implementation=None)
        (logps * w_NC).sum().backward()
        out.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_g), (got, got_g) = out
    logp_err = float(((got - want).abs() / want.abs().clamp_min(1.0)).max())
    grad_err = max(float((got_g[n] - want_g[n]).norm() / want_g[n].norm().clamp_min(1e-30)) for n in want_g)
    print(f"shared prefix {attn}: logp rel {logp_err:.1e}, grad rel {grad_err:.1e}")
    assert logp_err <= 1e-6 and grad_err <= GRAD_REL, (logp_err, grad_err)
    assert all(got_g[n].abs().max() > 0 for n in got_g if n.endswith("sinks"))


def test_greedy_generation_on_varlen_equals_transformers_eager(checkpoint):
    """Left-padded prompts decoded through the KV cache: ``varlen``'s decode mask carries the sinks."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
    eager = load_pretrained(checkpoint, attn_implementation="eager")
    varlen = load_pretrained(checkpoint, attn_implementation="varlen")
    want = complete_prompts(eager, prompts, max_new_tokens=8)
    np.testing.assert_array_equal(complete_prompts(varlen, prompts, max_new_tokens=8), want)


# --------------------------------------------------------------------------------------
# What cannot carry sinks refuses
# --------------------------------------------------------------------------------------


def test_paths_without_a_sink_term_refuse_gpt_oss(checkpoint):
    from transformers import AutoConfig

    from twinseq.torch_backend.expert_parallel import _moe_blocks, check_expert_parallel

    model = load_pretrained(checkpoint)
    assert model.config._attn_implementation == "eager"  # sdpa has no sink term: eager, logged
    layout = A.mask_layout(model.config)
    assert layout.sinks and not A.mask_layout(AutoConfig.for_model("mistral")).sinks
    for attn in ("flash_attention_2", "flash_attention_3"):
        with pytest.raises(ConfigError, match=rf"{attn}' cannot compute attention sinks.*'varlen'"):
            A.check_sink_support(attn, layout, "cuda")
    with pytest.raises(ConfigError, match="flex_attention' cannot compute attention sinks on CPU.*'varlen'"):
        A.check_sink_support("flex_attention", layout, "cpu")
    A.check_sink_support("flex_attention", layout, "cuda")  # transformers rescales by the LSE there
    for attn in ("varlen", "eager"):
        A.check_sink_support(attn, layout, "cpu")
    with pytest.raises(ConfigError, match=r"strategy='ring' cannot .*attention sinks.*allgather"):
        cpmod.check_ring_model(model.config)
    with pytest.raises(ConfigError, match="attention sinks.*allgather"):
        cpmod.ring_attention_forward(
            SimpleNamespace(),
            *([torch.zeros(1, 2, 4, 8)] * 3),
            None,
            s_aux=torch.zeros(2),
            **{cpmod.CP_KWARG: cpmod.CPAttentionContext(None, None, strategy="ring")},
        )
    with pytest.raises(ConfigError, match="GptOssMLP.*expert_parallel_size=1"):
        check_expert_parallel(4, 2, _moe_blocks(model))
    assert FAMILY_CASES[NAME].has_attention_sinks


# --------------------------------------------------------------------------------------
# Context parallelism on two gloo ranks
# --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_cp_with_sinks_on_two_gloo_ranks_equals_one_process(tmp_path):
    """allgather and ulysses on 2 gloo ranks: each layer's output and the q/k/v/sink gradients equal the dense
    reference (float64), and the gpt-oss model's loss and sink gradients equal one process's. (torch's ring runs on
    CUDA only and has no sink term: it refuses, ``test_paths_without_a_sink_term_refuse_gpt_oss``.)"""
    results = S.launch({"jobs": [{"kind": "sinks_cp"}]}, tmp_path, world_size=2)
    want = S.one_process_reference()
    for rank, result in enumerate(results):
        for strategy, errs in result["layer"].items():
            print(f"rank {rank} {strategy}: {errs}")
            assert max(errs.values()) <= F64_ABS, (rank, strategy, errs)
            assert result["control"][strategy] > 1e-2, (rank, strategy)  # without s_aux: another function
        for strategy, got in result["model"].items():
            worst = max(rel_err(np.asarray(g), np.asarray(want["sinks"][n])) for n, g in got["sinks"].items())
            print(
                f"rank {rank} {strategy} model: loss {got['loss']:.7f} vs one process {want['loss']:.7f}, "
                f"sink grad_rel {worst:.1e}"
            )
            assert abs(got["loss"] - want["loss"]) <= LOSS_REL * abs(want["loss"]), (strategy, got, want["loss"])
            for name, g in got["sinks"].items():
                assert rel_err(np.asarray(g), np.asarray(want["sinks"][name])) <= GRAD_REL, (strategy, name)
