"""Shared inputs of the parity suite: one model (``init_weights``), two layouts of the same
documents (padded and padding-free), and every backend output computed once per session.

float32 parity needs exact float32 matmuls: TF32 off in torch, ``highest`` matmul precision
in JAX, x64 off (so JAX really computes in float32).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from parity_tests.inputs import CHUNK_SIZE, parity_batches
from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights

# JAX_PLATFORMS=cpu and the host device count are set by the root conftest.py.


@pytest.fixture(scope="session")
def exact_fp32():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             jax.config.jax_default_matmul_precision, torch.get_num_threads())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    jax.config.update("jax_default_matmul_precision", "highest")
    # One intra-op thread: torch's summation order no longer depends on the core count, and the
    # tiny matmuls do not stall on OpenMP barriers when the CI machine is shared (measured: 20
    # trainer steps took 51 s with 2 threads on a loaded 2-core machine, 1 s with 1).
    torch.set_num_threads(1)
    assert not jax.config.jax_enable_x64, "parity runs JAX in float32; jax_enable_x64 must be off"
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    jax.config.update("jax_default_matmul_precision", saved[2])
    torch.set_num_threads(saved[3])


class Harness:
    """Lazily computed, memoised outputs of torch, jax and the numpy reference."""

    def __init__(self, dtype: str = "float32") -> None:
        self.dtype = dtype
        self.cfg = ModelConfig.preset("tiny")
        self.weights = init_weights(self.cfg, seed=0)
        self.batches = parity_batches(self.cfg.vocab_size)

    @functools.cached_property
    def jax_model(self):
        import twinseq.jax_backend as jb

        return jb.build_model(self.cfg, self.weights, dtype=self.dtype)

    @functools.cached_property
    def torch_model(self):
        import twinseq.torch_backend as tb

        return tb.build_model(self.cfg, self.weights, dtype=self.dtype)

    @functools.lru_cache(maxsize=None)
    def reference_logits(self, layout: str, weights_dtype: str = "float32") -> np.ndarray:
        from parity_tests import numpy_reference

        weights = self.weights
        if weights_dtype == "bfloat16":
            import ml_dtypes

            weights = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in weights.items()}
        return numpy_reference.logits(self.cfg, weights, self.batches[layout])

    @functools.lru_cache(maxsize=None)
    def jax_forward(self, layout: str) -> tuple[np.ndarray, np.ndarray]:
        import twinseq.jax_backend as jb

        batch = self.batches[layout]
        return jb.logits(self.jax_model, batch), jb.token_losses(self.jax_model, batch)

    @functools.lru_cache(maxsize=None)
    def torch_forward(self, layout: str) -> tuple[np.ndarray, np.ndarray]:
        import torch
        import torch.nn.functional as F

        import twinseq.torch_backend as tb
        from twinseq.common.objectives.nll import shift_labels

        batch = self.batches[layout]
        logits_BTV = tb.logits(self.torch_model, batch)
        targets_BT = torch.from_numpy(shift_labels(batch.labels)).long()
        token_BT = F.cross_entropy(torch.from_numpy(logits_BTV).flatten(0, 1), targets_BT.flatten(),
                                   ignore_index=-100, reduction="none").reshape(targets_BT.shape)
        return logits_BTV, token_BT.numpy()

    @functools.lru_cache(maxsize=None)
    def jax_grads(self, layout: str, loss_type: str):
        import twinseq.jax_backend as jb

        return jb.loss_grads_and_metrics(self.jax_model, self.batches[layout], loss_type, chunk_size=CHUNK_SIZE)

    @functools.lru_cache(maxsize=None)
    def torch_grads(self, layout: str, loss_type: str):
        import torch

        import twinseq.torch_backend as tb

        batch = self.batches[layout]
        loss, grads = tb.loss_and_grads(self.torch_model, batch, loss_type, chunk_size=CHUNK_SIZE)
        with torch.no_grad():
            _, metrics = tb.compute_loss(self.torch_model, batch, loss_type, chunk_size=CHUNK_SIZE,
                                         return_metrics=True)
        return loss, grads, {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="session")
def harness(exact_fp32) -> Harness:
    return Harness("float32")


@pytest.fixture(scope="session")
def harness_bf16(exact_fp32) -> Harness:
    return Harness("bfloat16")


@pytest.fixture(scope="session")
def sft_jsonl(tmp_path_factory) -> str:
    """160 prompt/completion rows of the embedded SFT data, as a local JSONL file (CLI and train() parity)."""
    import json

    from twinseq.common.data.corpus import load_embedded

    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    with path.open("w") as f:
        for row in load_embedded("embedded-sft").select(range(160)):
            f.write(json.dumps({"prompt": row["prompt"], "completion": row["completion"]}) + "\n")
    return str(path)
