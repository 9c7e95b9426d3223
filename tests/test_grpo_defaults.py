"""GRPO's defaults and refusals are the same on both backends (the rollout's rules live in ``common.objectives.grpo``)."""

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.objectives.grpo import DEFAULT_MAX_COMPLETION_LENGTH


def _cfg(tmp_path, **overrides):
    values = dict(task="grpo", model_config="tiny", max_steps=1, per_device_train_batch_size=4, num_generations=4,
                  max_prompt_length=32, output_dir=str(tmp_path / "run"), disable_tqdm=True)
    return TrainConfig.from_flat(**{**values, **overrides})


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_unset_max_completion_length_is_trls_default_on_both_backends(backend, tmp_path):
    """The torch trainer generated up to 256 tokens and the jax one refused the run: now both take TRL 1.16's 512."""
    cfg = _cfg(tmp_path, backend=backend)
    assert cfg.data.max_completion_length is None
    if backend == "torch":
        import torch

        from twinseq.torch_backend.grpo import build_grpo

        trainer = build_grpo(cfg, torch.device("cpu"), None)[0]
    else:
        from twinseq.jax_backend.grpo import build_grpo

        trainer = build_grpo(cfg)[0]
    assert trainer.max_completion_length == DEFAULT_MAX_COMPLETION_LENGTH == 512


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_trl_1_16_loss_options_train_on_both_backends(backend, tmp_path):
    """GSPO (sequence-level ratios) with two-sided clipping, the bias-corrected KL, the high-entropy token mask,
    off-policy sequence masking and a second iteration per generation, under ``sapo``: two steps run end to end
    and log the KL (the arithmetic is checked against TRL's code in tests/torch_backend/test_grpo_trl_semantics.py)."""
    import json

    import twinseq

    cfg = _cfg(tmp_path, backend=backend, max_steps=2, num_iterations=2, max_completion_length=8, grpo_beta=0.04,
               grpo_loss_type="sapo", importance_sampling_level="sequence", delta=1.5, top_entropy_quantile=0.5,
               off_policy_mask_threshold=0.1)
    assert cfg.grpo.use_bias_correction_kl  # TRL 1.16's default
    metrics = [json.loads(line) for line in twinseq.train(cfg).read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert all(np.isfinite(m["loss"]) and "kl" in m for m in metrics if "loss" in m)
    assert "clip_ratio/region_mean" not in metrics[-1]  # sapo has no clip; TRL logs none for it
