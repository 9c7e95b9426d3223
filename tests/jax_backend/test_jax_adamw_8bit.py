"""The jax backend's 8-bit AdamW (``optimizer='adamw_bnb_8bit'``, ``jax_backend/adamw_8bit.py``) against the numpy
rule (``common/run/adamw_8bit.py``), which ``tests/common/run/test_adamw_8bit_rule.py`` holds against bitsandbytes.

Invariants:
- from the rule's state, each of 10 steps gives the rule's weights within 1e-6 relative and its codes, bar a number
  whose float32 moment lands within rounding of a code boundary (one code apart, at most 0.1 % of them); weight
  decay only on matrices, float32 moments below 4,096 numbers;
- float32 AdamW (``optax.adamw``) is not within that tolerance of the rule: the comparison tells them apart;
- the state holds 2 bytes per number plus 8 per block, the memory planner's 8-bit row to the byte;
- the trainer trains with it and resumes from a checkpoint bit-identically (slow tier).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from twinseq.common.run import adamw_8bit as rule
from twinseq.jax_backend.adamw_8bit import Adam8bitState, Quantized, adamw_8bit

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
SHAPES = {"w": (70, 131), "emb": (64, 96), "norm": (40,)}


def _optimizer():
    return adamw_8bit(HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"],
                      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))


def _to_jax_moments(states):
    def moment(s, key):
        if "m" in s:
            return jnp.asarray(s[key])
        return Quantized(jnp.asarray(s[f"{key}_codes"]), jnp.asarray(s[f"{key}_absmax"]))

    return ({k: moment(s, "m") for k, s in states.items()}, {k: moment(s, "v") for k, s in states.items()})


def _run(make_optimizer, steps=10):
    """(the weights' largest error beyond 1e-6 relative, codes apart, codes compared) of ``make_optimizer`` against the rule, each step
    starting from the rule's weights and state."""
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    states = {k: rule.init_state(p) for k, p in params.items()}
    opt = make_optimizer()
    opt_state = opt.init(jax.tree.map(jnp.asarray, params))
    worst, apart, compared = 0.0, 0, 0
    for t in range(1, steps + 1):
        grads = {k: (rng.normal(size=s) * t).astype(np.float32) for k, s in SHAPES.items()}
        eight_bit = isinstance(opt_state[0], Adam8bitState)
        if eight_bit and t > 1:  # resync to the rule's state
            mu, nu = _to_jax_moments(states)
            opt_state = (opt_state[0]._replace(mu=mu, nu=nu),) + tuple(opt_state[1:])
        updates, opt_state = jax.jit(opt.update)(jax.tree.map(jnp.asarray, grads), opt_state,
                                                 jax.tree.map(jnp.asarray, params))
        got = jax.tree.map(np.asarray, optax.apply_updates(jax.tree.map(jnp.asarray, params), updates))
        for k in SHAPES:
            decay = HYPER["weight_decay"] if params[k].ndim >= 2 else 0.0
            params[k], states[k] = rule.step(params[k], grads[k], states[k], step_number=t,
                                             **{**HYPER, "weight_decay": decay})
            # how far past rtol 1e-6, atol 1e-7 (a float32 rounding of weights of size ~1) the weights are
            worst = max(worst, float(np.max(np.abs(got[k] - params[k]) - 1e-6 * np.abs(params[k]))))
            if eight_bit and "m_codes" in states[k]:
                for mine, theirs in ((opt_state[0].mu[k].codes, states[k]["m_codes"]),
                                     (opt_state[0].nu[k].codes, states[k]["v_codes"])):
                    diff = np.abs(np.asarray(mine).astype(int) - theirs.astype(int))
                    assert diff.max() <= 1
                    apart, compared = apart + int((diff > 0).sum()), compared + diff.size
    return worst, apart, compared


def test_jax_8bit_adamw_follows_the_rule():
    worst, apart, compared = _run(_optimizer)
    assert worst <= 1e-7, worst
    assert compared > 0 and apart <= 1e-3 * compared, (apart, compared)


def test_float32_adamw_is_told_apart():
    worst, _, _ = _run(lambda: optax.adamw(HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"],
                                           weight_decay=HYPER["weight_decay"],
                                           mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))
    assert worst > 1e-5, worst


def test_state_bytes_and_the_planner_row():
    from twinseq.common.run.memory_plan import _bnb_state_bytes

    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    state = _optimizer().init(params)
    moments = [x for x in jax.tree.leaves(state) if x.ndim > 0]
    expected = sum(rule.state_bytes(int(np.prod(s))) for s in SHAPES.values())
    assert sum(x.nbytes for x in moments) == expected == _bnb_state_bytes(list(SHAPES.values()))
    codes = [x for x in moments if x.dtype == jnp.uint8]
    assert sorted(c.shape for c in codes) == sorted([SHAPES["w"], SHAPES["w"], SHAPES["emb"], SHAPES["emb"]])


@pytest.mark.slow  # two short trainer runs: the full tier
def test_jax_trains_with_8bit_adamw_and_resumes_bitwise(tmp_path):
    import twinseq.jax_backend as jb
    from twinseq.common.config import TrainConfig
    from twinseq.common.run.report import read_metrics

    def cfg(out, **over):
        values = dict(backend="jax", output_dir=str(out), max_steps=4, save_steps=2, max_length=64,
                      per_device_train_batch_size=2, gradient_accumulation_steps=2, pad_to_multiple_of=64,
                      loss_type="fused_linear", loss_chunk_size=64, disable_tqdm=True, learning_rate=3e-3,
                      optimizer="adamw_bnb_8bit")
        return TrainConfig.from_flat(**{**values, **over})

    jb.train(cfg(tmp_path / "full"))
    jb.train(cfg(tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2")))
    jb.train(cfg(tmp_path / "fp32", optimizer="adamw_torch"))
    full, resumed, fp32 = (read_metrics(tmp_path / d) for d in ("full", "resumed", "fp32"))
    assert [r["loss"] for r in full[2:]] == [r["loss"] for r in resumed if r["step"] > 2]
    # 8-bit moments change the update a little: the run is not float32's, and follows it closely
    assert [r["loss"] for r in full] != [r["loss"] for r in fp32]
    assert abs(full[-1]["loss"] - fp32[-1]["loss"]) <= 0.02 * fp32[-1]["loss"]


@pytest.mark.parametrize("signed", [True, False])
def test_the_nearest_code_search_is_searchsorted_in_a_sixth_of_its_scratch(signed):
    from twinseq.jax_backend.adamw_8bit import _nearest_codes

    code_map = rule.dynamic_map(signed)
    bounds = jnp.asarray(rule.midpoints(code_map))
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.uniform(-1, 1, 200_000), rule.midpoints(code_map), code_map, [-1.0, 0.0, 1.0]])
    x = jnp.asarray(values.astype(np.float32))
    expected = np.searchsorted(rule.midpoints(code_map), np.asarray(x), side="left")  # boundaries included
    assert np.array_equal(np.asarray(jax.jit(_nearest_codes)(x, bounds)), expected)
    big = jnp.zeros((1 << 20,), jnp.float32)

    def scratch(f):
        return jax.jit(f).lower(big).compile().memory_analysis().temp_size_in_bytes / big.size

    ours = scratch(lambda v: _nearest_codes(v, bounds))
    theirs = scratch(lambda v: jnp.searchsorted(bounds, v, side="left").astype(jnp.uint8))
    assert ours <= 4.0 and theirs >= 6 * ours, (ours, theirs)
