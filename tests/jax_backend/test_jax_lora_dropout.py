"""LoRA dropout on the JAX backend (``jax_backend.peft``): PEFT's train-mode ``lora_B(lora_A(dropout(x)))``.

Invariants (float32 on CPU, matmuls at "highest" precision):
- in a training forward (a ``DropoutKey`` set by ``set_dropout_keys``) the fraction of adapter inputs an adapted
  linear drops is ``p`` within 6 binomial standard deviations, every kept value is exactly ``x * float32(1) /
  float32(1 - p)`` (torch's inverted-dropout scale) and every dropped one exactly 0; two adapted linears draw
  independent masks (agreement ``(1 - p)^2 + p^2`` within 6 sigma);
- ``p = 0`` with a key, and any ``p`` without one (``logits``, ``token_losses``, ``loss_and_grads``, the DPO
  reference under ``adapters_disabled``, ``grads_jit`` without a key), are bitwise today's deterministic forward;
- DoRA drops the same ``x`` for its LoRA term and for its magnitude term's ``x W^T`` (PEFT's
  ``DoraLinearVariant.forward``): the training forward equals that formula on the same mask (1e-6 relative);
- the adapters' gradient with dropout equals the gradient computed by hand (float64) on the same mask, LoRA and
  DoRA (1e-6 relative); rematerialisation recomputes the same masks (grads equal to 1e-6 relative) and tiled
  MLPs draw one mask per tile;
- the trainer's key is a function of (seed, step, micro-batch): the same seed gives bitwise-equal losses, another
  seed other ones; a 5-step ``train`` run with ``lora_dropout=0.1`` is reproducible (resumed from step 2 too),
  finite, has the first loss
  of ``lora_dropout=0`` (``lora_B`` starts at 0, so the adapters add exactly 0 whatever the mask) and differs
  from it at every later step.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from twinseq.common.batching import collate  # noqa: E402
from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.init import init_weights  # noqa: E402
from twinseq.common.peft import PeftConfig, init_adapters  # noqa: E402
from twinseq.jax_backend import build_model, export_weights, logits, loss_and_grads, token_losses  # noqa: E402
from twinseq.jax_backend import peft as jpeft  # noqa: E402
from twinseq.jax_backend.model import Linear, batch_inputs, grads_jit, set_tiled_mlp, split_trainable  # noqa: E402

VOCAB = 512
DOCS = ([5, 6, 7, 9, 11, 300, 12, 8, 40, 41, 42], [8, 9, 100, 7, 5], [13, 14, 15, 16, 17, 18, 19])
SIGMAS = 6.0


pytestmark = pytest.mark.usefixtures("highest_precision")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _peft(**kw) -> PeftConfig:
    return PeftConfig(**{"use_peft": True, "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, **kw})


def _model(cfg: ModelConfig, **kw):
    """``tiny`` with non-trivial adapters (random ``lora_B``, magnitudes moved off ``||W + s B A||``)."""
    base = build_model(cfg, init_weights(cfg, 0))
    peft = _peft(**kw)
    adapters = init_adapters(cfg, peft, seed=1, base_weights=export_weights(base), lora_b_std=0.02)
    for key in adapters:
        if key.endswith("lora_magnitude_vector"):
            adapters[key] = adapters[key] * 1.1 + 0.01
    return jpeft.add_adapters(base, cfg, peft, adapters)


def _layer(fan_in: int, fan_out: int, rank: int, p: float, *, dora: bool = False, seed: int = 0):
    """A ``PeftLinear`` with random base, bias, adapters (and DoRA magnitude), ``lora_dropout=p``."""
    rng = np.random.default_rng(seed)
    weight_OI = rng.standard_normal((fan_out, fan_in)).astype(np.float32) / np.sqrt(fan_in)
    base = Linear(weight_OI, "float32", rng.standard_normal(fan_out).astype(np.float32) * 0.1)
    a_RI = rng.standard_normal((rank, fan_in)).astype(np.float32) / np.sqrt(fan_in)
    b_OR = rng.standard_normal((fan_out, rank)).astype(np.float32) * 0.1
    magnitude = None
    if dora:
        magnitude = (np.linalg.norm(weight_OI + 2.0 * b_OR @ a_RI, axis=1) * 1.1 + 0.01).astype(np.float32)
    return jpeft.PeftLinear(base, lora_A=a_RI, lora_B=b_OR, magnitude=magnitude, scaling=2.0, lora_dropout=p)


def _identity_layer(width: int, p: float) -> jpeft.PeftLinear:
    """A zero base and ``A = B = I``, scaling 1: the output *is* the dropped adapter input, exactly."""
    eye = np.eye(width, dtype=np.float32)
    return jpeft.PeftLinear(Linear(np.zeros((width, width), np.float32), "float32"), lora_A=eye, lora_B=eye,
                            scaling=1.0, lora_dropout=p)


def _binomial_bound(n: int, p: float) -> float:
    return SIGMAS * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_jax_dropout_drops_p_of_the_adapter_inputs_and_scales_the_rest_exactly(p):
    width = 128
    x = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2.0, (32, 64, width)).astype(np.float32))  # never 0
    layer = _identity_layer(width, p)
    assert np.array_equal(layer(x), x)  # no key: the deterministic forward
    jpeft.set_dropout_keys(layer, jax.random.key(7))
    out = np.asarray(layer(x))
    dropped = out == 0
    n = out.size
    assert abs(dropped.sum() - n * p) <= _binomial_bound(n, p), (dropped.mean(), p)
    scale = np.float32(1.0) / np.float32(1.0 - p)
    kept = ~dropped
    assert np.array_equal(out[kept], np.asarray(x)[kept] * scale)  # bitwise: torch's float32 scale
    # the mask is a function of the key alone: the same key again, the same output; another key, another mask
    assert np.array_equal(np.asarray(layer(x)), out)
    jpeft.set_dropout_keys(layer, jax.random.key(8))
    assert not np.array_equal(np.asarray(layer(x)), out)


def test_jax_dropout_masks_of_two_adapted_linears_are_independent():
    p, width = 0.3, 128
    pair = nnx.List([_identity_layer(width, p), _identity_layer(width, p)])
    x = jnp.ones((64, 64, width), jnp.float32)
    jpeft.set_dropout_keys(pair, jax.random.key(0))
    keep_a, keep_b = (np.asarray(layer(x)) != 0 for layer in pair)
    agree = float((keep_a == keep_b).sum())
    q, n = (1 - p) ** 2 + p ** 2, keep_a.size
    assert abs(agree - n * q) <= _binomial_bound(n, q), (agree / n, q)  # not one shared mask (agree = n)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_jax_dropout_forward_and_adapter_gradients_match_the_hand_computation_on_the_same_mask(dora):
    """y = base(x) + s B A d (LoRA), or + (m/n - 1) d W^T + (m/n) s B A d (DoRA, n detached), with
    d = lora_dropout(x, p, fold_in(key, 0)): PEFT's train mode; gradients by hand in float64."""
    p, fan_in, fan_out, rank = 0.25, 48, 40, 6
    layer = _layer(fan_in, fan_out, rank, p, dora=dora)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 20, fan_in)).astype(np.float32))
    g_out = np.random.default_rng(2).standard_normal((3, 20, fan_out))  # dL/dy of L = sum(g_out * y)
    key = jax.random.key(11)
    # the layer's own mask: set_dropout_keys gives its only adapted linear fold_in(key, 0)
    d = np.asarray(jpeft.lora_dropout(x, p, jax.random.fold_in(key, 0)), np.float64).reshape(-1, fan_in)
    assert 0 < (d == 0).mean() < 1

    graphdef, adapters, rest = nnx.split(layer, jpeft.AdapterParam, ...)

    def loss(adapters):
        module = nnx.merge(graphdef, adapters, rest)
        jpeft.set_dropout_keys(module, key)
        y = module(x)
        return jnp.sum(jnp.asarray(g_out, jnp.float32) * y), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(adapters)
    w_OI = np.asarray(layer.kernel[...], np.float64).T
    bias = np.asarray(layer.bias[...], np.float64)
    a_RI, b_OR = (np.asarray(v[...], np.float64) for v in (layer.lora_A, layer.lora_B))
    x64, s, g = np.asarray(x, np.float64).reshape(-1, fan_in), layer.scaling, g_out.reshape(-1, fan_out)
    y = np.asarray(y).reshape(-1, fan_out)
    h = d @ a_RI.T  # [N, r]
    lora = h @ b_OR.T
    if not dora:
        y_ref = x64 @ w_OI.T + bias + s * lora
        coef_O = np.full(fan_out, s)
    else:
        m_O = np.asarray(layer.lora_magnitude_vector[...], np.float64)
        ratio_O = m_O / np.linalg.norm(w_OI + s * b_OR @ a_RI, axis=1)
        y_ref = x64 @ w_OI.T + bias + (ratio_O - 1) * (d @ w_OI.T) + ratio_O * s * lora
        coef_O = ratio_O * s
        grad_m = np.einsum("no,no->o", g, (d @ w_OI.T + s * lora)) / (m_O / ratio_O)
        assert _rel(grads["lora_magnitude_vector"][...], grad_m) <= 1e-6
    assert _rel(y, y_ref) <= 1e-6
    gc = g * coef_O  # dL/d(lora)
    grad_b, grad_a = gc.T @ h, (gc @ b_OR).T @ d
    assert _rel(grads["lora_B"][...], grad_b) <= 1e-6 and _rel(grads["lora_A"][...], grad_a) <= 1e-6

    # negative control: the undropped input gives another gradient (the mask matters)
    h_full = x64 @ a_RI.T
    assert _rel(gc.T @ h_full, grad_b) > 1e-2


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_jax_p0_and_every_keyless_forward_are_bitwise_the_deterministic_forward(dora):
    cfg = ModelConfig.preset("tiny", vocab_size=VOCAB)
    batch = collate([{"input_ids": d} for d in DOCS])
    plain = _model(cfg, use_dora=dora)  # lora_dropout=0
    plain_logits, plain_nll = logits(plain, batch), token_losses(plain, batch)
    plain_loss, plain_grads = loss_and_grads(plain, batch, "nll")
    graphdef, state, frozen = split_trainable(plain)
    inputs, num = batch_inputs(batch, VOCAB), jnp.asarray(batch.num_items_in_batch, jnp.int32)
    kw = dict(loss_type="nll", chunk_size=64, frozen=frozen)
    (loss0, _), grads0 = grads_jit(graphdef, state, inputs, num, **kw)
    (loss_k, _), grads_k = grads_jit(graphdef, state, inputs, num, dropout_key=jax.random.key(3), **kw)
    assert float(loss_k) == float(loss0) == plain_loss  # p = 0: a key changes nothing
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), grads_k, grads0)
    model = _model(cfg, use_dora=dora, lora_dropout=0.5)  # any p: the rate is never read without a key
    assert np.array_equal(logits(model, batch), plain_logits)
    assert np.array_equal(token_losses(model, batch), plain_nll)
    loss, grads = loss_and_grads(model, batch, "nll")
    assert loss == plain_loss and all(np.array_equal(grads[k], plain_grads[k]) for k in plain_grads)
    with jpeft.adapters_disabled(model), jpeft.adapters_disabled(plain):  # DPO's reference
        assert np.array_equal(logits(model, batch), logits(plain, batch))
    # positive control: the same model in a training forward does drop
    graphdef, state, frozen = split_trainable(model)
    (loss_p, _), _ = grads_jit(graphdef, state, inputs, num, dropout_key=jax.random.key(3), **{**kw, "frozen": frozen})
    assert float(loss_p) != plain_loss


def test_jax_remat_and_tiled_mlp_keep_the_training_forward_consistent():
    """``jax.checkpoint`` recomputes the forward in backward: the masks are functions of the key, so the
    gradients equal the un-rematerialised ones; a tiled MLP folds the tile index (masks differ per tile)."""
    from twinseq.jax_backend.memory import apply_activation_checkpointing

    cfg = ModelConfig.preset("tiny", vocab_size=VOCAB)
    batch = collate([{"input_ids": d} for d in DOCS])
    inputs, num = batch_inputs(batch, VOCAB), jnp.asarray(batch.num_items_in_batch, jnp.int32)
    key = jax.random.key(5)

    def run(model):
        graphdef, state, frozen = split_trainable(model)
        (loss, _), grads = grads_jit(graphdef, state, inputs, num, loss_type="nll", chunk_size=64, frozen=frozen,
                                     dropout_key=key)
        return float(loss), {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}

    loss, grads = run(_model(cfg, lora_dropout=0.2))
    model = _model(cfg, lora_dropout=0.2)
    apply_activation_checkpointing(model, "full")
    loss_r, grads_r = run(model)
    assert abs(loss_r - loss) <= 1e-6 * loss and all(_rel(grads_r[k], grads[k]) <= 1e-6 for k in grads)

    # tiled MLP: tile c draws fold_in(key, c), so the 2-token tiles do not repeat one mask
    tiled = _model(cfg, lora_dropout=0.2)
    set_tiled_mlp(tiled, 2)
    loss_t, grads_t = run(tiled)
    assert np.isfinite(loss_t) and loss_t != loss
    mlp = tiled.model.layers[0].mlp
    x_NH = jnp.ones((8, cfg.hidden_size), jnp.float32)
    from twinseq.jax_backend.model import tiled_mlp

    jpeft.set_dropout_keys(mlp, key)
    y = np.asarray(tiled_mlp(mlp, x_NH, 2))
    assert not any(np.array_equal(y[0:2], y[c:c + 2]) for c in (2, 4, 6))  # equal rows in, other masks out
    jpeft.set_dropout_keys(mlp, key)
    assert np.array_equal(np.asarray(tiled_mlp(mlp, x_NH, 2)), y)  # reproducible


def _train_cfg(output_dir, dataset, **overrides) -> TrainConfig:
    values = dict(backend="jax", model_config="tiny", dataset_name=str(dataset), output_dir=str(output_dir),
                  max_steps=5, save_steps=0, max_length=64, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, pad_to_multiple_of=64, loss_type="fused_linear", loss_chunk_size=64,
                  disable_tqdm=True, learning_rate=3e-3, use_peft=True, lora_r=4, lora_alpha=8.0, lora_dropout=0.1,
                  seed=3)
    return TrainConfig.from_flat(**{**values, **overrides})


def _dataset(tmp_path):
    words = "the sky is blue and the grass is green while the sea is deep and wide".split()
    rng = np.random.default_rng(0)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(8, 30))))}) + "\n"
                            for _ in range(40)))
    return path


def test_jax_trainer_dropout_key_is_a_function_of_seed_step_and_micro_batch():
    """The same model and data under trainers that differ only in ``seed`` / ``lora_dropout``."""
    from twinseq.jax_backend.trainer import SFTTrainer, lora_dropout_key

    cfg = ModelConfig.preset("tiny", vocab_size=VOCAB)
    base = build_model(cfg, init_weights(cfg, 0))
    batch = collate([{"input_ids": d} for d in DOCS[:2]])

    def two_steps(seed, dropout):
        peft = _peft(lora_dropout=dropout, lora_target_modules=["q_proj", "v_proj"])
        model = jpeft.add_adapters(base, cfg, peft, init_adapters(cfg, peft, seed=0))  # lora_B = 0
        trainer = SFTTrainer(model, _train_cfg("unused", "unused", seed=seed, lora_dropout=dropout))
        first, second = trainer.step([batch, batch]), trainer.step([batch, batch])
        return first["loss"], first["grad_norm"], second["loss"], second["grad_norm"]

    a, again, other, none = two_steps(3, 0.3), two_steps(3, 0.3), two_steps(4, 0.3), two_steps(3, 0.0)
    assert a == again  # bitwise
    assert a[1] != other[1] and a[2] != other[2]  # another seed, other masks (grad norm of step 1, loss of 2)
    assert a[1] != none[1] and a[0] == none[0]  # lora_B = 0: the first loss ignores the mask, its gradient not
    keys = {(s, t, m): jax.random.key_data(lora_dropout_key(s, t, m)).tobytes()
            for s in (0, 1) for t in (0, 1) for m in (0, 1)}
    assert len(set(keys.values())) == len(keys)
    assert jax.random.key_data(lora_dropout_key(1, 1, 1)).tobytes() == keys[(1, 1, 1)]


@pytest.mark.slow
def test_jax_train_with_lora_dropout_is_reproducible_and_differs_from_no_dropout(tmp_path):
    import twinseq.jax_backend as jb
    from twinseq.common.metrics import read_metrics

    dataset = _dataset(tmp_path)
    runs = {}
    resumed = {"resume_from_checkpoint": str(tmp_path / "a" / "checkpoint-2")}
    for name, overrides in {"a": {"save_steps": 2}, "again": {}, "none": {"lora_dropout": 0.0},
                            "resumed": resumed}.items():
        jb.train(_train_cfg(tmp_path / name, dataset, **overrides))
        runs[name] = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / name)]
    assert len(runs["a"]) == 5 and np.isfinite(runs["a"]).all()
    assert runs["a"] == runs["again"]  # same seed: bitwise the same trajectory
    assert runs["resumed"] == runs["a"][2:]  # the key is (seed, step, micro-batch): resuming redraws no mask
    assert runs["a"][0][0] == runs["none"][0][0]  # lora_B = 0 at step 1: the mask changes no loss, yet
    assert runs["a"][0][1] != runs["none"][0][1]  # it changes the gradient,
    assert all(a[0] != b[0] for a, b in zip(runs["a"][1:], runs["none"][1:]))  # hence every later loss
