"""``sync_ref_model`` (TR-DPO, TRL's ``SyncRefModelCallback``) on both backends: the reference follows the policy.

Invariants:
- after every ``ref_model_sync_steps``-th step, and only then, the reference becomes ``(1 - α) ref + α policy``
  (``common.objectives.reference.mix``, float64, against float32 weights: within 1e-6 of the largest weight);
  before the first synchronisation it is the initial policy, bit for bit;
- torch's update is TRL's own ``SyncRefModelCallback._sync_target_model``, bit for bit;
- a checkpoint holds the moved reference: a resume from it gives the uninterrupted run's losses, and a resume that
  drops it (the run without ``sync_ref_model``) does not (the negative control);
- the config refuses it with PEFT, with precomputed reference log-probs, without a KL term, and on SFT.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.reference import mix
from twinseq.common.run.inputs import NO_INPUTS

ALPHA, EVERY = 0.3, 2


def _cfg(backend: str, tmp_path, **kw) -> TrainConfig:
    base = dict(task="dpo", backend=backend, model_config="tiny", max_steps=4, per_device_train_batch_size=4,
                max_length=64, learning_rate=3e-2, padding_free=True, loss_type="fused_linear", seed=1,
                sync_ref_model=True, ref_model_sync_steps=EVERY, ref_model_mixup_alpha=ALPHA, disable_tqdm=True,
                output_dir=str(tmp_path / "out"))  # fmt: skip
    return TrainConfig.from_flat(**{**base, **kw})


def _build(cfg: TrainConfig):
    if cfg.backend == "torch":
        import torch

        from twinseq.torch_backend.recipes import builders

        return builders(cfg, torch.device("cpu"), None)["dpo"](inputs=NO_INPUTS)
    from twinseq.jax_backend.recipes import builders as jax_builders

    return jax_builders(cfg)["dpo"](inputs=NO_INPUTS)


def _weights(trainer) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(policy, reference) float32 weights by HF name."""
    if hasattr(trainer, "causal_lm"):
        grab = lambda m: {n: p.detach().numpy().copy() for n, p in m.named_parameters()}  # noqa: E731
        return grab(trainer.causal_lm), grab(trainer.ref_model)
    from twinseq.jax_backend.model import lazy_weights
    from twinseq.jax_backend.trainer import merge_state

    grab = lambda m: {k: v.produce() for k, v in lazy_weights(m).items()}  # noqa: E731
    return grab(trainer.model()), grab(merge_state(trainer.graphdef, trainer.ref_params, None))


@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_the_reference_follows_the_policy_every_n_steps(backend, tmp_path):
    trainer, source, _, _ = _build(_cfg(backend, tmp_path))
    policy0, ref = _weights(trainer)
    expected = {k: v.astype(np.float64) for k, v in policy0.items()}
    for step in range(1, 5):
        trainer.step(source.next_step())
        trainer.after_step(step)
        policy, ref = _weights(trainer)
        if step % EVERY == 0:
            expected = {k: mix(expected[k], policy[k], ALPHA) for k in expected}
        if step == 1:  # no synchronisation yet: the initial policy, exactly
            assert all(np.array_equal(ref[k], policy0[k]) for k in policy0)
        scale = max(float(np.abs(v).max()) for v in expected.values())
        worst = max(float(np.abs(ref[k] - expected[k]).max()) for k in expected)
        assert worst <= 1e-6 * scale, (step, worst)
    moved = max(float(np.abs(ref[k] - policy0[k]).max()) for k in ref)
    lag = max(float(np.abs(ref[k] - policy[k]).max()) for k in ref)
    assert moved > 1e-3 and lag > 1e-3  # it moved, and it is not the policy


def test_torch_mixes_as_trls_callback(tmp_path):
    pytest.importorskip("trl")
    from trl.trainer.callbacks import SyncRefModelCallback

    trainer, source, _, _ = _build(_cfg("torch", tmp_path))
    trainer.step(source.next_step())
    theirs = copy.deepcopy(trainer.ref_model)
    SyncRefModelCallback._sync_target_model(trainer.causal_lm, theirs, ALPHA)
    trainer.mix_reference(ALPHA)
    ours = dict(trainer.ref_model.named_parameters())
    assert all(np.array_equal(p.detach().numpy(), ours[n].detach().numpy()) for n, p in theirs.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_resume_restores_the_moved_reference(backend, tmp_path):
    from twinseq import train
    from twinseq.common.run.report import read_metrics

    full = _cfg(backend, tmp_path, save_steps=EVERY, ref_model_sync_steps=1)  # moves at steps 1, 2 (saved), 3, 4
    read = lambda c: {r["step"]: r["loss"] for r in read_metrics(c.output_dir)}  # noqa: E731
    train(full)
    want = read(full)
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    resumed = full.replace(output_dir=str(tmp_path / "resumed"), resume_from_checkpoint=checkpoint)
    train(resumed)
    got = read(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])
    # negative control: without the checkpoint's reference (the initial policy instead) step 3 differs
    stale = full.replace(output_dir=str(tmp_path / "stale"), resume_from_checkpoint=checkpoint, sync_ref_model=False)
    train(stale)
    assert abs(read(stale)[3] - want[3]) > 1e-4 * abs(want[3])


@pytest.mark.parametrize(
    "flat, needle",
    [
        (dict(task="dpo", sync_ref_model=True, use_peft=True), "with use_peft=True"),
        (dict(task="kto", sync_ref_model=True, precompute_ref_log_probs=True), "with precompute_ref_log_probs=True"),
        (dict(task="grpo", sync_ref_model=True), "with grpo_beta=0"),
        (dict(task="rloo", sync_ref_model=True, rloo_beta=0.0), "with rloo_beta=0"),
        (dict(task="sft", ref_model_sync_steps=4), "read by task='dpo' or 'grpo' or 'rloo' or 'kto' only"),
        (dict(task="dpo", ref_model_mixup_alpha=1.5), "ref_model_mixup_alpha=1.5"),
    ],
)
def test_the_config_refuses_what_cannot_sync(flat, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_flat(**flat)
