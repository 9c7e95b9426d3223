"""Every model family on the torch backend, against transformers' own modules and numbers.

The cases are ``parity_tests.families.FAMILY_CASES``: Llama (Llama 3.x, linear and dynamic RoPE,
biases), Qwen2 (with and without sliding layers), Qwen3, Qwen3-MoE, Mistral, Mixtral, Gemma 2 and Gemma 3, each a
random-weight checkpoint that transformers built, perturbed and saved (no twinseq code wrote it).
What is checked, per family:

- the folder loads with ``load_pretrained`` and reads back as its ``ModelConfig``; ``build_model``
  from the same numpy weights is the same model (export/load per ``parameter_shapes``);
- twinseq's fp32 logits of padded and packed batches, on every CPU attention path, equal
  transformers' own forward on each document alone (``logits_abs``);
- packed equals separate: per-token loss (``token_loss_abs``) and summed gradients (``grad_rel``);
- sliding windows cut where they should (a negative control without the window fails), soft-caps
  are applied by every loss and log-prob kernel, dynamic RoPE is stateless per batch;
- Gemma 3's two RoPE bases go to the right layers (swapping them is another model) and a final soft-cap set in
  its config is applied as transformers applies it;
- Qwen3-MoE and Mixtral with ``output_router_logits``: the loss is transformers' ``loss + coef * aux_loss`` on
  every training path, and under accumulation each micro-batch adds ``coef * aux_loss / gradient_accumulation_steps``;
- common's config.json defaults and RoPE frequencies are transformers' own;
- an architecture twinseq does not build is refused, naming it and the supported ones.

The measured maxima are printed (``pytest -s``); the final report of the task lists them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parity_tests.families import (FAMILIES, FAMILY_CASES, family_batches, family_examples, hf_document_logits,
                                   hf_random_checkpoint)
from parity_tests.tolerances import tol
from twinseq.common.data.batching import collate
from twinseq.common.errors import ConfigError
from twinseq.common.models.hf_folder import read_hf_checkpoint
from twinseq.common.objectives.nll import shift_labels
from twinseq.common.models.configs import ARCHITECTURES, MODEL_TYPES, ModelConfig, from_hf_config, to_hf_config
from twinseq.torch_backend.attention import forward_hidden
from twinseq.torch_backend.checkpoint import load_pretrained
from twinseq.torch_backend.losses import causal_lm_loss
from twinseq.torch_backend.model import (build_model, export_weights, final_logit_softcap, logits, loss_and_grads,
                                         model_config_of, to_hf_model_config)

LOGITS_ABS, TOKEN_LOSS_ABS = tol("float32", "logits_abs"), tol("float32", "token_loss_abs")
LOSS_REL, GRAD_REL = tol("float32", "loss_rel"), tol("float32", "grad_rel")
TRAINING_PATHS = ("sdpa", "eager", "varlen")  # the paths that train on CPU
SLIDING = ("mistral", "qwen2-sliding", "gemma2", "gemma3", "mixtral", "gpt_oss")
MOE = ("qwen3_moe", "mixtral", "gpt_oss")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> path of the family's HF checkpoint, built once per module on first use."""
    root, paths = tmp_path_factory.mktemp("families"), {}

    def get(name: str):
        if name not in paths:
            paths[name] = hf_random_checkpoint(name, root / name)
        return paths[name]

    return get


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    """name -> transformers' own model of the checkpoint (eager attention, eval mode): the reference."""
    from transformers import AutoModelForCausalLM

    models = {}

    def get(name: str):
        if name not in models:
            models[name] = AutoModelForCausalLM.from_pretrained(checkpoint(name), attn_implementation="eager").eval()
        return models[name]

    return get


@pytest.fixture(scope="module")
def batches():
    return family_batches()


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def doc_rows(batch, i: int) -> tuple[int, np.ndarray]:
    """(row, positions) of document ``i`` of ``family_examples`` in ``batch`` (padded: row i; packed: row 0)."""
    if batch.shape[0] == 1:
        return 0, np.flatnonzero(batch.segment_ids[0] == i + 1)
    return i, np.flatnonzero(batch.segment_ids[i] == 1)


def hf_reference_logits(hf, name: str, batch) -> list[np.ndarray]:
    """transformers' logits of each document of ``family_examples`` alone.

    Dynamic RoPE takes its frequencies from the longest position of the whole batch (common/models/rope.py),
    so there each document is followed by filler tokens up to that length: causal attention keeps
    the filler out of the document's logits, and HF then sees the batch's largest position. (HF's rotary
    module keeps the largest length it has seen; a short call first takes its own reset branch.)
    """
    longest = int(batch.position_ids.max()) + 1
    if FAMILY_CASES[name].rope_type == "dynamic":
        hf_document_logits(hf, [3] * 4)
    out = []
    for ex in family_examples():
        ids = ex["input_ids"]
        if FAMILY_CASES[name].rope_type == "dynamic":
            ids = ids + [3] * (longest - len(ids))
        out.append(hf_document_logits(hf, ids)[:len(ex["input_ids"])])
    return out


def max_logit_diff(out_BTV: np.ndarray, batch, refs: list[np.ndarray]) -> float:
    worst = 0.0
    for i, ref in enumerate(refs):
        row, cols = doc_rows(batch, i)
        worst = max(worst, float(np.abs(out_BTV[row, cols] - ref).max()))
    return worst


def refuses_flex_on_cpu(name: str, model, batch) -> bool:
    """True, after checking the refusal, for a family with attention sinks (gpt-oss): FlexAttention on CPU returns no
    log-sum-exp to rescale by the sinks, so twinseq refuses it (``attention.check_sink_support``), naming the fix."""
    if not FAMILY_CASES[name].has_attention_sinks:
        return False
    with pytest.raises(ConfigError, match="flex_attention' cannot compute attention sinks on CPU.*'varlen'"):
        logits(model, batch)
    return True


def fresh_logits(model, batch) -> np.ndarray:
    """``logits``, after forgetting compiled graphs when the model runs flex_attention: HF compiles it, and a
    second shape makes dynamo recompile with dynamic shapes, which inductor's CPU flex template fails to
    build in torch 2.13 (test_attention.py has the same guard)."""
    if model.config._attn_implementation == "flex_attention":
        torch._dynamo.reset()
    return logits(model, batch)


def token_losses(model, batch) -> np.ndarray:
    """float32 [B, T] per-token NLL of the (soft-capped) logits, 0 where there is no target."""
    with torch.no_grad():
        hidden_BTH = forward_hidden(model, batch)
        logits_BTV = model.lm_head(hidden_BTH).float()
        cap = final_logit_softcap(model)
        if cap is not None:
            logits_BTV = torch.tanh(logits_BTV / cap) * cap
        targets = torch.as_tensor(shift_labels(batch.labels), dtype=torch.long)
        nll = F.cross_entropy(logits_BTV.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    return nll.view(batch.shape).numpy()


# --------------------------------------------------------------------------------------
# Loading, and the logits of transformers' own forward
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoint_loads_as_its_config(checkpoint, batches, name):
    cfg = FAMILY_CASES[name]
    model = load_pretrained(checkpoint(name))
    assert type(model).__name__ == ARCHITECTURES[cfg.model_type] and model.training
    assert model_config_of(model) == cfg
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings
    # export_weights is the checkpoint, bitwise; build_model of those numpy weights is the same model
    _, stored = read_hf_checkpoint(checkpoint(name))
    exported = export_weights(model)
    assert set(exported) == set(stored)
    for key, value in stored.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    rebuilt = build_model(cfg, stored)
    assert model_config_of(rebuilt) == cfg
    np.testing.assert_array_equal(logits(rebuilt, batches["packed"]), logits(model, batches["packed"]))


@pytest.mark.parametrize("attn", TRAINING_PATHS)
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_equal_transformers_per_document(checkpoint, hf_model, batches, name, attn):
    model = load_pretrained(checkpoint(name), attn_implementation=attn)
    for layout in ("padded", "packed"):
        batch = batches[layout]
        diff = max_logit_diff(logits(model, batch), batch, hf_reference_logits(hf_model(name), name, batch))
        print(f"logits vs transformers {name} {attn} {layout}: {diff:.2e}")
        assert diff <= LOGITS_ABS, (name, attn, layout, diff)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_flex_attention_logits_equal_transformers(checkpoint, hf_model, batches, name):
    """FlexAttention forward (CPU has no flex backward); HF compiles it, hence slow."""
    model = load_pretrained(checkpoint(name), attn_implementation="flex_attention")
    if refuses_flex_on_cpu(name, model, batches["packed"]):
        return
    for layout in ("padded", "packed"):
        batch = batches[layout]
        diff = max_logit_diff(fresh_logits(model, batch), batch, hf_reference_logits(hf_model(name), name, batch))
        print(f"logits vs transformers {name} flex_attention {layout}: {diff:.2e}")
        assert diff <= LOGITS_ABS, (name, layout, diff)


# --------------------------------------------------------------------------------------
# Packed equals separate
# --------------------------------------------------------------------------------------


def reference_batches(name: str, batches) -> list:
    """What a packed batch must equal: each document in a batch of its own (``separate``, normalised by the
    step's label count), except for dynamic RoPE, whose frequencies come from the batch's longest position
    (common/models/rope.py): there the reference is the padded batch, one document per row, same longest position."""
    return [batches["padded"]] if FAMILY_CASES[name].rope_type == "dynamic" else batches["separate"]


def reference_token_losses(model, refs: list) -> list[np.ndarray]:
    """Per-token losses of document i, from the reference batches (padded: row i; separate: batch i)."""
    if len(refs) == 1:
        out = token_losses(model, refs[0])
        return [out[i, refs[0].segment_ids[i] == 1] for i in range(refs[0].shape[0])]
    return [token_losses(model, b)[0, b.segment_ids[0] == 1] for b in refs]


def packed_token_loss_diff(model, batches, refs) -> float:
    packed = batches["packed"]
    got = token_losses(model, packed)
    want = reference_token_losses(model, refs)
    return max(float(np.abs(got[0, packed.segment_ids[0] == i + 1] - w).max()) for i, w in enumerate(want))


@pytest.mark.parametrize("attn", TRAINING_PATHS)
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_equals_separate_loss_and_grads(checkpoint, batches, name, attn):
    model = load_pretrained(checkpoint(name), attn_implementation=attn)
    refs = reference_batches(name, batches)
    loss_diff = packed_token_loss_diff(model, batches, refs)
    loss, grads = loss_and_grads(model, batches["packed"])
    ref_loss, ref_grads = 0.0, None
    for b in refs:
        part, g = loss_and_grads(model, b)
        ref_loss += part
        ref_grads = g if ref_grads is None else {k: ref_grads[k] + g[k] for k in g}
    worst = max((rel_err(grads[k], ref_grads[k]), k) for k in grads)
    print(f"packed vs separate {name} {attn}: token loss {loss_diff:.2e}, grad_rel {worst[0]:.2e} ({worst[1]})")
    assert loss_diff <= TOKEN_LOSS_ABS, (name, attn, loss_diff)
    assert abs(loss - ref_loss) <= LOSS_REL * abs(ref_loss), (name, attn, loss, ref_loss)
    assert worst[0] <= GRAD_REL, (name, attn, worst)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_flex_attention_packed_equals_separate_forward(checkpoint, batches, name):
    model = load_pretrained(checkpoint(name), attn_implementation="flex_attention")
    if refuses_flex_on_cpu(name, model, batches["packed"]):
        return
    reference = load_pretrained(checkpoint(name), attn_implementation="eager")
    refs = reference_batches(name, batches)
    want = reference_token_losses(reference, refs)
    torch._dynamo.reset()  # see fresh_logits
    packed = batches["packed"]
    got = token_losses(model, packed)
    diff = max(float(np.abs(got[0, packed.segment_ids[0] == i + 1] - w).max()) for i, w in enumerate(want))
    print(f"packed (flex) vs separate (eager) {name}: token loss {diff:.2e}")
    assert diff <= TOKEN_LOSS_ABS, (name, diff)


# --------------------------------------------------------------------------------------
# Sliding windows
# --------------------------------------------------------------------------------------


def without_window(cfg):
    """The same architecture with every layer attending to the whole document (the negative control)."""
    if cfg.model_type in ("mistral", "mixtral"):
        return dataclasses.replace(cfg, sliding_window=None)
    if cfg.model_type == "gemma3_text":  # keep the layer types: they pick each layer's RoPE base
        return dataclasses.replace(cfg, sliding_window=10**6)
    return dataclasses.replace(cfg, sliding_window=None, layer_types=["full_attention"] * cfg.num_hidden_layers)


def test_allowed_mask_with_a_window_is_the_rule():
    """allowed(i, j) = same document, 0 <= pos_i - pos_j < window (plus the padding diagonal), brute force."""
    from twinseq.torch_backend.attention import allowed_mask

    batch = family_batches()["packed"]
    seg, pos = batch.segment_ids[0], batch.position_ids[0]
    for window in (1, 3, 8, 100):
        got = allowed_mask(torch.as_tensor(batch.segment_ids), torch.as_tensor(batch.position_ids), window)[0]
        want = np.array([[(seg[i] == seg[j] != 0 and 0 <= pos[i] - pos[j] < window) or (seg[i] == 0 and i == j)
                          for j in range(len(seg))] for i in range(len(seg))])
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("attn", (*TRAINING_PATHS, pytest.param("flex_attention", marks=pytest.mark.slow)))
@pytest.mark.parametrize("name", SLIDING)
def test_sliding_window_in_a_packed_row_matches_separate(checkpoint, name, attn):
    """The 23-token document crosses the window of 8; packed with the 9-token one, both match running alone.
    Negative control: without the window, the 23-token document's logits change from position 8 on (the
    first query whose window excludes a key), and not before, so the window is applied, and in the right place."""
    cfg = FAMILY_CASES[name]
    assert cfg.sliding_window == 8
    docs = family_examples()[:2]
    packed = collate(docs, padding_free=True)
    _, weights = read_hf_checkpoint(checkpoint(name))
    model = build_model(cfg, weights, attn_implementation=attn)
    if attn == "flex_attention" and refuses_flex_on_cpu(name, model, packed):
        return
    got = fresh_logits(model, packed)[0]
    alone = [fresh_logits(model, collate([d]))[0] for d in docs]
    diff = max(float(np.abs(got[packed.segment_ids[0] == i + 1] - a).max()) for i, a in enumerate(alone))
    unwindowed = fresh_logits(build_model(without_window(cfg), weights, attn_implementation=attn),
                              collate(docs[:1]))[0]
    change_before, change_after = (float(np.abs(unwindowed[part] - alone[0][part]).max())
                                   for part in (slice(0, 8), slice(8, None)))
    print(f"sliding {name} {attn}: packed vs alone {diff:.2e}; without the window: {change_before:.1e} before "
          f"position 8, {change_after:.1e} after")
    assert diff <= LOGITS_ABS, (name, attn, diff)
    assert change_before <= LOGITS_ABS and change_after > 1e-3, (name, attn, change_before, change_after)


def test_varlen_honours_window_and_softcap_kwargs():
    """``twinseq_varlen`` on a bucket with documents longer and shorter than the window, with and without a
    soft-cap, equals transformers' eager Gemma 2 attention under the dense windowed document mask.

    float64 inputs, but HF's eager takes the softmax in float32, so the two agree to ~1e-7, not 1e-15;
    a wrong mask or a missing cap moves outputs by O(1) (window 4 vs 8, cap 0.5 on N(0, 1) scores)."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from twinseq.torch_backend.attention import PLAN_KWARG, document_mask, varlen_attention_forward, varlen_plan

    batch = collate([{"input_ids": [5] * n} for n in (23, 9, 14, 3)], padding_free=True, pad_to_multiple_of=8)
    seg, pos = (torch.as_tensor(x, dtype=torch.long) for x in (batch.segment_ids, batch.position_ids))
    gen = torch.Generator().manual_seed(0)
    T = batch.shape[1]
    q, k, v = (torch.randn(1, n, T, 16, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    module = SimpleNamespace(num_key_value_groups=2, training=False, head_dim=16)
    plan = varlen_plan(batch.segment_ids, batch.position_ids)
    real = torch.as_tensor(batch.segment_ids[0] != 0)
    for window in (None, 4, 8):
        for cap in (None, 0.5):
            mask = document_mask(seg, pos, torch.float64, window)
            want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3, softcap=cap)
            got, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.3, sliding_window=window, softcap=cap,
                                              **{PLAN_KWARG: plan})
            assert float((got - want)[0, real].abs().max()) < 1e-6, (window, cap)
            dense, _ = varlen_attention_forward(module, q, k, v, mask, scaling=0.3, sliding_window=window, softcap=cap)
            assert float((dense - want)[0, real].abs().max()) < 1e-6, (window, cap)
    # the control: the same call without the window is another function (so the comparison can fail)
    unwindowed, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.3, **{PLAN_KWARG: plan})
    windowed, _ = eager_attention_forward(module, q, k, v, document_mask(seg, pos, torch.float64, 4), scaling=0.3)
    assert float((unwindowed - windowed)[0, real].abs().max()) > 1e-2
    with pytest.raises(ConfigError, match="position_bias"):  # attention sinks (s_aux) it carries: test_attention_sinks
        varlen_attention_forward(module, q, k, v, None, position_bias=torch.zeros(1), **{PLAN_KWARG: plan})


# --------------------------------------------------------------------------------------
# Final logit soft-cap: every loss and log-prob kernel
# --------------------------------------------------------------------------------------

LOSS_TYPES = ("nll", "chunked_nll", "fused_linear",
              pytest.param("liger", marks=pytest.mark.skipif(
                  not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                  reason="Liger's kernels need CUDA and liger-kernel")))
SOFTCAP_CASES = (("gemma2", None), ("qwen3", 1.5))
"""(family, cap): Gemma 2 with its own tied-head cap (1.5), and untied Qwen3 given one explicitly."""


def loss_and_param_grads(model, batch, loss_type: str, cap) -> tuple[float, dict[str, np.ndarray]]:
    model.zero_grad(set_to_none=True)
    hidden_BTH = forward_hidden(model, batch)
    labels_BT = torch.as_tensor(batch.labels, dtype=torch.long, device=hidden_BTH.device)
    loss = causal_lm_loss(hidden_BTH, model.lm_head.weight, labels_BT, batch.num_items_in_batch, loss_type,
                          chunk_size=8, logit_softcap=cap)
    loss.backward()
    grads = {n: p.grad.detach().cpu().float().numpy().copy() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("name, cap", SOFTCAP_CASES)
def test_every_loss_type_soft_caps_like_nll(checkpoint, batches, name, cap, loss_type):
    device = "cuda" if loss_type == "liger" else "cpu"
    model = load_pretrained(checkpoint(name), attn_implementation="eager", device=device)
    cap = final_logit_softcap(model) if cap is None else cap
    assert cap == 1.5
    want_loss, want = loss_and_param_grads(model, batches["packed"], "nll", cap)
    loss, grads = loss_and_param_grads(model, batches["packed"], loss_type, cap)
    worst = max((rel_err(grads[k], want[k]), k) for k in grads)
    print(f"soft-capped {loss_type} vs nll {name}: loss rel {abs(loss - want_loss) / want_loss:.1e}, "
          f"grad_rel {worst[0]:.1e} ({worst[1]})")
    assert abs(loss - want_loss) <= LOSS_REL * want_loss, (loss, want_loss)
    assert worst[0] <= GRAD_REL, worst
    uncapped, _ = loss_and_param_grads(model, batches["packed"], loss_type, None)
    assert abs(uncapped - loss) > 1e-2, "the cap must change the loss, or this test proves nothing"


def test_gemma2_loss_is_transformers_loss(checkpoint, hf_model):
    """``loss_and_grads`` of one document (it applies the model's cap) equals transformers' own
    ``Gemma2ForCausalLM(input_ids, labels=...)`` loss, which soft-caps inside its forward."""
    doc = family_examples()[0]
    batch = collate([doc])
    hf = hf_model("gemma2")
    with torch.no_grad():
        want = float(hf(input_ids=torch.tensor([doc["input_ids"]]), labels=torch.tensor([doc["input_ids"]])).loss)
    for loss_type in ("nll", "chunked_nll", "fused_linear"):
        got, _ = loss_and_grads(load_pretrained(checkpoint("gemma2")), batch, loss_type, chunk_size=8)
        assert abs(got - want) <= LOSS_REL * want, (loss_type, got, want)


def test_dpo_log_probs_soft_cap_like_transformers(checkpoint, hf_model):
    """Gemma 2's sequence log-probs, every kernel, equal the sum of ``log_softmax`` of transformers' own
    (soft-capped) logits of each document: within ``token_loss_abs`` per scored token."""
    from twinseq.common.data.preference_batching import collate_preference, sequence_logps_from_logits
    from twinseq.torch_backend.dpo import compute_sequence_logps
    from twinseq.torch_backend.logprobs import LOGPS_LOSS_TYPES

    rng = np.random.default_rng(0)
    rows = [{f"{k}_input_ids": rng.integers(3, 512, n).tolist() for k, n in zip(("prompt", "chosen", "rejected"),
                                                                                 lens)}
            for lens in ((5, 9, 4), (3, 12, 7))]
    pb = collate_preference(rows)
    logits_BTV = np.zeros((*pb.batch.shape, FAMILY_CASES["gemma2"].vocab_size), np.float32)
    for row in range(pb.batch.shape[0]):
        real = np.flatnonzero(pb.batch.segment_ids[row] != 0)
        logits_BTV[row, real] = hf_document_logits(hf_model("gemma2"), pb.batch.input_ids[row, real].tolist())
    want = np.concatenate(sequence_logps_from_logits(logits_BTV, pb))  # float64 from HF's float32 logits
    model = load_pretrained(checkpoint("gemma2"))
    for kernel in LOGPS_LOSS_TYPES:
        got = np.concatenate(compute_sequence_logps(model, pb, loss_type=kernel, chunk_size=4))
        assert (np.abs(got - want) <= TOKEN_LOSS_ABS * pb.num_target_tokens).all(), (kernel, got - want)


@pytest.mark.parametrize("name, cap", SOFTCAP_CASES)
def test_log_prob_kernels_soft_cap_values_and_gradients(checkpoint, batches, name, cap):
    """``token_logps`` of every kernel with ``logit_softcap`` equals the full-logits kernel (values and the
    gradients of a non-constant upstream, as DPO's), which equals the naive capped ``log_softmax``."""
    from twinseq.torch_backend.logprobs import LOGPS_LOSS_TYPES, TargetRows, token_logps

    model = load_pretrained(checkpoint(name), attn_implementation="eager")
    cap = final_logit_softcap(model) if cap is None else cap
    batch = batches["packed"]
    targets_N = shift_labels(batch.labels).reshape(-1)
    idx = np.flatnonzero(targets_N != -100)
    as_long = lambda a: torch.as_tensor(a, dtype=torch.long)  # noqa: E731
    rows = TargetRows(as_long(idx), as_long(targets_N[idx]), as_long(np.zeros_like(idx)), 1)
    upstream = torch.randn(len(idx), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = forward_hidden(model, batch)
    out = {}
    for kernel in LOGPS_LOSS_TYPES:
        h = hidden.clone().requires_grad_()
        w = model.lm_head.weight.detach().clone().requires_grad_()
        logps = token_logps(h, w, rows, kernel, chunk_size=8, logit_softcap=cap)
        out[kernel] = (logps.detach().numpy(), *(g.numpy() for g in torch.autograd.grad(logps, (h, w), upstream)))
    with torch.no_grad():
        capped = torch.tanh(model.lm_head(hidden).reshape(-1, model.config.vocab_size) / cap) * cap
        naive = torch.log_softmax(capped, -1)[rows.idx_n, rows.targets_n].numpy()
    assert np.abs(out["nll"][0] - naive).max() <= TOKEN_LOSS_ABS
    for kernel, (logps, g_h, g_w) in out.items():
        assert np.abs(logps - out["nll"][0]).max() <= TOKEN_LOSS_ABS, kernel
        assert rel_err(g_h, out["nll"][1]) <= GRAD_REL and rel_err(g_w, out["nll"][2]) <= GRAD_REL, kernel


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_fused_kernels_differentiate_the_cap_exactly_in_float64(chunk_size):
    """Both custom backwards (loss and log-probs) against autograd of the naive capped expression, float64:
    the ``1 - tanh^2`` factor is exact, not just close."""
    from twinseq.torch_backend.logprobs import FusedLinearTokenLogps
    from twinseq.torch_backend.losses import FusedLinearCrossEntropy

    gen = torch.Generator().manual_seed(0)
    n, h, v, cap = 11, 8, 37, 1.5
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[3] = -100
    def capped():
        return torch.tanh((hidden @ weight.T) / cap) * cap

    naive_loss = F.cross_entropy(capped(), targets, ignore_index=-100, reduction="sum") / 20
    valid = torch.nonzero(targets != -100).squeeze(1)
    fused_loss, _ = FusedLinearCrossEntropy.apply(hidden, weight, None, targets, valid, 20, chunk_size, False, cap)
    for a, b in zip(torch.autograd.grad(fused_loss, (hidden, weight)),
                    torch.autograd.grad(naive_loss, (hidden, weight))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(fused_loss, naive_loss, rtol=1e-13, atol=0)
    upstream = torch.randn(len(valid), generator=gen, dtype=torch.float64)
    naive = torch.log_softmax(capped()[valid], -1)[torch.arange(len(valid)), targets[valid]]
    fused = FusedLinearTokenLogps.apply(hidden[valid], weight, targets[valid], chunk_size, cap)
    torch.testing.assert_close(fused, naive, rtol=1e-13, atol=1e-13)
    for a, b in zip(torch.autograd.grad(fused, (hidden, weight), upstream),
                    torch.autograd.grad(naive, (hidden, weight), upstream)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("bad", [0, -1.0, True, "30"])
def test_a_bad_logit_softcap_is_refused(bad):
    hidden, weight, labels = torch.zeros(1, 3, 4), torch.zeros(5, 4), torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"logit_softcap=.* must be a positive number"):
        causal_lm_loss(hidden, weight, labels, 2, logit_softcap=bad)


def test_liger_dpo_refuses_a_soft_capped_model():
    from twinseq.common.objectives.dpo import validate_dpo_config
    from twinseq.torch_backend.dpo import check_liger_dpo

    config = validate_dpo_config(["sigmoid"], [1.0], beta=0.1)
    with pytest.raises(ConfigError, match=r"no final logit soft-cap.*'gemma2'.*final_logit_softcapping=30.0"):
        check_liger_dpo(config, padding_free=False, device="cuda", logit_softcap=30.0, model_type="gemma2")


# --------------------------------------------------------------------------------------
# Dynamic RoPE is stateless; sdpa falls back to eager for soft-capped attention
# --------------------------------------------------------------------------------------


def test_dynamic_rope_depends_on_the_current_batch_only(checkpoint, hf_model, batches):
    """Batch A's longest position is 22, batch B's 21; both exceed max_position_embeddings (20), so both
    stretch RoPE. transformers keeps A's stretch for B (it only grows, or resets below 20); twinseq
    recomputes per batch, so B's logits do not depend on whether A ran first, in either order."""
    name = "llama-dynamic-rope"
    a, b = batches["packed"], collate([{"input_ids": family_examples()[0]["input_ids"][:22]}])
    assert int(a.position_ids.max()) == 22
    assert int(b.position_ids.max()) == 21 > FAMILY_CASES[name].max_position_embeddings
    fresh = {k: logits(load_pretrained(checkpoint(name)), x) for k, x in (("a", a), ("b", b))}
    model = load_pretrained(checkpoint(name))
    for first, second in (("a", "b"), ("b", "a"), ("a", "b")):
        logits(model, {"a": a, "b": b}[first])
        np.testing.assert_array_equal(logits(model, {"a": a, "b": b}[second]), fresh[second])
    # the control: transformers' own module carries A's frequencies into B (so this test can fail)
    hf = hf_model(name)
    ids_a, ids_b = ([x.input_ids[0][x.segment_ids[0] == 1].tolist()] for x in (collate(family_examples()[:1]), b))
    hf_document_logits(hf, [3] * 4)  # back to the original frequencies (HF resets below 20)
    before = hf_document_logits(hf, ids_b[0])
    hf_document_logits(hf, ids_a[0])
    after = hf_document_logits(hf, ids_b[0])
    assert np.abs(after - before).max() > 1e-4


def test_sdpa_runs_eager_for_soft_capped_attention(checkpoint, batches, caplog):
    from twinseq.torch_backend import attention

    attention._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="twinseq.torch_backend.attention"):
        model = load_pretrained(checkpoint("gemma2"), attn_implementation="sdpa")
        built = build_model(FAMILY_CASES["gemma2"], read_hf_checkpoint(checkpoint("gemma2"))[1])
        logits(model, batches["packed"])
    assert model.config._attn_implementation == built.config._attn_implementation == "eager"
    said = [r.getMessage() for r in caplog.records if "cannot soft-cap" in r.getMessage()]
    assert len(said) == 1 and "'eager'" in said[0] and "attn_logit_softcapping=0.5" in said[0], said
    eager = load_pretrained(checkpoint("gemma2"), attn_implementation="eager")
    np.testing.assert_array_equal(logits(model, batches["packed"]), logits(eager, batches["packed"]))
    # a model without soft-capping keeps sdpa
    assert load_pretrained(checkpoint("mistral")).config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpointing_and_offloading_keep_every_familys_gradients(checkpoint, batches, name):
    """Per-layer activation checkpointing (``parallel.parallelize``'s step 2) and activation offloading find the
    decoder layers of every family, and change nothing: the same loss and gradients, bitwise."""
    from twinseq.torch_backend.memory import ActivationOffloader, apply_activation_checkpointing

    model = load_pretrained(checkpoint(name), attn_implementation="varlen")
    want_loss, want = loss_and_grads(model, batches["packed"])
    apply_activation_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    with ActivationOffloader(model, allow_cpu_for_testing=True) as offloader:
        loss, grads = loss_and_grads(model, batches["packed"])
    assert offloader.stats.num_offloaded > 0 and offloader.live_stashed == 0
    assert loss == want_loss
    for key, value in want.items():
        np.testing.assert_array_equal(grads[key], value, err_msg=key)


# --------------------------------------------------------------------------------------
# Context parallelism
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_ring_context_parallel_refuses_windows_and_soft_caps(checkpoint, name):
    from twinseq.torch_backend.parallel import use_cp_attention

    cfg = FAMILY_CASES[name]
    model = load_pretrained(checkpoint(name))
    if cfg.sliding_window is None and cfg.attn_logit_softcapping is None:
        use_cp_attention(model, "ring")
        return
    with pytest.raises(ConfigError, match=rf"strategy='ring' cannot .* model_type '{cfg.model_type}' "
                                          rf".*(sliding_window|attn_logit_softcapping).*allgather"):
        use_cp_attention(model, "ring")


@pytest.mark.parametrize("window, cap", [(None, None), (4, None), (None, 0.5), (4, 0.5)])
def test_allgather_ranks_equal_dense_attention_with_window_and_softcap(window, cap):
    """Each rank's queries against the gathered keys (2 ranks, simulated in one process, zigzag order) equal
    transformers' eager Gemma 2 attention on the whole row, with the window and the cap."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from twinseq.common.data.context_parallel import cp_permutation
    from twinseq.torch_backend import context_parallel as cpmod
    from twinseq.torch_backend.attention import document_mask

    cp, batch = 2, family_batches()["packed"]
    B, T = batch.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    seg, pos = (torch.as_tensor(x, dtype=torch.long) for x in (batch.segment_ids, batch.position_ids))
    module = SimpleNamespace(num_key_value_groups=2, training=False, head_dim=8)
    dense, _ = eager_attention_forward(module, q, k, v, document_mask(seg, pos, torch.float64, window), scaling=0.3,
                                       softcap=cap)
    perm, L = torch.as_tensor(cp_permutation(T, cp)), T // cp
    for rank in range(cp):
        mine = perm[rank * L:(rank + 1) * L]
        allowed = cpmod.cp_allowed_mask(seg[:, mine], pos[:, mine], seg[:, perm], pos[:, perm], rank * L, window)
        out = cpmod.local_document_attention(q[:, :, mine], k[:, :, perm], v[:, :, perm], allowed, 0.3,
                                             softcap=cap)
        real = (seg[:, mine] != 0)[:, :, None, None]
        # HF's eager takes the softmax in float32 (see test_varlen_honours_window_and_softcap_kwargs)
        assert float(((out.transpose(1, 2) - dense[:, mine]).abs() * real).max()) < 1e-6, rank


@pytest.mark.parametrize("name", SLIDING)
def test_allgather_model_forward_honours_each_layers_window_and_cap(checkpoint, batches, name):
    """The whole model through ``twinseq_cp_allgather`` (one rank): HF passes every layer's ``sliding_window``
    and ``softcap``; the logits equal the eager path's."""
    from twinseq.torch_backend import context_parallel as cpmod
    from twinseq.torch_backend.attention import mask_layout
    from twinseq.torch_backend.parallel import use_cp_attention

    batch = batches["packed"]
    want = logits(load_pretrained(checkpoint(name), attn_implementation="eager"), batch)
    model = load_pretrained(checkpoint(name))
    use_cp_attention(model, "allgather")
    shard = cpmod.shard_for_rank(batch, cp=1, cp_rank=0)
    np.testing.assert_array_equal(shard.input_ids.numpy(), batch.input_ids)  # one rank: the row in order
    ctx = cpmod.make_context(shard, None, "allgather", mask_layout(model.config).sliding_window)
    with torch.no_grad():
        hidden = model.model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False,
                             **{cpmod.CP_KWARG: ctx}).last_hidden_state
        got = model.lm_head(hidden).float()
        cap = final_logit_softcap(model)
        got = (got if cap is None else torch.tanh(got / cap) * cap).numpy()
    real = batch.segment_ids != 0
    diff = float(np.abs(got - want)[real].max())
    print(f"allgather (1 rank) vs eager {name}: {diff:.2e}")
    assert diff <= LOGITS_ABS, diff
    wrong = cpmod.make_context(shard, None, "allgather", None)
    with pytest.raises(ConfigError, match="sliding_window=None"):
        model.model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False,
                    **{cpmod.CP_KWARG: wrong})


# --------------------------------------------------------------------------------------
# config.json and RoPE as transformers reads and computes them
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_minimal_config_json_reads_as_transformers_reads_it(tmp_path, model_type):
    """A hand-written config.json with only model_type and small sizes: common's per-family defaults
    (``_HF_DEFAULTS``) give the config transformers gives, and transformers builds exactly the tensors
    ``parameter_shapes`` lists for it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinseq.common.models.configs import parameter_shapes

    raw = {"model_type": model_type, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf_config = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    ours = from_hf_config(raw)
    assert from_hf_config(hf_config.to_dict()) == ours
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == parameter_shapes(ours)


def test_gemma3_config_round_trips_through_transformers_gemma3_text_config():
    """``to_hf_config`` of a Gemma 3 config is a ``Gemma3TextConfig`` of the same model (RoPE per layer type, layer
    types, caps), which ``from_hf_config`` reads back unchanged; a Hub-style config (``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling``, ``sliding_window_pattern``) reads as transformers reads it."""
    from transformers import Gemma3TextConfig

    cfg = ModelConfig.preset("tiny-gemma3", rope_type="linear", rope_factor=8.0, rope_local_base_freq=2e4,
                             final_logit_softcapping=30.0, num_hidden_layers=3,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    values = to_hf_config(cfg)
    assert values.pop("architectures") == ["Gemma3ForCausalLM"] and values.pop("model_type") == "gemma3_text"
    hf = Gemma3TextConfig(**values)
    assert hf.rope_parameters == {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
    assert (hf.layer_types, hf.final_logit_softcapping, hf.attn_logit_softcapping) == (cfg.layer_types, 30.0, None)
    assert from_hf_config(hf.to_dict()) == cfg
    hub = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=5e5,
                           rope_local_base_freq=2e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                           sliding_window_pattern=3, sliding_window=32)
    ours = from_hf_config(hub.to_dict())
    assert ours.layer_types == hub.layer_types and ours.layer_types.count("full_attention") == 2
    assert to_hf_config(ours)["rope_parameters"] == hub.rope_parameters
    assert from_hf_config(Gemma3TextConfig(**{**values, "layer_types": None}).to_dict()).layer_types == [
        "sliding_attention"] * 3  # without layer_types transformers' pattern (every 6th global) decides


def _hf_rotary(cfg):
    """The family's own transformers rotary module for ``cfg`` (its inverse frequencies at init)."""
    import importlib

    family = cfg.model_type.removesuffix("_text")  # gemma3_text lives in transformers.models.gemma3
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = getattr(module, ARCHITECTURES[cfg.model_type].replace("ForCausalLM", "RotaryEmbedding"))
    return rotary(to_hf_model_config(cfg))


@pytest.mark.parametrize("name", FAMILIES)
def test_rope_inverse_frequencies_are_transformers_bit_for_bit(name):
    from twinseq.common.models.rope import rope_inv_freq

    from twinseq.common.models.rope import sliding_rope_inv_freq

    cfg = FAMILY_CASES[name]
    rotary = _hf_rotary(cfg)
    if cfg.rope_local_base_freq is None:
        np.testing.assert_array_equal(rope_inv_freq(cfg), rotary.original_inv_freq.numpy())
        return
    # Gemma 3: one buffer per layer type; the global one carries the linear scaling, the sliding one does not
    np.testing.assert_array_equal(rope_inv_freq(cfg), rotary.full_attention_original_inv_freq.numpy())
    np.testing.assert_array_equal(sliding_rope_inv_freq(cfg), rotary.sliding_attention_original_inv_freq.numpy())
    assert not np.array_equal(rope_inv_freq(cfg), sliding_rope_inv_freq(cfg))


def _hf_model_of(cfg, weights):
    """transformers' own model of ``cfg`` (eager, eval mode) holding the HF-named numpy ``weights``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = to_hf_config(cfg)
    values.pop("architectures")
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def test_gemma3_rope_bases_scaling_and_final_softcap_follow_transformers(checkpoint, hf_model, batches):
    """Gemma 3's sliding layers rotate with ``rope_local_base_freq``, its global layers with ``rope_theta``: the
    checkpoint matches transformers (``test_logits_equal_transformers_per_document``), and the same weights with the
    two bases swapped give other logits (the control). Linear RoPE scaling (Gemma 3 4B's factor 8) stretches the
    global layers only, and a final soft-cap, absent from Gemma 3 by default, is applied when the config sets one:
    both as transformers' ``Gemma3ForCausalLM`` computes them, on every training path."""
    from twinseq.common.models.rope import sliding_rope_inv_freq

    cfg, batch = FAMILY_CASES["gemma3"], batches["padded"]
    _, weights = read_hf_checkpoint(checkpoint("gemma3"))
    refs = hf_reference_logits(hf_model("gemma3"), "gemma3", batch)
    swapped = dataclasses.replace(cfg, rope_theta=cfg.rope_local_base_freq, rope_local_base_freq=cfg.rope_theta)
    swapped_diff = max_logit_diff(logits(build_model(swapped, weights), batch), batch, refs)
    print(f"gemma3 with the two RoPE bases swapped: {swapped_diff:.1e} from transformers")
    assert swapped_diff > 1e-3, swapped_diff
    for variant in (dict(rope_type="linear", rope_factor=8.0), dict(final_logit_softcapping=1.5)):
        other = dataclasses.replace(cfg, **variant)
        want = hf_reference_logits(_hf_model_of(other, weights), "gemma3", batch)
        for attn in TRAINING_PATHS:
            got = logits(build_model(other, weights, attn_implementation=attn), batch)
            diff = max_logit_diff(got, batch, want)
            print(f"gemma3 {variant} {attn} vs transformers: {diff:.2e}")
            assert diff <= LOGITS_ABS, (variant, attn, diff)
        assert max_logit_diff(got, batch, refs) > 1e-3, variant  # the variant is another model (the control)
    linear = dataclasses.replace(cfg, rope_type="linear", rope_factor=8.0)
    np.testing.assert_array_equal(rope_inv_freq_of(linear), rope_inv_freq_of(cfg) / np.float32(8.0))
    np.testing.assert_array_equal(sliding_rope_inv_freq(linear), sliding_rope_inv_freq(cfg))
    capped = logits(build_model(dataclasses.replace(cfg, final_logit_softcapping=1.5), weights), batch)
    assert np.abs(capped[batch.segment_ids != 0]).max() < 1.5


def rope_inv_freq_of(cfg) -> np.ndarray:
    """transformers' inverse frequencies of the global layers of a Gemma 3 ``cfg``."""
    return _hf_rotary(cfg).full_attention_original_inv_freq.numpy()


@pytest.mark.parametrize("seq_len", [5, 20, 21, 23, 64, 1000, 100_000])
def test_dynamic_rope_frequencies_within_4_ulps(seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from twinseq.common.models.rope import dynamic_inv_freq

    cfg = FAMILY_CASES["llama-dynamic-rope"]
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](to_hf_model_config(cfg), None, seq_len=seq_len)
    np.testing.assert_array_max_ulp(dynamic_inv_freq(cfg, seq_len - 1), want.numpy(), maxulp=4)


# --------------------------------------------------------------------------------------
# What twinseq does not build
# --------------------------------------------------------------------------------------


def test_an_unsupported_model_type_is_refused_with_the_supported_list(tmp_path):
    """A real transformers checkpoint of another architecture (GPT-2) is refused before anything loads, and
    a GPT-2 model object handed to the backend is refused too, each naming the model_type and the list."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinseq.torch_backend.attention import mask_layout

    config = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    gpt2 = AutoModelForCausalLM.from_config(config)
    gpt2.save_pretrained(tmp_path / "gpt2")
    supported = r".*".join(MODEL_TYPES)
    with pytest.raises(ValueError, match=rf"model_type='gpt2' is not supported; twinseq builds {supported}"):
        load_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match=rf"model_type='gpt2' is not supported; twinseq builds {supported}"):
        model_config_of(gpt2)
    with pytest.raises(ConfigError, match=rf"model_type='gpt2' is not supported; twinseq builds {supported}"):
        mask_layout(gpt2.config)


# --------------------------------------------------------------------------------------
# Qwen3-MoE and Mixtral: the load-balancing loss in the training loss
# --------------------------------------------------------------------------------------


def _moe_with_aux(checkpoint, name):
    """(config with ``output_router_logits``, the checkpoint's weights) of the MoE case ``name``."""
    cfg, weights = read_hf_checkpoint(checkpoint(name))
    return dataclasses.replace(cfg, output_router_logits=True), weights


@pytest.mark.parametrize("name", MOE)
def test_moe_training_loss_adds_router_aux_loss_as_transformers(checkpoint, hf_model, batches, name):
    """With ``output_router_logits`` the loss of one micro-batch is transformers' ``loss + router_aux_loss_coef *
    aux_loss`` (the aux loss over the real tokens: HF's ``attention_mask``), on every training path; without it,
    the NLL alone (the control: the two differ by the weighted aux loss)."""
    from twinseq.torch_backend.model import compute_loss

    cfg, weights = _moe_with_aux(checkpoint, name)
    batch = batches["padded"]
    with torch.no_grad():
        out = hf_model(name)(
            input_ids=torch.as_tensor(batch.input_ids, dtype=torch.long),
            attention_mask=torch.as_tensor(batch.segment_ids != 0, dtype=torch.long),
            labels=torch.as_tensor(batch.labels, dtype=torch.long), num_items_in_batch=batch.num_items_in_batch,
            output_router_logits=True, use_cache=False)
    want = float(out.loss)
    for attn in TRAINING_PATHS:
        with torch.no_grad():
            got, metrics = compute_loss(build_model(cfg, weights, attn_implementation=attn), batch,
                                        return_metrics=True)
        print(f"{name} {attn}: loss with aux {float(got):.7f} vs transformers {want:.7f}, "
              f"aux {float(metrics['aux_loss']):.7f} vs {float(out.aux_loss):.7f}")
        assert abs(float(got) - want) <= LOSS_REL * abs(want), attn
        assert abs(float(metrics["aux_loss"]) - float(out.aux_loss)) <= 1e-6, attn
    with torch.no_grad():
        plain = float(compute_loss(build_model(dataclasses.replace(cfg, output_router_logits=False), weights), batch))
    assert abs((want - plain) - cfg.router_aux_loss_coef * float(out.aux_loss)) <= 1e-6
    assert want - plain > 1e-4


@pytest.mark.parametrize("name", MOE)
def test_moe_aux_loss_is_a_per_micro_batch_mean_under_accumulation(checkpoint, batches, name):
    """Three micro-batches of one step (the three documents, each normalised by the step's label count) through
    the trainer's loss module with ``gradient_accumulation_steps=3``: their losses sum to the step's NLL plus
    ``coef`` times the *mean* of the micro-batches' aux losses (TRL's rule), not their sum."""
    from twinseq.common.config import DataConfig, TrainConfig
    from twinseq.torch_backend.losses import CausalLMLoss
    from twinseq.torch_backend.model import compute_loss

    cfg, weights = _moe_with_aux(checkpoint, name)
    model = build_model(cfg, weights, attn_implementation="eager")
    module = CausalLMLoss(model, TrainConfig(data=DataConfig(gradient_accumulation_steps=3)))
    with torch.no_grad():
        parts = [module(micro) for micro in batches["separate"]]
        plain = build_model(dataclasses.replace(cfg, output_router_logits=False), weights, attn_implementation="eager")
        nll = float(compute_loss(plain, batches["padded"]))
    total = sum(float(loss) for loss, _ in parts)
    auxes = [float(metrics["aux_loss"]) for _, metrics in parts]
    assert abs(total - (nll + cfg.router_aux_loss_coef * float(np.mean(auxes)))) <= 1e-6, (total, nll, auxes)
    assert abs(total - (nll + cfg.router_aux_loss_coef * float(np.sum(auxes)))) > 1e-4  # the control
