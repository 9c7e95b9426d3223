"""The JAX backend against transformers itself, for every model family (``parity_tests/families.py``).

For each case, transformers builds a random model, perturbs every parameter (norm scales, biases and
Gemma's zero-initialised norms included) and saves it; the JAX backend loads that folder by path. The
reference is always transformers' own forward (its masks, RoPE and modules), never twinseq code.

Invariants:
- float32 logits of the padded and packed batches equal HF's forward on each document alone at every
  non-padding position, within ``logits_abs``. ``llama-dynamic-rope`` is compared with HF's forward on
  the padded batch instead: dynamic RoPE takes its frequencies from the batch's longest document, in
  transformers as in twinseq, so a short document alone is a different computation;
- per-token NLL within ``token_loss_abs`` of HF's forward in float64 (HF's own modules, run in double
  precision; as ``numpy_reference`` is for the Llama suite), once the part of the difference that the
  float32 logits' own error explains is removed (``nll_change_from_logits``): the logits are held to
  ``logits_abs`` above, the loss arithmetic to ``token_loss_abs`` here. HF's own float32 forward is up
  to 1.7e-6 away from that float64 forward on these checkpoints (qwen2-sliding, Intel Xeon; 1.2e-6 on
  an AMD EPYC), so no float32 forward can be held to 1e-6 in NLL against either; the raw distances are
  printed next to ours;
- loss within ``loss_rel`` and every gradient within ``grad_rel`` (per tensor) of HF's float32
  autograd over the same documents, normalised by the step's label count;
- the checkpoint round trip is bitwise: HF folder -> JAX load -> JAX save holds identical tensors (Qwen3-MoE's and
  Mixtral's per-expert tensors, as transformers saves them, fused as transformers loads them),
  and ``AutoModelForCausalLM.from_pretrained`` of the JAX-saved folder computes logits identical to
  the original HF model's;
- Qwen3-MoE's, Mixtral's and gpt-oss's load-balancing loss equals transformers' within 1e-6;
- gpt-oss on every JAX attention path (dense, blocked in tiles smaller than the row, the ring on 4 host devices)
  within ``logits_abs`` of transformers, and far from it with the attention sinks zeroed (the control); YaRN's
  frequencies and attention factor bit for bit transformers'.
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from parity_tests.families import FAMILIES, FAMILY_CASES, family_batches, hf_document_logits, hf_random_checkpoint
from parity_tests.inputs import rel_norm
from parity_tests.tolerances import nll_change_from_logits, tol
from twinseq.common.models.hf_folder import fuse_experts_
from twinseq.common.objectives.nll import shift_labels

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("jax")

LAYOUTS = ("padded", "packed")
BATCH_DEPENDENT = ("llama-dynamic-rope",)
"""Cases whose reference is HF's forward on the padded batch (see the module docstring)."""


class Case:
    """One family: the HF folder, HF's float32 and float64 models, the JAX model loaded by path."""

    def __init__(self, name: str, directory) -> None:
        import twinseq.jax_backend as jb

        self.name = name
        self.path = hf_random_checkpoint(name, directory / name)
        load = transformers.AutoModelForCausalLM.from_pretrained
        self.hf = load(self.path, dtype=torch.float32).eval()
        # transformers' default MoE experts (grouped_mm) take no float64; its eager loop is the same experts
        moe = {"experts_implementation": "eager"} if FAMILY_CASES[name].num_experts else {}
        self.hf64 = load(self.path, dtype=torch.float64, **moe).eval()
        self.jax = jb.load_pretrained(self.path)
        self.batches = family_batches()

    def documents(self, layout: str):
        """[(row, columns, document index)] of every document of the layout, in document order."""
        batch, out = self.batches[layout], []
        for row in range(batch.shape[0]):
            for seg in range(1, int(batch.segment_ids[row].max()) + 1):
                out.append((row, np.nonzero(batch.segment_ids[row] == seg)[0]))
        return [(row, cols, doc) for doc, (row, cols) in enumerate(out)]

    def hf_logits(self, model) -> list:
        """HF logits [n, V] of every document (a float tensor with grad if grad is enabled)."""
        if self.name in BATCH_DEPENDENT:
            padded = self.batches["padded"]
            out = model(input_ids=torch.tensor(padded.input_ids, dtype=torch.long),
                        attention_mask=torch.tensor(padded.segment_ids != 0, dtype=torch.long), use_cache=False)
            lengths = (padded.segment_ids != 0).sum(1)
            return [out.logits[i, :n] for i, n in enumerate(lengths)]
        return [model(input_ids=torch.tensor(b.input_ids, dtype=torch.long), use_cache=False).logits[0]
                for b in self.batches["separate"]]

    def hf_token_nll(self, model) -> list[np.ndarray]:
        with torch.no_grad():
            return [_token_nll(logits, b) for logits, b in zip(self.hf_logits(model), self.batches["separate"])]

    def hf_loss_and_grads(self):
        """HF float32 autograd: Σ over documents of the summed NLL / the step's label count."""
        self.hf.zero_grad()
        num_items = self.batches["padded"].num_items_in_batch
        nll = [_token_nll_tensor(logits, b) for logits, b in zip(self.hf_logits(self.hf), self.batches["separate"])]
        loss = sum(n.sum() for n in nll) / num_items
        loss.backward()
        return float(loss.detach()), {k: p.grad.numpy().copy() for k, p in self.hf.named_parameters()}


def _token_nll_tensor(logits_TV, batch):
    targets_T = torch.from_numpy(shift_labels(batch.labels)[0]).long()
    return torch.nn.functional.cross_entropy(logits_TV, targets_T, ignore_index=-100, reduction="none")


def _token_nll(logits_TV, batch) -> np.ndarray:
    return _token_nll_tensor(logits_TV, batch).double().numpy()


@pytest.fixture(scope="module")
def cases(tmp_path_factory, exact_fp32):
    made: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in made:
            made[name] = Case(name, tmp_path_factory.mktemp("families"))
        return made[name]

    return get


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hf_forward_of_each_document(cases, name, layout):
    import twinseq.jax_backend as jb

    case = cases(name)
    got = jb.logits(case.jax, case.batches[layout])
    if name in BATCH_DEPENDENT:
        with torch.no_grad():
            want = [x.numpy() for x in case.hf_logits(case.hf)]
    else:
        want = [hf_document_logits(case.hf, b.input_ids[0].tolist()) for b in case.batches["separate"]]
    diff = max(float(np.abs(got[row, cols] - want[doc]).max()) for row, cols, doc in case.documents(layout))
    print(f"{name} {layout}: max |logits - HF| = {diff:.2e}")
    assert diff <= tol("float32", "logits_abs")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_token_nll_matches_hf(cases, name, layout):
    import twinseq.jax_backend as jb

    case = cases(name)
    got = np.asarray(jb.token_losses(case.jax, case.batches[layout]), np.float64)
    logits = jb.logits(case.jax, case.batches[layout])
    ref64, ref32 = case.hf_token_nll(case.hf64), case.hf_token_nll(case.hf)
    with torch.no_grad():
        logits64 = [x.numpy() for x in case.hf_logits(case.hf64)]
    targets = [shift_labels(b.labels)[0] for b in case.batches["separate"]]
    raw = max(float(np.abs(got[row, cols] - ref64[doc]).max()) for row, cols, doc in case.documents(layout))
    # the loss arithmetic's own error: the NLL error less what the float32 logits' error explains
    ours = max(float(np.abs(got[row, cols] - ref64[doc]
                            - nll_change_from_logits(logits[row, cols], logits64[doc], targets[doc])).max())
               for row, cols, doc in case.documents(layout))
    vs32 = max(float(np.abs(got[row, cols] - ref32[doc]).max()) for row, cols, doc in case.documents(layout))
    hf_own = max(float(np.abs(a - b).max()) for a, b in zip(ref32, ref64))
    print(f"{name} {layout}: token NLL |jax - HF fp64| = {raw:.2e} ({ours:.2e} less the logits' part), "
          f"|jax - HF fp32| = {vs32:.2e}, |HF fp32 - HF fp64| = {hf_own:.2e}")
    assert ours <= tol("float32", "token_loss_abs")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_gradients_match_hf_autograd(cases, name, layout):
    import twinseq.jax_backend as jb

    case = cases(name)
    want_loss, want = case.hf_loss_and_grads()
    loss, grads = jb.loss_and_grads(case.jax, case.batches[layout])
    assert set(grads) == set(want)
    worst = max(want, key=lambda k: rel_norm(grads[k], want[k]))
    print(f"{name} {layout}: loss rel {abs(loss - want_loss) / want_loss:.2e}, worst grad rel "
          f"{rel_norm(grads[worst], want[worst]):.2e} ({worst})")
    assert abs(loss - want_loss) <= tol("float32", "loss_rel") * abs(want_loss)
    assert rel_norm(grads[worst], want[worst]) <= tol("float32", "grad_rel")


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_to_jax_to_hf_checkpoint_is_bitwise(cases, name, tmp_path):
    from twinseq.jax_backend.checkpoint import save_pretrained

    case = cases(name)
    save_pretrained(case.jax, tmp_path)
    first = load_file(str(case.path / "model.safetensors"))
    second = load_file(str(tmp_path / "model.safetensors"))
    # transformers writes one tensor per MoE expert (the Hub's layout), twinseq the fused tensors they load as
    fuse_experts_(case.jax.config, first, lambda parts, axis: np.stack([np.concatenate(p) for p in parts], axis))
    if case.jax.config.tie_word_embeddings and "lm_head.weight" in first:  # a tied copy twinseq does not store
        assert np.array_equal(first.pop("lm_head.weight"), first["model.embed_tokens.weight"])
    assert set(first) == set(second)
    for key in first:
        assert first[key].dtype == second[key].dtype and first[key].tobytes() == second[key].tobytes(), key

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back) is type(case.hf)
    ids = torch.tensor([case.batches["separate"][0].input_ids[0].tolist()])
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, use_cache=False).logits, case.hf(input_ids=ids, use_cache=False).logits)


def _hf_gemma3(cfg):
    """transformers' ``Gemma3ForCausalLM`` of ``cfg``, random weights perturbed as ``hf_random_checkpoint`` does."""
    from parity_tests.families import perturb_
    from twinseq.common.models.configs import to_hf_config

    values = to_hf_config(cfg)
    values.pop("architectures")
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb_(hf, 0)
    return hf


def _max_document_diff(logits_BTV, batch, refs) -> float:
    docs = [(row, seg) for row in range(batch.shape[0]) for seg in range(1, int(batch.segment_ids[row].max()) + 1)]
    return max(float(np.abs(logits_BTV[row, batch.segment_ids[row] == seg] - ref).max())
               for (row, seg), ref in zip(docs, refs, strict=True))


@pytest.mark.parametrize("variant", [dict(rope_type="linear", rope_factor=8.0), dict(final_logit_softcapping=1.5)],
                         ids=["linear-rope", "final-softcap"])
def test_gemma3_rope_scaling_and_final_softcap_equal_transformers(variant):
    """Gemma 3 with Gemma 3 4B's linear RoPE scaling (global layers only) or a final soft-cap (absent by default):
    JAX's fp32 logits of the padded and packed batches equal transformers' ``Gemma3ForCausalLM`` on each document
    alone, and differ from the plain case's (the control: the variant is another model)."""
    import dataclasses

    import twinseq.jax_backend as jb
    from parity_tests.families import FAMILY_CASES, family_examples

    plain = FAMILY_CASES["gemma3"]
    hf = _hf_gemma3(dataclasses.replace(plain, **variant))
    weights = {k: p.detach().numpy().copy() for k, p in hf.named_parameters()}
    model = jb.build_model(dataclasses.replace(plain, **variant), weights)
    refs = [hf_document_logits(hf, ex["input_ids"]) for ex in family_examples()]
    plain_hf = _hf_gemma3(plain)
    plain_refs = [hf_document_logits(plain_hf, ex["input_ids"]) for ex in family_examples()]
    batches = family_batches()
    diffs = {layout: _max_document_diff(jb.logits(model, batches[layout]), batches[layout], refs)
             for layout in LAYOUTS}
    control = _max_document_diff(jb.logits(model, batches["packed"]), batches["packed"], plain_refs)
    print(f"gemma3 {variant}: jax vs transformers {diffs}, vs the plain model {control:.2e}")
    assert max(diffs.values()) <= tol("float32", "logits_abs"), diffs
    assert control > 1e-3, control


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_aux_loss_equals_transformers(cases, name, layout):
    """The JAX backend's load-balancing loss (``losses.load_balancing_loss`` of its own router logits, over the
    batch's real tokens) equals transformers' within 1e-6. Padded: HF's ``aux_loss`` of the same batch with the real
    tokens as ``attention_mask``. Packed: HF's attention mask cannot separate documents in one row, so the reference
    is transformers' ``load_balancing_loss_func`` of HF's router logits of each document alone, concatenated (the
    aux loss is one mean over the tokens, not a sum over documents). The control: counting the padding tokens too
    gives another number."""
    import importlib

    import jax.numpy as jnp

    from twinseq.jax_backend.losses import load_balancing_loss

    case = cases(name)
    batch, cfg = case.batches[layout], case.jax.config
    # the family's own copy of the function (transformers keeps one per modeling file)
    load_balancing_loss_func = importlib.import_module(
        f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}").load_balancing_loss_func
    with torch.no_grad():
        if layout == "padded":
            want = float(case.hf(input_ids=torch.tensor(batch.input_ids, dtype=torch.long),
                                 attention_mask=torch.tensor(batch.segment_ids != 0, dtype=torch.long),
                                 output_router_logits=True, use_cache=False).aux_loss)
        else:
            per_doc = [case.hf(input_ids=torch.tensor(batch.input_ids[row, cols][None], dtype=torch.long),
                               output_router_logits=True, use_cache=False).router_logits
                       for row, cols, _ in case.documents(layout)]
            layers = tuple(torch.cat([doc[i] for doc in per_doc]) for i in range(len(per_doc[0])))
            want = float(load_balancing_loss_func(layers, cfg.num_experts, cfg.num_experts_per_tok))
    _, router_logits = case.jax.with_router_logits(*(jnp.asarray(a) for a in (
        batch.input_ids, batch.position_ids, batch.segment_ids)))
    assert len(router_logits) == 2  # qwen3_moe: layer 0 of 3 is dense (mlp_only_layers); the others: both sparse
    real = jnp.asarray((batch.segment_ids != 0).reshape(-1))
    ours = float(load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok, real))
    diff = abs(ours - want)
    print(f"{name} {layout}: aux loss {ours:.8f}, transformers {want:.8f}, |diff| {diff:.1e}")
    assert diff <= 1e-6
    everything = float(load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok,
                                           jnp.ones_like(real)))
    assert abs(everything - ours) > 1e-4


def _ring_attend(mesh):
    """An ``AttendFn`` running ``context_parallel.sharded_attention`` (ring) over ``mesh``'s cp axis, sinks included
    (the row in its own order: the mask reads the ids, so no zigzag is needed for equality)."""
    from twinseq.jax_backend.context_parallel import sharded_attention
    from twinseq.jax_backend.parallel import BATCH_AXES, CP_AXIS

    def attend(q, k, v, seg, pos, scaling, *, sliding_window=None, softcap=None, sinks=None):
        out_BTND = sharded_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), seg, pos, mesh,
                                     axis_name=CP_AXIS, batch_axes=BATCH_AXES, scale=scaling,
                                     sliding_window=sliding_window, softcap=softcap, sinks_N=sinks)
        return out_BTND.transpose(0, 2, 1, 3)

    return attend


GPT_OSS_PATHS = ["eager", pytest.param("blocked", marks=pytest.mark.slow),
                 pytest.param("ring", marks=[pytest.mark.slow, pytest.mark.multi_device])]
"""The fast tier keeps the dense path (and its control); the blocked kernel with sinks is held to the dense one in
the fast tier by tests/jax_backend/test_jax_attention_sinks.py."""


@pytest.mark.parametrize("path", GPT_OSS_PATHS)
def test_gpt_oss_every_attention_path_equals_transformers(cases, path):
    """gpt-oss's fp32 logits of the padded and packed batches equal transformers' ``GptOssForCausalLM`` on each
    document alone on every JAX attention path: the dense reference (``eager``), the blocked kernel in tiles of 8
    (smaller than every row, so the sinks go through its log-sum-exp correction) and the ring over 4 host devices
    (the packed batch only: the padded rows' 23 columns do not split in 4). The control: the same path with every
    sink zeroed is far off on the packed batch (the sinks are not lost in rounding)."""
    import jax
    import jax.numpy as jnp

    import twinseq.jax_backend as jb
    from twinseq.jax_backend.model import CausalLM
    from twinseq.jax_backend.parallel import make_mesh

    case = cases("gpt_oss")
    cfg, weights = case.jax.config, jb.export_weights(case.jax)
    attend = None
    if path == "ring":
        if jax.device_count() < 4:
            pytest.skip(f"needs 4 JAX host devices (the root conftest sets XLA_FLAGS); found {jax.device_count()}")
        attend = _ring_attend(make_mesh(cp=4, devices=jax.devices()[:4]))
    options = dict(attn_implementation="eager") if path == "eager" else dict(attention_block_size=8)
    zeroed = {k: np.zeros_like(w) if k.endswith(".sinks") else w for k, w in weights.items()}
    want = [hf_document_logits(case.hf, b.input_ids[0].tolist()) for b in case.batches["separate"]]
    layouts = ("packed",) if path == "ring" else LAYOUTS
    diffs = {}
    for label, w, label_layouts in (("sinks", weights, layouts), ("zeroed", zeroed, ("packed",))):
        model = CausalLM(cfg, w, **options)
        run = jax.jit(lambda ids, pos, seg, model=model: model.logits(ids, pos, seg, attend=attend))
        for layout in label_layouts:
            batch = case.batches[layout]
            got = np.asarray(run(*(jnp.asarray(a) for a in (batch.input_ids, batch.position_ids, batch.segment_ids))))
            diffs[label, layout] = max(float(np.abs(got[row, cols] - want[doc]).max())
                                       for row, cols, doc in case.documents(layout))
    print(f"gpt_oss {path}: max |logits - HF| {diffs}")
    assert max(diffs["sinks", layout] for layout in layouts) <= tol("float32", "logits_abs")
    assert diffs["zeroed", "packed"] > 100 * tol("float32", "logits_abs")


def test_yarn_inv_freq_and_attention_factor_equal_transformers():
    """``common.models.rope`` computes YaRN's inverse frequencies bit for bit as transformers'
    ``_compute_yarn_parameters`` (truncated and not, a given attention_factor, another beta_fast), and the same
    attention factor; the control: the plain default frequencies differ."""
    import dataclasses

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from twinseq.common.models.configs import to_hf_config
    from twinseq.common.models.rope import default_inv_freq, rope_attention_factor, rope_inv_freq

    base = FAMILY_CASES["gpt_oss"]
    for variant in ({}, dict(rope_truncate=True), dict(rope_attention_factor=1.3, rope_beta_fast=16.0),
                    dict(rope_factor=4.0, rope_original_max_position_embeddings=64, max_position_embeddings=256)):
        cfg = dataclasses.replace(base, **variant)
        values = to_hf_config(cfg)
        values.pop("architectures")
        config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        np.testing.assert_array_equal(rope_inv_freq(cfg), inv_freq.numpy(), err_msg=str(variant))
        assert rope_attention_factor(cfg) == factor, variant
        assert not np.array_equal(default_inv_freq(cfg.head_dim, cfg.rope_theta), inv_freq.numpy())
