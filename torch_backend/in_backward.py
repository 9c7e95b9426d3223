"""Optimizer-in-backward (``optimizer_in_backward=True``): each parameter steps in its gradient's hook.

Backward produces the gradients layer by layer, from the loss back to the embedding. With a step after backward,
every gradient is alive at its end: a float32 gradient per parameter, 4 bytes each. Here the hook that autograd
calls once a parameter's gradient is complete (``register_post_accumulate_grad_hook``) adds the gradient's square
norm to the step's, runs that parameter's AdamW update (``AdamWBF16.update_parameter``) and frees the gradient, so
about one gradient is alive at a time.

What it gives up: no update sees all the gradients, so there is no clipping to a global norm and no gradient
accumulation (``common.run.capabilities`` refuses both, and ``skip_nonfinite_steps``); the norm is still summed and
logged. A step's weights are those of a step after backward exactly: every parameter's update reads only its own
gradient and state, and the forward that made the gradients is over.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from twinseq.torch_backend.bf16_adamw import AdamWBF16


class StepInBackward:
    """The hooks on every trainable parameter of ``module``; ``take_norm`` returns the step's pre-update gradient
    norm (float64) and starts the next step's."""

    def __init__(self, module: torch.nn.Module, optimizer: AdamWBF16) -> None:
        self.optimizer = optimizer
        self.square_norm: Any = 0.0  # a float64 tensor on the gradients' device once a hook ran (no sync per parameter)
        self.stepped: set[int] = set()
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if id(p) in self.stepped:
            raise RuntimeError(
                "optimizer_in_backward: a parameter received a second gradient in one optimizer step (more than one "
                "backward pass per step: several micro-batches, or a reentrant checkpoint around a shared weight), "
                "and its update would run twice; train with optimizer_in_backward=False for this setup."
            )
        self.stepped.add(id(p))
        assert p.grad is not None
        self.square_norm = self.square_norm + torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float64).square()
        self.optimizer.update_parameter(p)
        p.grad = None

    def take_norm(self) -> float:
        norm = math.sqrt(float(self.square_norm))
        self.square_norm = 0.0
        self.stepped.clear()
        return norm
