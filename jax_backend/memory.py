"""Activation memory on the JAX backend: rematerialisation (gradient checkpointing) and host
offloading, both as ``jax.checkpoint`` policies chosen by name.

A policy decides which intermediates of a checkpointed function are kept for the backward
pass; everything else is recomputed. The model wraps each decoder layer with ``remat``.

==============  ==============================================================================
name            what is kept from a decoder layer's forward pass
==============  ==============================================================================
none            everything (no rematerialisation; plain autodiff)
full            only the layer inputs; the whole layer is recomputed (torch
                ``gradient_checkpointing``)
save_nothing    same as ``full``, spelled as the explicit ``nothing_saveable`` policy
dots_saveable   the matmul outputs; element-wise ops (norms, RoPE, softmax, SiLU) are recomputed
offload_dots    the matmul outputs without batch dims, moved to host memory (``pinned_host``)
                and brought back for the backward pass
==============  ==============================================================================
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional, Sequence

import jax

from twinseq.common.errors import ConfigError

logger = logging.getLogger(__name__)

REMAT_POLICIES = ("none", "full", "save_nothing", "dots_saveable", "offload_dots")
HOST_OFFLOAD_POLICIES = ("offload_dots",)
HOST_MEMORY_KIND = "pinned_host"


def device_memory_kinds(device: Optional[jax.Device] = None) -> tuple[str, ...]:
    """Memory kinds a device can address, e.g. ``('device', 'pinned_host', 'unpinned_host')``."""
    device = device if device is not None else jax.devices()[0]
    return tuple(m.kind for m in device.addressable_memories())


def check_policy(name: str, memory_kinds: Sequence[str]) -> None:
    """Raise ``ValueError`` for an unknown policy, or a host-offload one without host memory.

    ``memory_kinds`` are the kinds of the device that will run the step
    (see ``device_memory_kinds``).
    """
    if name not in REMAT_POLICIES:
        raise ConfigError(f"remat policy {name!r} is unknown; choose one of {', '.join(REMAT_POLICIES)}.")
    if name in HOST_OFFLOAD_POLICIES and HOST_MEMORY_KIND not in memory_kinds:
        raise ConfigError(
            f"remat policy {name!r} offloads activations to {HOST_MEMORY_KIND!r} memory, but this device only "
            f"has memory kinds {tuple(memory_kinds)}; pick 'full' or 'dots_saveable' instead, or run on a "
            f"platform with host memory spaces (GPU/TPU)."
        )


def _policy(name: str) -> Optional[Callable[..., bool]]:
    policies = jax.checkpoint_policies
    if name == "full":
        return None  # jax.checkpoint's default: save nothing but the inputs
    if name == "save_nothing":
        return policies.nothing_saveable
    if name == "dots_saveable":
        return policies.dots_saveable
    assert name == "offload_dots", name
    return policies.offload_dot_with_no_batch_dims("device", HOST_MEMORY_KIND)


def remat(
    fn: Callable, policy: str = "none", *, device: Optional[jax.Device] = None, static_argnums: tuple[int, ...] = ()
) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` with the named policy (``fn`` itself for ``"none"``).

    Numerically a no-op: the wrapped function returns the same values and gradients.
    """
    device = device if device is not None else jax.devices()[0]
    check_policy(policy, device_memory_kinds(device))
    if policy == "none":
        return fn
    if policy in HOST_OFFLOAD_POLICIES and device.platform == "cpu":
        # The CPU client exposes a pinned_host space, so offload compiles and runs, but it is the
        # same RAM as "device" memory: the policy is honoured and saves nothing.
        logger.info("remat policy %r on CPU: device and host memory are the same RAM; no memory is saved.", policy)
    return jax.checkpoint(fn, policy=_policy(policy), static_argnums=static_argnums)


def apply_activation_checkpointing(model, policy: str = "full") -> None:
    """Rematerialise every decoder layer of ``model`` with ``policy`` (one of ``REMAT_POLICIES``).

    The mirror of the torch backend's function: ``full`` recomputes whole layers, as torch's
    gradient checkpointing does; the other policies keep more (``dots_saveable``) or offload.
    """
    check_policy(policy, device_memory_kinds())
    model.model.remat_policy = policy


def remat_policy_of(cfg) -> str:
    """The policy a ``TrainConfig`` asks for: host offload, full recompute, or none."""
    if cfg.memory.activation_offloading:
        return "offload_dots"
    return "full" if cfg.memory.gradient_checkpointing else "none"


class StepMemory(NamedTuple):
    """Bytes of one compiled training step (XLA's ``memory_analysis``), as DESIGN.md measures JAX memory;
    ``model.compiled_step_memory`` gives it for a config and sequence length."""

    temp_bytes: int
    """Activations, gradients in flight and scratch: what grows with T (DESIGN.md's JAX figure)."""
    argument_bytes: int
    """Parameters and the batch passed in."""
    output_bytes: int
    """Loss, metrics and the gradients returned."""

    @property
    def peak_bytes(self) -> int:
        """An upper bound of what the step holds at once: its arguments, outputs and temporaries."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes
