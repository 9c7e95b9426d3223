"""Donated buffers on the jax backend: the optimizer step updates the parameters and the optimizer state in place,
and gradient accumulation adds into the running sum's buffers.

Invariants: after ``apply_updates`` the previous parameter and state buffers are deleted (donated) and the compiled
step aliases every byte of them; after ``_add`` the previous running sum is deleted; the numbers are those of the
undonated computation (the negative control: ``jax.jit`` without donation leaves its inputs alive).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from twinseq.jax_backend.trainer import _add, apply_updates


def _tree(seed: int):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(32,)), jnp.float32),
    }


def _leaves_deleted(tree) -> list[bool]:
    return [leaf.is_deleted() for leaf in jax.tree.leaves(tree)]


def test_the_optimizer_step_updates_parameters_and_state_in_place():
    optimizer = optax.adamw(1e-2)
    params, grads = _tree(0), _tree(1)
    state = optimizer.init(params)
    expected_updates, _ = optimizer.update(grads, state, params)
    expected = optax.apply_updates(params, expected_updates)
    compiled = apply_updates.lower(optimizer, params, state, grads).compile()
    donated = sum(x.nbytes for x in jax.tree.leaves((params, state)))
    assert compiled.memory_analysis().alias_size_in_bytes == donated
    new_params, new_state, _ = apply_updates(optimizer, params, state, grads)
    assert all(_leaves_deleted(params)) and all(_leaves_deleted([s for s in jax.tree.leaves(state) if s.ndim]))
    assert not any(_leaves_deleted(grads))
    assert all(
        np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected))
    )


def test_accumulating_gradients_adds_into_the_running_sum():
    running, micro = _tree(2), _tree(3)
    expected = jax.tree.map(lambda a, b: np.asarray(a) + np.asarray(b), running, micro)
    total = _add(running, micro)
    assert all(_leaves_deleted(running)) and not any(_leaves_deleted(micro))
    assert all(np.array_equal(np.asarray(total[k]), expected[k]) for k in expected)
    # negative control: the same sum without donation leaves its inputs alive
    running = _tree(2)
    jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))(running, micro)
    assert not any(_leaves_deleted(running))
