"""Hugging Face checkpoints: torch -> jax -> torch is bitwise exact.

Invariants:
- ``save_pretrained`` (torch) -> ``load_pretrained`` (jax) -> ``save_pretrained`` (jax) ->
  ``from_pretrained`` (torch) gives back every tensor bit for bit, tied or untied, float32 or
  bfloat16 (no conversion happens on the way);
- the imported jax model computes the torch model's logits (float32 parity bound).
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from parity_tests.inputs import valid_positions
from parity_tests.tolerances import tol
from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights

torch = pytest.importorskip("torch")
pytest.importorskip("jax")


def _weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Trained-looking weights: the RMSNorm scales are not all ones, so a swapped name would show."""
    weights = init_weights(cfg, seed=3)
    rng = np.random.default_rng(4)
    return {k: (v + rng.normal(0, 0.1, v.shape).astype(np.float32)) if v.ndim == 1 else v for k, v in weights.items()}


@pytest.mark.parametrize("tied,dtype", [(True, "float32"), (False, "float32"), (True, "bfloat16")])
def test_torch_jax_torch_is_bitwise(tmp_path, exact_fp32, tied, dtype):
    import twinseq.torch_backend as tb
    from twinseq.jax_backend.checkpoint import load_pretrained, save_pretrained

    cfg = ModelConfig.preset("tiny", tie_word_embeddings=tied, num_hidden_layers=1, rope_theta=50000.0)
    original = tb.build_model(cfg, _weights(cfg), dtype=dtype)
    tb.save_pretrained(original, tmp_path / "torch")
    jax_model = load_pretrained(tmp_path / "torch")
    assert jax_model.dtype == dtype and jax_model.config == cfg
    save_pretrained(jax_model, tmp_path / "jax")

    first = load_file(str(tmp_path / "torch" / "model.safetensors"))
    second = load_file(str(tmp_path / "jax" / "model.safetensors"))
    assert set(first) == set(second)
    for name in first:
        assert first[name].dtype == second[name].dtype, name
        assert first[name].tobytes() == second[name].tobytes(), name

    back = tb.load_pretrained(tmp_path / "jax", dtype=dtype)
    expected, restored = original.state_dict(), back.state_dict()
    assert set(expected) == set(restored)
    for name, tensor in expected.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name


def test_imported_model_computes_the_torch_logits(tmp_path, harness):
    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb
    from twinseq.jax_backend.checkpoint import load_pretrained

    tb.save_pretrained(harness.torch_model, tmp_path)
    batch = harness.batches["padding_free"]
    jax_logits = jb.logits(load_pretrained(tmp_path), batch)
    torch_logits, _ = harness.torch_forward("padding_free")
    diff = np.abs(jax_logits - torch_logits)[valid_positions(batch)].max()
    assert diff <= tol("float32", "logits_abs"), diff
