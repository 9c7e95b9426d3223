"""GRPO's defaults and refusals are the same on both backends (the rollout's rules live in ``common.objectives.grpo``)."""

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
