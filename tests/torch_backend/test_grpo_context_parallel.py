"""GRPO under context parallelism (``grpo_context_parallel.cp_completion_logps``, ``GRPOTrainer`` with a runtime) on 2
gloo processes.

Invariants:
- GRPO with ``context_parallel_size=2`` (FSDP2, cp=2) trains exactly like one process from the same seed: the same
  completions and rewards per step, the loss and the KL within 1e-5 (absolute: the loss of a first iteration is 0 up
  to rounding), the pre-clip gradient norm within 1e-5 relative, the first step's gradients per tensor and the final
  weights within 1e-5 relative; with a frozen reference copy (allgather, padded rows), with LoRA (the reference: the
  adapters off; ulysses, padding-free) and with the entropy bonus (the entropy's gradient).
  A second iteration per generation (``num_iterations=2``) scores the sampling policy's log-probs sharded too.
- negative control: torch's differentiable all-reduce in place of ``sum_over_ranks`` counts every gradient cp
  times, and the comparison sees it.
- a rank's scored completion tokens are the shifted targets of its shard: over the ranks, every token of the
  micro-batch is scored exactly once with its own target; sharding the unshifted layout misassigns them.
- the CLI under ``torchrun --nproc-per-node 2`` trains ``--task grpo --context-parallel-size 2``.
- what GRPO under CP cannot run is refused before any work, naming the field, the value and the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402
import _grpo_cp_workers as G  # noqa: E402

from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.objectives.grpo import collate_completions  # noqa: E402
from twinseq.common.objectives.nll import shift_labels  # noqa: E402
from twinseq.common.run.capabilities import Runtime, check_runtime  # noqa: E402
from twinseq.torch_backend.grpo_context_parallel import completion_shard, token_index_BT  # noqa: E402

TOL = 1e-5
CP = 2
CP_FLAGS = dict(context_parallel_size=CP, pad_to_multiple_of=2 * CP)
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, learning_rate=1e-2)
JOBS = {
    "padded": {},
    "lora_ulysses": dict(padding_free=True, context_parallel_strategy="ulysses", **LORA),
    # the entropy bonus (its gradient); not top_entropy_quantile < 1: a random model's completion tokens have entropies
    # within ~1e-7 of ln(V), so rounding reorders them around the quantile and the mask is ill-conditioned
    "entropy": dict(padding_free=True, entropy_coef=0.05),
}


def _single_process(overrides: dict):
    """The single-process run from the same seed: the CP flags minus the cp size (the same padding)."""
    overrides = {k: v for k, v in overrides.items() if k != "context_parallel_strategy"}
    return G.train(G.make_config(**{"pad_to_multiple_of": 2 * CP, **overrides}))


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("grpo_cp")


@pytest.fixture(scope="module")
def dist_results(dist_dir):
    jobs = [{"name": name, "config": G.make_config(**{**CP_FLAGS, **kw}).to_dict()} for name, kw in JOBS.items()]
    jobs.append(
        {
            "name": "control",
            "control": "autograd_all_reduce",
            "config": G.make_config(**CP_FLAGS, max_steps=1).to_dict(),
        }
    )  # last: it patches the reduction
    return W.launch_script(
        G.__file__, {"jobs": jobs}, dist_dir, CP, timeout=400, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    )


def _relative(got: dict, want: dict) -> dict[str, float]:
    """Per tensor ``||got - want|| / ||want||``; a tensor exactly zero in ``want`` must be exactly zero in ``got``."""
    assert sorted(got) == sorted(want)
    zero = [k for k in want if not np.any(want[k])]
    assert all(not np.any(got[k]) for k in zero) and len(zero) < len(want)
    return {k: float(np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])) for k in want if k not in zero}


def _assert_matches(records: list[dict], ref: list[dict]) -> None:
    assert len(records) == len(ref) == 3
    for step, (got, want) in enumerate(zip(records, ref), 1):
        assert sorted(got) == sorted(want)
        for key in ("reward", "completions/mean_length"):  # the same completions were sampled
            assert got[key] == want[key], f"step {step} {key}: {got[key]} vs {want[key]}"
        for key in ("loss", "kl"):
            assert abs(got[key] - want[key]) <= TOL, f"step {step} {key}: {got[key]} vs {want[key]}"
        rel = abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"]
        assert rel <= TOL, f"step {step} grad_norm: {got['grad_norm']} vs {want['grad_norm']} ({rel:.2e})"


pytestmark = [pytest.mark.distributed]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JOBS))
def test_grpo_with_context_parallelism_on_two_ranks_matches_single_process(dist_results, dist_dir, name):
    assert dist_results[0][name] == dist_results[1][name], "the cp ranks logged different metrics"
    ref_records, ref_grads, ref_weights = _single_process(JOBS[name])
    assert max(abs(r["loss"]) for r in ref_records) > 100 * TOL, "the loss must depend on the log-probs"
    assert ref_records[-1]["kl"] > 100 * TOL, "the policy must move away from the reference"
    _assert_matches(dist_results[0][name], ref_records)
    grads = _relative(dict(np.load(dist_dir / f"{name}_grads.npz")), ref_grads)
    worst = max(grads, key=grads.get)
    assert grads[worst] <= TOL, f"{worst}: relative gradient difference {grads[worst]:.2e}"
    weights = {
        k: float(np.linalg.norm(v - ref_weights[k]) / np.linalg.norm(ref_weights[k]))
        for k, v in np.load(dist_dir / f"{name}_weights.npz").items()
    }
    assert sorted(weights) == sorted(ref_weights)
    worst = max(weights, key=weights.get)
    assert weights[worst] <= TOL, f"{worst}: relative weight difference {weights[worst]:.2e}"
    if JOBS[name].get("use_peft"):
        assert all("lora_" in k for k in ref_grads), "under LoRA only the adapters train"


@pytest.mark.slow
def test_a_gradient_summed_in_the_all_reduce_backward_is_caught(dist_results, dist_dir):
    """Negative control: the all-reduce whose backward sums over the cp ranks doubles every gradient (cp = 2)."""
    _, ref_grads, _ = G.train(G.make_config(pad_to_multiple_of=2 * CP, max_steps=1))
    got = dict(np.load(dist_dir / "control_grads.npz"))
    ratio = {k: float(np.linalg.norm(got[k]) / np.linalg.norm(ref_grads[k])) for k in ref_grads if np.any(ref_grads[k])}
    assert all(abs(r - CP) < 1e-3 for r in ratio.values()), ratio
    assert max(_relative(got, ref_grads).values()) > 0.5 > 100 * TOL


# --------------------------------------------------------------------------------------
# One process: the shard's scored tokens
# --------------------------------------------------------------------------------------


def _completion_batch(padding_free: bool):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, size=int(rng.integers(2, 9))).tolist() for _ in range(4)]
    completions = [rng.integers(3, 200, size=int(rng.integers(1, 8))) for _ in range(4)]
    return collate_completions(
        prompts,
        completions,
        padding_free=padding_free,
        pad_token_id=0,
        num_columns=8,
        pad_to_multiple_of=2 * CP,
        share_prefix=False,
    )


@pytest.mark.parametrize("padding_free", [False, True])
def test_shard_scored_tokens_partition_the_micro_batch(padding_free):
    """Every scored completion token is on exactly one rank, with its own target (the token at its [N, C] place);
    the token indices sharded before the shift (the unshifted layout) pair them with the wrong targets."""
    from twinseq.common.data.context_parallel import pad_doc_ids, shard_doc_ids

    cb = _completion_batch(padding_free)
    n = len(cb.token_row_n)
    ids_NC = np.zeros((cb.num_docs, cb.num_columns), np.int64)
    ids_NC[cb.token_row_n, cb.token_col_n] = shift_labels(cb.batch.labels)[cb.target_doc_ids >= 0]
    seen = np.zeros(n, np.int64)
    wrong = 0
    for rank in range(CP):
        shard = completion_shard(cb, CP, rank)
        tok, targets = shard.token_BL.numpy(), shard.shard.targets.numpy()
        assert ((targets != -100) == (tok >= 0)).all(), "a target without a token, or a token without a target"
        idx = tok[tok >= 0]
        np.add.at(seen, idx, 1)
        np.testing.assert_array_equal(targets[tok >= 0], ids_NC[cb.token_row_n[idx], cb.token_col_n[idx]])
        # negative control: the token indices moved one place (the unshifted layout), then sharded
        unshifted = np.pad(token_index_BT(cb)[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        bad = shard_doc_ids(pad_doc_ids(unshifted, cb.batch.shape[0], 2 * CP), CP, rank)
        both = (bad >= 0) & (targets != -100)
        wrong += int((targets[both] != ids_NC[cb.token_row_n[bad[both]], cb.token_col_n[bad[both]]]).sum())
    np.testing.assert_array_equal(seen, np.ones(n, np.int64))
    assert wrong > 0


# --------------------------------------------------------------------------------------
# Refusals (one process, before any work)
# --------------------------------------------------------------------------------------


def _check(world_size: int = CP, device: str = "cpu", task: str = "grpo", **kw):
    cfg = TrainConfig.from_flat(task=task, context_parallel_size=CP, **kw)
    check_runtime(cfg, Runtime("torch", device, world_size, accelerator=device == "cuda"))


def test_grpo_context_parallel_configs_that_run_pass_the_check():
    _check()
    _check(task="rloo")
    _check(padding_free=True, context_parallel_strategy="ulysses")
    _check(use_peft=True, grpo_beta=0.1)
    _check(pad_to_multiple_of=8, loss_type="chunked_nll", entropy_coef=0.01)


@pytest.mark.parametrize(
    "kw, fragments",
    [
        (dict(world_size=4), ["world_size=4", "--nproc-per-node 2"]),
        (dict(context_parallel_strategy="ring", device="cuda"), ["context_parallel_strategy='ring'", "allgather"]),
        (dict(loss_type="liger", device="cuda"), ["loss_type='liger'", "--loss-type fused_linear"]),
        (dict(use_vllm=True, device="cuda"), ["use_vllm=True", "drop --use-vllm"]),
        (dict(use_peft=True, load_in_4bit=True, device="cuda"), ["load_in_4bit=True", "drop --load-in-4bit"]),
        (dict(eval_strategy="steps", eval_fraction=0.1), ["eval_strategy='steps'", "--eval-strategy no"]),
        (dict(torch_compile=True), ["torch_compile=True", "drop --torch-compile"]),
        (dict(task="rloo", world_size=4), ["task='rloo'", "world_size=4"]),
    ],
)
def test_what_grpo_under_context_parallelism_cannot_run_is_refused(kw, fragments):
    with pytest.raises(ConfigError) as err:
        _check(**kw)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


# --------------------------------------------------------------------------------------
# The CLI under torchrun
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_twinseq_train_grpo_under_torchrun_with_context_parallelism(tmp_path):
    """``twinseq train --task grpo --context-parallel-size 2`` under ``torchrun --nproc-per-node 2`` on the embedded
    prompts: rank 0 writes 2 steps of metrics and announces the mesh."""
    from twinseq.common.run.report import read_metrics

    flags = dict(
        task="grpo",
        model_config="tiny",
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_prompt_length=32,
        max_completion_length=8,
        context_parallel_size=CP,
        padding_free=True,
        pad_to_multiple_of=2 * CP,
        grpo_beta=0.1,
        output_dir=str(tmp_path / "run"),
        disable_tqdm=True,
    )
    argv = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={CP}",
        "-m",
        "twinseq.common.cli",
        "train",
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "cp strategy=allgather" in proc.stdout + proc.stderr
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)
