"""KTO at TRL 1.16's semantics, against TRL's own code in this process (``_trl_kto``: a real ``KTOTrainer``'s
``_compute_loss`` on a batch its own collator builds from token-id rows, the real forward of a float64 tiny Llama,
precomputed reference log-probs chosen here; its ``_prepare_dataset``; ``trl.data_utils.unpair_preference_dataset``).

Invariants:
- loss: for 'kto' and 'apo_zero_unpaired', several betas, desirable/undesirable weights != 1, batches of mixed
  labels, all desirable and all undesirable, the numpy reference ``kto_loss`` fed TRL's policy, reference and KL
  log-probs gives TRL's loss, KL and reward metrics within 1e-6 (to rounding, in fact), its ``logps/*`` metrics to
  1e-6 relative (TRL sums float32 log-probs there: float32 spacing at 20 is 2e-6), and its central
  differences give TRL's d loss / d sequence log-prob; torch's ``kto_from_logps`` on the same log-probs gives TRL's
  loss and, by autograd, the same gradient (none reaching the mismatched pairs' log-probs, which TRL scores without
  a graph); so does JAX's ``kto_from_logps`` when jax is installed;
- end to end: twinseq's ``collate_unpaired`` + ``kto_forward`` on the same weights gives TRL's loss and TRL's
  gradient of every model parameter within 1e-6, padded and padding-free, with mismatched sequences cut by
  ``max_length`` as TRL's collator cuts them (the sequences both sides build are compared token by token). The
  sequence log-probs themselves agree to ~1e-5 only: TRL's fused LM head returns float32 log-probs even for a
  float64 model (``_trl_kto``), twinseq's kernels work in the model's dtype;
- the KL estimate: TRL's logged ``kl`` equals ``kl_estimate`` of TRL's mismatched-pair log-probs (and torch's), the
  clamp at 0 included; 'apo_zero_unpaired' logs 0;
- data: ``unpair_rows`` orders rows as ``unpair_preference_dataset`` (blocks of 1000 pairs: chosen, then rejected),
  and ``add_kl_completions`` with block = ``per_device_train_batch_size`` gives ``_prepare_dataset``'s
  ``KL_completion_ids``; twinseq's ``tokenize_kto`` of unpaired and paired string rows (the tiny word-level
  tokenizer: ``"w7"`` is token 7) gives TRL's ``prompt_ids`` / ``completion_ids`` / ``label``;
- each comparison sees a change (the negative controls): the KL not clamped, the weights swapped, the other loss
  type, another beta, the rotation the other way, the pairs interleaved.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
# the full tier (make test-all, CI): building TRL's trainer takes ~6 s, and the fast tier is at its 10-minute budget;
# the fast tier keeps KTO's numpy reference and each backend's loss against it
pytestmark = pytest.mark.slow

from twinseq.common.data.batching import IGNORE_INDEX  # noqa: E402
from twinseq.common.data.tokenizer import tokenizer_from  # noqa: E402
from twinseq.common.data.unpaired import (  # noqa: E402
    add_kl_completions,
    collate_unpaired,
    kl_sequence,
    tokenize_kto,
    unpair_rows,
)
from twinseq.common.objectives.dpo import NUMPY_OPS  # noqa: E402
from twinseq.common.objectives.kto import (  # noqa: E402
    kl_estimate,
    kto_family,
    kto_loss,
    kto_step_metrics,
    validate_kto_config,
)
from twinseq.torch_backend.kto import kto_forward, kto_from_logps  # noqa: E402

TOL = 1e-6
N = 6
EOS = 1
CONFIGS = [  # loss_type, beta, desirable_weight, undesirable_weight
    ("kto", 0.1, 1.0, 1.0),
    ("kto", 0.1, 1.33, 0.75),
    ("kto", 0.5, 0.6, 1.7),
    ("kto", 2.0, 1.2, 0.8),
    ("apo_zero_unpaired", 0.1, 1.33, 0.75),
    ("apo_zero_unpaired", 1.0, 0.6, 1.7),
]
LABELS = {
    "mixed": [True, False, False, True, False, True],
    "all_desirable": [True] * N,
    "all_undesirable": [False] * N,
}
FAST = {(("kto", 0.1, 1.33, 0.75), "mixed"), (("apo_zero_unpaired", 1.0, 0.6, 1.7), "mixed")}


@pytest.fixture(scope="module")
def trl_kto():
    from tests.torch_backend import _trl_kto

    _trl_kto.warm()  # TRL's import and the first trainer (about 10 s, once per session): the module's setup
    try:  # and JAX's import (about 2 s), when installed
        from twinseq.jax_backend import kto  # noqa: F401
    except ImportError:
        pass
    return _trl_kto


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the summation order does not depend on the cores, and 2-core machines do not stall."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# --------------------------------------------------------------------------------------
# Rows, references, twinseq's side
# --------------------------------------------------------------------------------------


def _token_rows(labels, seed: int = 0, prompt_len=(1, 5), completion_len=(1, 6)) -> list[dict]:
    """TRL-layout token rows: prompts and completions of ids in [3, 64), each completion ending in EOS; the KL
    completions are TRL's rotation of this batch (one block): row i takes row i-1's completion, row 0 the last's."""
    rng = np.random.default_rng(seed)
    rows = []
    for label in labels:
        prompt = rng.integers(3, 64, rng.integers(*prompt_len)).tolist()
        completion = rng.integers(3, 64, rng.integers(*completion_len)).tolist() + [EOS]
        rows.append({"prompt_ids": prompt, "completion_ids": completion, "label": bool(label)})
    completions = [r["completion_ids"] for r in rows]
    for row, kl in zip(rows, completions[-1:] + completions[:-1]):
        row["KL_completion_ids"] = kl
    return rows


def _with_refs(trl_kto, rows, beta: float, kl_target: float, seed: int = 1, max_length=None) -> list[dict]:
    """``rows`` plus reference log-probs around TRL's policy log-probs: log-ratios with beta * r ~ N(0, 1), and
    mismatched-pair log-ratios of mean exactly ``kl_target`` (negative: the clamp must hold the estimate at 0)."""
    rows = [dict(r, ref_logps=0.0, ref_KL_logps=0.0) for r in rows]
    probe = trl_kto.trl_kto_loss_and_grads(rows, max_length=max_length)  # the policy's log-probs, refs unused
    rng = np.random.default_rng(seed)
    ratios = rng.normal(0.0, 1.0 / beta, len(rows))
    spread = rng.normal(0.0, 0.5 / beta, len(rows))
    kl_ratios = spread - spread.mean() + kl_target
    for row, lp, klp, r, d in zip(rows, probe.logps, probe.kl_logps, ratios, kl_ratios):
        row["ref_logps"] = float(lp - r)
        row["ref_KL_logps"] = float(klp - d)
    return rows


def _twinseq_rows(rows) -> list[dict]:
    return [
        {
            "prompt_input_ids": r["prompt_ids"],
            "completion_input_ids": r["completion_ids"],
            "kl_completion_input_ids": r["KL_completion_ids"],
            "label": r["label"],
            "ref_logps": r["ref_logps"],
            "ref_KL_logps": r["ref_KL_logps"],
        }
        for r in rows
    ]


def _kbatch(rows, loss_type: str, max_length=None, padding_free: bool = False):
    return collate_unpaired(
        _twinseq_rows(rows), with_kl=loss_type == "kto", max_length=max_length, padding_free=padding_free
    )


def _refs(rows):
    return np.array([r["ref_logps"] for r in rows]), np.array([r["ref_KL_logps"] for r in rows])


def _numpy(trl_out, rows, loss_type, beta, w_d, w_u):
    ref, ref_kl = _refs(rows)
    labels = np.array([r["label"] for r in rows])
    kl = dict(policy_kl_logps=trl_out.kl_logps, ref_kl_logps=ref_kl) if loss_type == "kto" else {}
    kw = dict(loss_type=loss_type, beta=beta, desirable_weight=w_d, undesirable_weight=w_u)
    return kto_loss(trl_out.logps, ref, labels, **kl, **kw), labels, ref, kl, kw


def _numpy_gradient(trl_out, rows, loss_type, beta, w_d, w_u, h: float = 1e-5) -> np.ndarray:
    """Central differences of the numpy reference's loss in each row's policy log-prob."""
    _, labels, ref, kl, kw = _numpy(trl_out, rows, loss_type, beta, w_d, w_u)
    grad = np.zeros(len(rows))
    for i in range(len(rows)):
        step = np.zeros(len(rows))
        step[i] = h
        up = kto_loss(trl_out.logps + step, ref, labels, **kl, **kw).loss
        down = kto_loss(trl_out.logps - step, ref, labels, **kl, **kw).loss
        grad[i] = (up - down) / (2 * h)
    return grad


def _jax(trl_out, rows, loss_type, beta, w_d, w_u):
    """(loss, d loss / d [logps; KL logps], kl) of ``jax_backend.kto.kto_from_logps`` in float64; None without jax."""
    try:
        import jax
        import jax.numpy as jnp

        from twinseq.jax_backend import kto as jkto
    except ImportError:
        return None
    ref, ref_kl = _refs(rows)
    with_kl = loss_type == "kto"
    config = validate_kto_config(loss_type, beta, w_d, w_u)
    with jax.enable_x64(True):
        logps = jnp.asarray(np.r_[trl_out.logps, trl_out.kl_logps if with_kl else []], jnp.float64)
        refs = jnp.asarray(np.r_[ref, ref_kl if with_kl else []], jnp.float64)
        labels = jnp.asarray([r["label"] for r in rows])

        def f(lp):
            return jkto.kto_from_logps(lp, refs, labels, len(rows), config=config)

        (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(logps)
        return float(loss), np.asarray(grad, np.float64), float(aux["kl"])


def _case_params():
    out = []
    for config in CONFIGS:
        for name in LABELS:
            marks = () if (config, name) in FAST else (pytest.mark.slow,)
            out.append(
                pytest.param(config, name, marks=marks, id=f"{config[0]}-b{config[1]}-w{config[2]}_{config[3]}-{name}")
            )
    return out


# --------------------------------------------------------------------------------------
# (a) the loss, its metrics and its gradient w.r.t. the sequence log-probs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, labels_name", _case_params())
def test_loss_metrics_and_logp_gradients_equal_trls(trl_kto, config, labels_name):
    loss_type, beta, w_d, w_u = config
    rows = _with_refs(trl_kto, _token_rows(LABELS[labels_name]), beta, kl_target=0.3 / beta)
    want = trl_kto.trl_kto_loss_and_grads(
        rows, loss_type=loss_type, beta=beta, desirable_weight=w_d, undesirable_weight=w_u
    )
    # numpy: loss, KL, rewards and log-prob metrics, and the gradient by central differences
    out, labels, ref, _, _ = _numpy(want, rows, loss_type, beta, w_d, w_u)
    assert abs(out.loss - want.loss) <= TOL, (out.loss, want.loss)
    metrics = kto_step_metrics(
        [out.loss],
        {"labels": [labels], "rewards": [out.rewards], "logps": [want.logps]},
        [out.kl],
        num_tokens=0,
        num_label_tokens=0,
    )
    keys = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]
    assert [k for k in keys if k in want.metrics] == [k for k in keys if k in metrics]
    for key in (k for k in keys if k in want.metrics):
        bound = TOL * abs(want.metrics[key]) if key.startswith("logps/") else TOL  # a float32 sum in TRL
        assert abs(metrics[key] - want.metrics[key]) <= bound, (key, metrics[key], want.metrics[key])
    np.testing.assert_allclose(
        _numpy_gradient(want, rows, loss_type, beta, w_d, w_u), want.logps_grad, rtol=0, atol=TOL
    )
    # torch: loss and autograd gradient through kto_from_logps on the same log-probs (the KL ones get none)
    kb = _kbatch(rows, loss_type)
    with_kl = loss_type == "kto"
    leaf = torch.tensor(np.r_[want.logps, want.kl_logps if with_kl else []], dtype=torch.float64, requires_grad=True)
    got = kto_from_logps(leaf, kb, validate_kto_config(loss_type, beta, w_d, w_u))
    got.loss.backward()
    assert abs(float(got.loss.detach()) - want.loss) <= TOL, (float(got.loss.detach()), want.loss)
    assert abs(got.kl - want.metrics["kl"]) <= TOL
    np.testing.assert_allclose(got.rewards.numpy(), out.rewards, rtol=0, atol=TOL)
    np.testing.assert_allclose(leaf.grad[:N].numpy(), want.logps_grad, rtol=0, atol=TOL)
    assert not leaf.grad[N:].any()
    # jax (when installed): the same, through jax_backend.kto.kto_from_logps
    jax_out = _jax(want, rows, loss_type, beta, w_d, w_u)
    if jax_out is not None:
        loss, grad, kl = jax_out
        assert abs(loss - want.loss) <= TOL and abs(kl - want.metrics["kl"]) <= TOL, (loss, want.loss)
        np.testing.assert_allclose(grad[:N], want.logps_grad, rtol=0, atol=TOL)
        assert not grad[N:].any()


# --------------------------------------------------------------------------------------
# (a) end to end: twinseq's collation and forward vs TRL's, gradients of every model parameter
# --------------------------------------------------------------------------------------


def _sequences_twinseq(kb):
    """Per document (completions, then mismatched pairs): (token ids, completion mask) of a padded KTOBatch."""
    b = kb.batch
    out = []
    for d in range(kb.num_docs):
        keep = b.segment_ids[d] != 0
        out.append((b.input_ids[d][keep].tolist(), (b.labels[d][keep] != IGNORE_INDEX).astype(int).tolist()))
    return out


def _sequences_trl(batch, with_kl: bool):
    out = []
    for prefix in ("", "KL_") if with_kl else ("",):
        ids, attn, comp = (batch[f"{prefix}{k}"] for k in ("input_ids", "attention_mask", "completion_mask"))
        for i in range(ids.shape[0]):
            keep = attn[i] == 1
            out.append((ids[i][keep].tolist(), comp[i][keep].tolist()))
    return out


def _end_to_end(trl_kto, config, rows, *, max_length=None, padding_free=False, kernel="fused_linear"):
    loss_type, beta, w_d, w_u = config
    want = trl_kto.trl_kto_loss_and_grads(
        rows, loss_type=loss_type, beta=beta, desirable_weight=w_d, undesirable_weight=w_u, max_length=max_length
    )
    model = trl_kto.policy_model()
    kb = _kbatch(rows, loss_type, max_length=max_length, padding_free=padding_free)
    got = kto_forward(model, kb, validate_kto_config(loss_type, beta, w_d, w_u), loss_type=kernel, chunk_size=16)
    got.loss.backward()
    grads = {name: p.grad.detach().numpy() for name, p in model.named_parameters()}
    return want, got, grads, kb


E2E = [
    pytest.param(("kto", 0.1, 1.33, 0.75), "mixed", None, False, "fused_linear", id="kto-mixed"),
    pytest.param(("apo_zero_unpaired", 1.0, 0.6, 1.7), "mixed", None, False, "fused_linear", id="apo-mixed"),
    pytest.param(
        ("kto", 2.0, 1.2, 0.8),
        "all_undesirable",
        None,
        False,
        "chunked_nll",
        id="kto-b2-undesirable",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        ("kto", 0.5, 0.6, 1.7),
        "all_desirable",
        None,
        True,
        "fused_linear",
        id="kto-desirable-padfree",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        ("kto", 0.5, 0.6, 1.7), "mixed", 7, False, "fused_linear", id="kto-max_length7", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("config, labels_name, max_length, padding_free, kernel", E2E)
def test_model_gradients_equal_trls(trl_kto, config, labels_name, max_length, padding_free, kernel):
    """Same float64 weights, same rows: TRL's collator + fused forward + ``_compute_loss`` vs twinseq's
    ``collate_unpaired`` + ``kto_forward``; the loss and every parameter's gradient within 1e-6."""
    beta = config[1]
    if max_length is None:
        rows = _token_rows(LABELS[labels_name], seed=2)
    else:  # prompt + completion fit max_length, some prompt + mismatched completion do not: TRL's collator cuts them
        rows = _token_rows(LABELS[labels_name], seed=31, prompt_len=(2, 5), completion_len=(2, 5))
        assert all(len(r["prompt_ids"]) + len(r["completion_ids"]) <= max_length for r in rows)
        assert sum(len(r["prompt_ids"]) + len(r["KL_completion_ids"]) > max_length for r in rows) == 2
    rows = _with_refs(trl_kto, rows, beta, kl_target=0.3 / beta, max_length=max_length)
    want, got, grads, kb = _end_to_end(
        trl_kto, config, rows, max_length=max_length, padding_free=padding_free, kernel=kernel
    )
    if not padding_free:
        assert _sequences_twinseq(kb) == _sequences_trl(want.batch, config[0] == "kto")
    if max_length is not None:
        for r, (ids, _) in zip(rows, _sequences_twinseq(kb)[N:]):
            kl = kl_sequence(np.asarray(r["prompt_ids"]), np.asarray(r["KL_completion_ids"]), max_length)
            assert ids == r["prompt_ids"] + kl.tolist() and len(ids) <= max_length
    assert abs(float(got.loss.detach()) - want.loss) <= TOL, (float(got.loss.detach()), want.loss)
    assert abs(got.kl - want.metrics["kl"]) <= TOL
    # the sequence log-probs: TRL's fused head accumulates in float32 (see the module docstring)
    np.testing.assert_allclose(got.logps.detach().numpy(), want.logps, rtol=0, atol=1e-4)
    assert set(grads) == set(want.grads)
    for name, g in grads.items():
        np.testing.assert_allclose(g, want.grads[name], rtol=0, atol=TOL, err_msg=name)
    assert max(np.abs(g).max() for g in want.grads.values()) > 1e-3  # the gradients are not all ~0


# --------------------------------------------------------------------------------------
# (b) the KL estimate
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kl_target", [0.9, 0.0, -0.7], ids=["positive", "zero", "negative-clamped"])
def test_kl_estimate_equals_trls_logged_kl(trl_kto, kl_target):
    rows = _with_refs(trl_kto, _token_rows(LABELS["mixed"], seed=3), 0.5, kl_target=kl_target)
    want = trl_kto.trl_kto_loss_and_grads(rows, loss_type="kto", beta=0.5)
    _, ref_kl = _refs(rows)
    mean = float(np.mean(want.kl_logps - ref_kl))
    assert abs(mean - kl_target) <= 1e-9  # the rows hold the KL we meant
    z = kl_estimate(want.kl_logps, ref_kl)
    assert abs(z - want.metrics["kl"]) <= TOL, (z, want.metrics["kl"])
    assert abs(z - max(0.0, kl_target)) <= 1e-9
    if kl_target < 0:
        assert want.metrics["kl"] == 0.0 and z == 0.0
    leaf = torch.tensor(np.r_[want.logps, want.kl_logps], dtype=torch.float64)
    got = kto_from_logps(leaf, _kbatch(rows, "kto"), validate_kto_config("kto", 0.5))
    assert abs(got.kl - want.metrics["kl"]) <= TOL


def test_apo_zero_unpaired_logs_no_kl(trl_kto):
    rows = _with_refs(trl_kto, _token_rows(LABELS["mixed"], seed=3), 0.5, kl_target=0.9)
    want = trl_kto.trl_kto_loss_and_grads(rows, loss_type="apo_zero_unpaired", beta=0.5)
    assert want.kl_logps is None and "KL_input_ids" not in want.batch
    assert want.metrics["kl"] == 0.0
    ref, _ = _refs(rows)
    out = kto_loss(want.logps, ref, np.array(LABELS["mixed"]), loss_type="apo_zero_unpaired", beta=0.5)
    assert out.kl == 0.0 and abs(out.loss - want.loss) <= TOL


# --------------------------------------------------------------------------------------
# (c) data rules: unpairing, the KL rotation, tokenisation
# --------------------------------------------------------------------------------------


def _random_ids(rng, n, lo=1, hi=4) -> list[list[int]]:
    return [rng.integers(3, 64, rng.integers(lo, hi)).tolist() for _ in range(n)]


@pytest.mark.parametrize("pairs", [5, 2345])  # 2345: three blocks of up to 1000 pairs
def test_unpairing_order_equals_trls(trl_kto, pairs):
    """Token-id rows: TRL's ``unpair_preference_dataset`` only moves column values, so it is run on ids directly."""
    rng = np.random.default_rng(pairs)
    prompts, chosen, rejected = (_random_ids(rng, pairs) for _ in range(3))
    want = trl_kto.trl_unpair_ids(prompts, chosen, rejected)
    got = unpair_rows({"prompt_input_ids": prompts, "chosen_input_ids": chosen, "rejected_input_ids": rejected})
    assert got["prompt_input_ids"] == want["prompt"]
    assert got["completion_input_ids"] == want["completion"]
    assert got["label"] == want["label"]


def _unpaired_strings(n: int, seed: int) -> tuple[list[dict], list[list[int]], list[list[int]]]:
    """Unpaired string rows whose ids are known (``"w7"`` is token 7); the completions do or do not write the EOS."""
    rng = np.random.default_rng(seed)
    prompts, completions = _random_ids(rng, n), _random_ids(rng, n)
    rows = [
        {
            "prompt": " ".join(f"w{t}" for t in p),
            "completion": " " + " ".join(f"w{t}" for t in c) + (" <eos>" if i % 3 == 0 else ""),
            "label": bool(rng.random() < 0.5),
        }
        for i, (p, c) in enumerate(zip(prompts, completions))
    ]
    return rows, prompts, [c + [EOS] for c in completions]


@pytest.mark.parametrize("rows, block", [(11, 2), (11, 3), pytest.param(2101, 4, marks=pytest.mark.slow)])
def test_kl_rotation_and_tokenisation_equal_trls_prepare_dataset(trl_kto, rows, block):
    """Unpaired string rows through TRL's ``_prepare_dataset`` and through twinseq's ``tokenize_kto`` +
    ``add_kl_completions`` (block = per_device_train_batch_size; a last, shorter block when it does not divide)."""
    data, prompts, completions = _unpaired_strings(rows, seed=rows + block)
    want = trl_kto.trl_kto_prepare(data, per_device_train_batch_size=block)
    assert [r["prompt_ids"] for r in want] == prompts and [r["completion_ids"] for r in want] == completions
    # on TRL's own token ids
    columns = {
        "prompt_input_ids": [r["prompt_ids"] for r in want],
        "completion_input_ids": [r["completion_ids"] for r in want],
        "label": [r["label"] for r in want],
    }
    assert add_kl_completions(columns, block)["kl_completion_input_ids"] == [r["KL_completion_ids"] for r in want]
    # from the strings, twinseq's tokenisation included
    got, _ = tokenize_kto(data, tokenizer_from(trl_kto.tokenizer()), progress=False)
    got = add_kl_completions(got, block)
    assert got["prompt_input_ids"] == columns["prompt_input_ids"]
    assert got["completion_input_ids"] == columns["completion_input_ids"]
    assert got["label"] == columns["label"]
    assert got["kl_completion_input_ids"] == [r["KL_completion_ids"] for r in want]


def _paired_strings(n: int, seed: int, eos_in_text: bool) -> list[dict]:
    rng = np.random.default_rng(seed)
    end = " <eos>" if eos_in_text else ""
    return [
        {
            "prompt": " ".join(f"w{t}" for t in p),
            "chosen": " " + " ".join(f"w{t}" for t in c) + end,
            "rejected": " " + " ".join(f"w{t}" for t in r) + end,
        }
        for p, c, r in zip(_random_ids(rng, n), _random_ids(rng, n), _random_ids(rng, n))
    ]


@pytest.mark.parametrize("eos_in_text", [False, True], ids=["eos-appended", "eos-in-text"])
def test_paired_rows_unpair_tokenise_and_rotate_as_trls_prepare_dataset(trl_kto, eos_in_text):
    """Paired string rows (TRL unpairs them inside ``_prepare_dataset``): twinseq's ``tokenize_kto`` (``tokenize_dpo``
    + ``unpair_rows``) + ``add_kl_completions`` give TRL's rows. With completions that already end in the EOS text,
    TRL appends none (``add_eos`` checks ``endswith(eos_token)``), as twinseq's unpaired and SFT paths do."""
    data = _paired_strings(7, seed=5, eos_in_text=eos_in_text)
    want = trl_kto.trl_kto_prepare(data, per_device_train_batch_size=3)
    got, _ = tokenize_kto(data, tokenizer_from(trl_kto.tokenizer()), progress=False)
    got = add_kl_completions(got, 3)
    assert got["label"] == [r["label"] for r in want] == [True] * 7 + [False] * 7
    assert got["prompt_input_ids"] == [r["prompt_ids"] for r in want]
    assert got["completion_input_ids"] == [r["completion_ids"] for r in want]
    assert got["kl_completion_input_ids"] == [r["KL_completion_ids"] for r in want]


# --------------------------------------------------------------------------------------
# (d) negative controls: each comparison sees a change
# --------------------------------------------------------------------------------------


def test_an_unclamped_kl_disagrees(trl_kto):
    rows = _with_refs(trl_kto, _token_rows(LABELS["mixed"], seed=3), 0.5, kl_target=-0.7)
    want = trl_kto.trl_kto_loss_and_grads(rows, loss_type="kto", beta=0.5)
    ref, ref_kl = _refs(rows)
    unclamped = float(np.mean(want.kl_logps - ref_kl))
    assert abs(unclamped - want.metrics["kl"]) > 1e-3
    labels = np.array(LABELS["mixed"], np.float64)
    losses, _ = kto_family(want.logps - ref, labels, unclamped, validate_kto_config("kto", 0.5), NUMPY_OPS)
    assert abs(float(np.mean(losses)) - want.loss) > 1e-3


def test_swapped_weights_or_the_other_loss_type_disagree(trl_kto):
    """On TRL's log-probs: the same configuration agrees; the weights swapped, or the other loss type, change the
    loss or its gradient w.r.t. the sequence log-probs by far more than the bound."""
    rows = _with_refs(trl_kto, _token_rows(LABELS["mixed"]), 0.1, kl_target=3.0)
    want = trl_kto.trl_kto_loss_and_grads(
        rows, loss_type="kto", beta=0.1, desirable_weight=1.33, undesirable_weight=0.75
    )
    kb = _kbatch(rows, "kto")

    def twinseq(loss_type, w_d, w_u):
        leaf = torch.tensor(np.r_[want.logps, want.kl_logps], dtype=torch.float64, requires_grad=True)
        out = kto_from_logps(leaf, kb, validate_kto_config(loss_type, 0.1, w_d, w_u))
        out.loss.backward()
        return float(out.loss.detach()), leaf.grad[:N].numpy()

    def gap(loss, grad):
        return max(abs(loss - want.loss), float(np.abs(grad - want.logps_grad).max()))

    assert gap(*twinseq("kto", 1.33, 0.75)) <= TOL
    assert gap(*twinseq("kto", 0.75, 1.33)) > 1e-3
    assert gap(*twinseq("apo_zero_unpaired", 1.33, 0.75)) > 1e-3


@pytest.mark.slow
def test_another_beta_changes_the_model_gradients(trl_kto):
    rows = _with_refs(trl_kto, _token_rows(LABELS["mixed"], seed=2), 0.1, kl_target=3.0)
    want, _, _, _ = _end_to_end(trl_kto, ("kto", 0.1, 1.33, 0.75), rows)
    _, got, grads, _ = _end_to_end(trl_kto, ("kto", 0.12, 1.33, 0.75), rows)
    assert abs(float(got.loss.detach()) - want.loss) > 1e-4
    assert max(np.abs(grads[k] - want.grads[k]).max() for k in grads) > 1e-4


def test_the_other_rotation_or_interleaved_pairs_disagree(trl_kto):
    data, _, _ = _unpaired_strings(11, seed=14)
    want = trl_kto.trl_kto_prepare(data, per_device_train_batch_size=3)
    completions = [r["completion_ids"] for r in want]
    backwards = []
    for start in range(0, len(completions), 3):
        part = completions[start : start + 3]
        backwards += part[1:] + part[:1]  # row i takes row i+1's completion
    assert backwards != [r["KL_completion_ids"] for r in want]
    rng = np.random.default_rng(5)
    prompts, chosen, rejected = (_random_ids(rng, 5) for _ in range(3))
    trl = trl_kto.trl_unpair_ids(prompts, chosen, rejected)
    interleaved = [c for pair in zip(chosen, rejected) for c in pair]
    assert interleaved != trl["completion"]
