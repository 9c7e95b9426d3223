"""GRPO under DeepSpeed ZeRO-3 (``zero3_grpo.Zero3GRPOTrainer``) on CPU processes with gloo.

Invariants:
- The update: GRPO (and RLOO, on the same rollout) over 2 ranks under ZeRO-3 (every parameter partitioned, each
  rank a contiguous share of the step's prompts with their whole groups) takes the same steps as one process
  holding the whole step, on the same completions: per-step loss within 1e-5 of its terms' size (ratio x
  advantage, ~1) and gradient norm within 1e-5 relative over 4 steps (``num_iterations`` 2, so half the steps are
  off-policy), for a loss normalised per sequence (``grpo``) and per token over the step (``dapo``), for RLOO over
  5 steps (``task=rloo``: leave-one-out advantages of the gathered rewards, one ratio per completion), and the
  same step rewards (gathered over ranks); and with the adaptive entropy bonus (``dapo``), whose coefficient each
  step reads the entropy over every rank's tokens.
  The completions come from a fixed sampler keyed by the prompt (generation itself is compared below and in
  ``test_zero3.py``), and the reward is their length, so the advantages are not zero. A loss normalised per rank
  instead of per step, or gradients averaged over ranks instead of summed, changes the update by 2x.
- Generation: ``twinseq train --task grpo --deepspeed-zero-stage 3`` on 2 ranks with sampled completions logs
  the same losses, rewards and completion lengths at every step with ``ds3_gather_for_generation`` True (the full
  weights gathered once per generation) and False (the partitioned model, layer by layer, ranks in lock-step).
- Refusals: ``grpo_beta > 0`` (its frozen reference copy is not partitioned) and the Liger loss name their flags.

The spawned ranks run this file (``python test_zero3_grpo.py SPEC.json OUT_DIR``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402

from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402

REL = 1e-5
STEPS = 4
GRPO = dict(task="grpo", deepspeed_zero_stage=3, max_steps=STEPS, num_generations=2, max_completion_length=6,
            learning_rate=3e-3, seed=0, disable_tqdm=True, max_grad_norm=None)

needs_deepspeed = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("deepspeed"),
    reason="DeepSpeed is not installed (pip install 'twinseq[deepspeed]')")


# --------------------------------------------------------------------------------------
# The rank's side
# --------------------------------------------------------------------------------------


def length_reward(prompts, completions, **_) -> list[float]:
    return [float(len(c)) for c in completions]


def fixed_step_job(values: dict) -> dict:
    """``max_steps`` steps of ``Zero3GRPOTrainer`` whose completions come from a sampler keyed by the prompt and the
    generation index within its group, so any split of the step over ranks sees the same completions."""
    from twinseq.torch_backend.zero3_grpo import build_grpo_zero3

    cfg = TrainConfig.from_flat(**values)
    trainer, source, tokenizer, _ = build_grpo_zero3(cfg, reward_funcs=[length_reward])
    columns, groups = trainer.max_completion_length, cfg.grpo.num_generations
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def fixed(prompt_ids, **_):
        rows = np.full((len(prompt_ids), columns), pad, dtype=np.int64)
        for i, prompt in enumerate(prompt_ids):
            rng = np.random.default_rng([int(sum(prompt)), len(prompt), i % groups])
            n = int(rng.integers(1, columns + 1))
            rows[i, :n] = rng.integers(3, 200, n)
            if n < columns:
                rows[i, n] = eos
        return rows

    trainer.sample = fixed  # GroupRollout's backend hook: the completions of these prompt ids
    steps = [trainer.step(source.next_step()) for _ in range(cfg.max_steps)]
    return {"losses": [s["loss"] for s in steps], "grad_norms": [s["grad_norm"] for s in steps],
            "rewards": [s["reward"] for s in steps]}


def train_job(configs: list[dict]) -> dict:
    from twinseq.torch_backend.recipes import train

    for values in configs:
        train(TrainConfig.from_flat(**values))
    return {"done": len(configs)}


def launch(spec: dict, tmp_path: Path, world_size: int, timeout: float = 400.0) -> list[dict]:
    """``world_size`` local ranks running this file on ``spec`` (torchrun's environment; none for one rank)."""
    return W.launch_script(__file__, spec, tmp_path, world_size, timeout=timeout, launcher_for_one=False,
                           env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})


# --------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float((np.abs(got - want) / np.abs(want)).max())


@needs_deepspeed
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "rloo", "dapo+adaptive_entropy"])
def test_two_ranks_take_the_single_process_steps(tmp_path, loss_type):
    # num_iterations=2: every other step reuses its completions after an update, so the ratio moves off 1 and the
    # loss off 0 (on-policy, the advantages of a group sum to 0 and so does the loss; its gradient does not).
    # rloo: task=rloo (leave-one-out advantages, RLOO's sequence-level loss), rloo_beta=0 as ZeRO-3 requires, and a
    # smaller step: its one ratio per completion sums the log-ratios of all its tokens, and at 3e-3 every reused
    # completion leaves the clip range (no gradient at all)
    # dapo+adaptive_entropy: the entropy bonus, its coefficient moved each step from the entropy over both ranks'
    # tokens (a target above any entropy here, so it applies from the second step and grows)
    task = {
        "rloo": dict(task="rloo", rloo_beta=0.0, learning_rate=1e-4, max_steps=5),  # 5 steps: issue 27's RLOO check
        "dapo+adaptive_entropy": dict(grpo_loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.05,
                                      entropy_coef_delta=0.02, entropy_target=100.0),
    }.get(loss_type, dict(grpo_loss_type=loss_type))
    common = dict(GRPO, num_iterations=2, output_dir=str(tmp_path / "unused"))
    common.update(task)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (one,) = launch({"fixed": dict(common, per_device_train_batch_size=2, gradient_accumulation_steps=2)},
                    tmp_path / "one", world_size=1)
    two = launch({"fixed": dict(common, per_device_train_batch_size=2, gradient_accumulation_steps=1)},
                 tmp_path / "two", world_size=2)
    assert two[0] == two[1], "every rank logs the step's reduced figures"
    print(f"{loss_type}: losses 1 process {one['losses']}, 2 ranks {two[0]['losses']}")
    assert all(n > 1e-3 for n in one["grad_norms"]), ("the advantages must not all be zero", one)
    assert any(abs(x) > 1e-4 for x in one["losses"]), "the reused steps must have a loss off 0"
    # the loss's terms are ratio x advantage, both ~1 (group-normalised advantages): relative to their size,
    # the bound is absolute (the loss itself is ~0 on the on-policy steps)
    assert np.abs(np.subtract(two[0]["losses"], one["losses"])).max() <= REL, (two[0]["losses"], one["losses"])
    assert _rel(two[0]["grad_norms"], one["grad_norms"]) <= REL, (two[0]["grad_norms"], one["grad_norms"])
    assert two[0]["rewards"] == pytest.approx(one["rewards"], rel=1e-12)


def _metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@needs_deepspeed
@pytest.mark.distributed
@pytest.mark.slow
def test_both_gather_settings_train_alike_on_two_ranks(tmp_path):
    runs = {}
    for gather in (True, False):
        out = tmp_path / f"gather_{gather}"
        (tmp_path / f"spec_{gather}").mkdir()
        launch({"train": [dict(GRPO, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                               ds3_gather_for_generation=gather, output_dir=str(out))]},
               tmp_path / f"spec_{gather}", world_size=2)
        runs[gather] = _metrics(out)
    keys = ("loss", "reward", "completions/mean_length", "grad_norm")
    print("gathered:", [{k: round(r[k], 6) for k in keys} for r in runs[True]])
    print("partitioned:", [r["generation_seconds"] for r in runs[False]], "s generating vs gathered",
          [r["generation_seconds"] for r in runs[True]])
    for step, (a, b) in enumerate(zip(runs[True], runs[False])):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, step
    assert len(runs[True]) == 3 and all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in runs[True])


@pytest.mark.parametrize("overrides, match", [
    (dict(grpo_beta=0.04), "grpo_beta=0.04"),
    (dict(loss_type="liger"), "loss_type='liger'"),
])
def test_unsupported_grpo_combinations_are_refused(overrides, match):
    from twinseq.torch_backend.deepspeed import check_zero3_config

    with pytest.raises(ConfigError, match=match):
        check_zero3_config(TrainConfig.from_flat(**{**GRPO, "output_dir": "/nonexistent", **overrides}))


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = train_job(spec["train"]) if "train" in spec else fixed_step_job(spec["fixed"])
    Path(argv[1], f"rank{os.environ['TWINSEQ_TEST_RANK']}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip teardown: gloo's static destructors can race (as _dist_workers does)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
