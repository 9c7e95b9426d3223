"""LoRA dropout on the jax backend, equal in distribution to PEFT's on torch (issue 26, item 4.5).

PEFT's LoRA layer in train mode computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` (DoRA: its base term
from the dropped input too), a fresh ``nn.Dropout`` mask per call. The jax layer (``jax_backend.peft.PeftLinear``)
draws its mask from the key of the enclosing ``lora_dropout`` block. Over many draws, the mean and the variance of
every output element must agree with torch's, and with the closed form (the output is linear in the dropped
input, so ``Var = sum_i M_oi^2 x_i^2 p / (1 - p)``), within a statistical bound: 6 standard errors, each from the
draws' own fourth moment. Without a key, or with ``lora_dropout=0``, the outputs are those of the layer without
dropout, bit for bit, and so are the trainer's losses. The backward pass draws the mask again from the key
(``peft._dropped_matmul``) and gives the gradients of the plain expression.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.jax_backend.model import Linear, lora_dropout  # noqa: E402
from twinseq.jax_backend.peft import PeftLinear, dropout_key  # noqa: E402

pytestmark = pytest.mark.usefixtures("highest_precision")

IN, OUT, R, ALPHA, P, DRAWS = 16, 8, 4, 8.0, 0.3, 4000
SCALING = ALPHA / R


def _layer_values(use_dora: bool):
    rng = np.random.default_rng(0)
    values = dict(
        weight=rng.standard_normal((OUT, IN)).astype(np.float32) / 4,
        bias=rng.standard_normal(OUT).astype(np.float32) / 4,
        lora_A=rng.standard_normal((R, IN)).astype(np.float32) / 4,
        lora_B=rng.standard_normal((OUT, R)).astype(np.float32) / 4,  # non-zero: the adapter output is what varies
        x=rng.standard_normal((2, 3, IN)).astype(np.float32),
    )
    if use_dora:
        values["magnitude"] = (1.0 + rng.random(OUT)).astype(np.float32)
    return values


def _torch_draws(v: dict, use_dora: bool, p: float) -> np.ndarray:
    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(IN, OUT)

        def forward(self, x):
            return self.proj(x)

    model = One()
    with torch.no_grad():
        model.proj.weight.copy_(torch.from_numpy(v["weight"]))
        model.proj.bias.copy_(torch.from_numpy(v["bias"]))
    model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=p, target_modules=["proj"],
                                                       use_dora=use_dora))
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.from_numpy(v["lora_A"]))
        layer.lora_B["default"].weight.copy_(torch.from_numpy(v["lora_B"]))
        if use_dora:
            layer.lora_magnitude_vector["default"].weight.copy_(torch.from_numpy(v["magnitude"]))
    model.train()
    torch.manual_seed(0)
    x = torch.from_numpy(v["x"])
    with torch.no_grad():
        return np.stack([model(x).numpy() for _ in range(DRAWS)])


def _jax_layer(v: dict, use_dora: bool, p: float) -> PeftLinear:
    return PeftLinear(Linear(v["weight"], "float32", v["bias"]), lora_A=v["lora_A"], lora_B=v["lora_B"],
                      magnitude=v.get("magnitude"), scaling=SCALING, dropout=p, index=3)


def _jax_draws(layer: PeftLinear, x: np.ndarray, seed: int = 0) -> np.ndarray:
    graphdef, state = nnx.split(layer)

    def one(key):
        with lora_dropout(key):
            return nnx.merge(graphdef, state)(jnp.asarray(x))

    keys = jax.vmap(lambda i: dropout_key(seed, 0, i))(jnp.arange(DRAWS))
    return np.asarray(jax.jit(jax.vmap(one))(keys))


def _closed_form(v: dict, use_dora: bool, p: float) -> tuple[np.ndarray, np.ndarray]:
    """(mean, variance) of the output, float64: it is ``c + M @ dropout(x)`` with ``E[dropout(x)] = x``."""
    w, a, b, x = (v[k].astype(np.float64) for k in ("weight", "lora_A", "lora_B", "x"))
    delta = SCALING * b @ a
    if use_dora:
        scale = v["magnitude"].astype(np.float64) / np.linalg.norm(w + delta, axis=1)
        matrix = (scale - 1)[:, None] * w + scale[:, None] * delta
    else:
        matrix = delta
    mean = x @ (w + (matrix if use_dora else delta)).T + v["bias"]
    return mean, (x**2) @ (matrix**2).T * p / (1 - p)


def _standard_errors(draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    centred = draws - draws.mean(0)
    var = centred.var(0, ddof=1)
    return np.sqrt(var / len(draws)), np.sqrt(np.maximum((centred**4).mean(0) - var**2, 0) / len(draws))


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_mean_and_variance_match_torch_and_the_closed_form(use_dora):
    v = _layer_values(use_dora)
    got = _jax_draws(_jax_layer(v, use_dora, P), v["x"]).astype(np.float64)
    ref = _torch_draws(v, use_dora, P).astype(np.float64)
    mean, var = _closed_form(v, use_dora, P)
    (se_mean_j, se_var_j), (se_mean_t, se_var_t) = _standard_errors(got), _standard_errors(ref)
    assert np.all(np.abs(got.mean(0) - ref.mean(0)) <= 6 * np.hypot(se_mean_j, se_mean_t) + 1e-6)
    assert np.all(np.abs(got.var(0, ddof=1) - ref.var(0, ddof=1)) <= 6 * np.hypot(se_var_j, se_var_t) + 1e-9)
    for draws, se_mean, se_var in ((got, se_mean_j, se_var_j), (ref, se_mean_t, se_var_t)):
        assert np.all(np.abs(draws.mean(0) - mean) <= 6 * se_mean + 1e-5)
        assert np.all(np.abs(draws.var(0, ddof=1) - var) <= 6 * se_var + 1e-6)
    assert var.min() > 1e-3 * var.max() > 0  # every element varies: the check has something to hold


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_each_layer_and_each_key_draws_its_own_mask():
    v = _layer_values(False)
    a, b = _jax_layer(v, False, P), _jax_layer(v, False, P)
    b.dropout_index = 4
    one, other = _jax_draws(a, v["x"])[:4], _jax_draws(b, v["x"])[:4]
    assert not np.array_equal(one, other) and not np.array_equal(one[0], one[1])
    np.testing.assert_array_equal(one, _jax_draws(a, v["x"])[:4])  # a key is a mask


def test_the_backward_draws_the_forward_mask_again():
    """``_dropped_matmul`` keeps no mask (its backward draws it again from the key): its value and gradients are
    those of the plain ``dropout(x) @ A.T``."""
    from twinseq.jax_backend.peft import _dropout, _dropped_matmul

    v = _layer_values(False)
    x, a = jnp.asarray(v["x"]), jnp.asarray(v["lora_A"])
    weights = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, R)), jnp.float32)
    key = dropout_key(0, 1, 2)

    def plain(x, a):
        return (_dropout(x, key, 1 - P) @ a.T * weights).sum()

    def custom(x, a):
        return (_dropped_matmul(x, a, key, 1 - P) * weights).sum()

    np.testing.assert_array_equal(jax.jit(custom)(x, a), jax.jit(plain)(x, a))
    for got, want in zip(jax.jit(jax.grad(custom, (0, 1)))(x, a), jax.jit(jax.grad(plain, (0, 1)))(x, a)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert np.count_nonzero(got) > 0


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_no_key_or_no_dropout_is_the_layer_without_dropout(use_dora):
    v = _layer_values(use_dora)
    x = jnp.asarray(v["x"])
    plain = np.asarray(_jax_layer(v, use_dora, 0.0)(x))
    np.testing.assert_array_equal(np.asarray(_jax_layer(v, use_dora, P)(x)), plain)  # eval: no enclosing block
    with lora_dropout(jax.random.key(1)):
        np.testing.assert_array_equal(np.asarray(_jax_layer(v, use_dora, 0.0)(x)), plain)


def _losses(tmp_path, name, **overrides) -> list[float]:
    from twinseq.common.run.report import read_metrics
    from twinseq.jax_backend import train

    values = dict(backend="jax", output_dir=str(tmp_path / name), max_steps=3, max_length=64,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2, pad_to_multiple_of=64,
                  loss_type="fused_linear", loss_chunk_size=64, disable_tqdm=True, learning_rate=3e-3,
                  use_peft=True, lora_r=4, lora_alpha=8.0, save_final_checkpoint=False)
    train(TrainConfig.from_flat(**{**values, **overrides}))
    return [r["loss"] for r in read_metrics(tmp_path / name)]


@pytest.mark.slow
def test_the_trainer_applies_dropout_and_zero_changes_nothing(tmp_path, monkeypatch):
    from twinseq.jax_backend import trainer

    off = _losses(tmp_path, "off", lora_dropout=0.0)
    on = _losses(tmp_path, "on", lora_dropout=0.2)
    assert on != off and on == _losses(tmp_path, "on-again", lora_dropout=0.2)  # seeded: a rerun draws the same
    # gradient checkpointing recomputes the forward pass with the same masks
    np.testing.assert_allclose(_losses(tmp_path, "remat", lora_dropout=0.2, gradient_checkpointing=True), on,
                               rtol=1e-6)
    # the trainer before dropout existed (no key) trained as lora_dropout=0 does now, bit for bit
    monkeypatch.setattr(trainer.JaxTrainer, "next_dropout_key", lambda self: None)
    assert _losses(tmp_path, "no-key", lora_dropout=0.2) == off
