"""CLI parity (issue 4): ``twinseq train --backend torch`` and ``--backend jax``, same flags, same seed.

Both runs go through ``twinseq.common.cli.main`` in this process (tyro parses the same flags into
the same ``TrainConfig``), read the same local JSONL through ``common.data.prepare`` and
``common.data.sft_steps.StepIterator``, and log ``metrics.jsonl``. Warmup, cosine decay, weight decay on
matrices, gradient clipping and two accumulated micro-batches per step are all active.

Invariants, at every one of 50 steps (float32, CPU):
- both backends saw the same data: ``num_tokens`` and ``num_label_tokens`` are equal;
- they used the same learning rate (``lr``, relative 1e-7);
- their losses agree within ``cli_50_steps_loss_rel`` (1e-4, see TOLERANCES.md).

Layouts: padded rows, and packed padding-free rows (documents share a row).
"""

from __future__ import annotations

import pytest

from parity_tests.tolerances import tol
from twinseq.common.run.report import read_metrics

pytest.importorskip("torch")
pytest.importorskip("jax")

NUM_STEPS = 50
LAYOUT_FLAGS = {"padded": [], "packed": ["--packing", "--padding-free"]}


def _flags(data: str, layout: str) -> list[str]:
    return ["--dataset-name", data, "--model-config", "tiny", "--max-length", "64", "--seed", "3",
            "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "2",
            "--learning-rate", "3e-3", "--lr-scheduler-type", "cosine", "--warmup-steps", "5",
            "--weight-decay", "0.1", "--max-grad-norm", "1.0", "--max-steps", str(NUM_STEPS),
            "--pad-to-multiple-of", "32", "--dtype", "float32", "--disable-tqdm", *LAYOUT_FLAGS[layout]]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUT_FLAGS))
def test_cli_runs_of_both_backends_agree_for_50_steps(exact_fp32, sft_jsonl, tmp_path, layout):
    from twinseq.common.cli import main

    for backend in ("torch", "jax"):
        assert main(["train", "--backend", backend, "--output-dir", str(tmp_path / backend),
                     *_flags(sft_jsonl, layout)]) == 0
    runs = {backend: read_metrics(tmp_path / backend) for backend in ("torch", "jax")}
    assert [r["step"] for r in runs["torch"]] == [r["step"] for r in runs["jax"]] == list(range(1, NUM_STEPS + 1))
    worst = 0.0
    for t, j in zip(runs["torch"], runs["jax"]):
        step = t["step"]
        assert (j["num_tokens"], j["num_label_tokens"]) == (t["num_tokens"], t["num_label_tokens"]), step
        assert j["lr"] == pytest.approx(t["lr"], rel=1e-7, abs=1e-12), step
        rel = abs(j["loss"] - t["loss"]) / abs(t["loss"])
        worst = max(worst, rel)
        assert rel <= tol("float32", "cli_50_steps_loss_rel"), (step, t["loss"], j["loss"], rel)
    clipped = sum(r["grad_norm"] > 1.0 for r in runs["torch"])
    print(f"CLI parity ({layout}): worst loss rel {worst:.2e} over {NUM_STEPS} steps; {clipped} steps clipped; "
          f"loss {runs['torch'][0]['loss']:.3f} -> {runs['torch'][-1]['loss']:.3f}")
    # The comparison must cover a real trajectory: warmup (lr 0 first), clipping, and a falling loss.
    assert runs["torch"][0]["lr"] == 0.0 and clipped > 0
    assert runs["torch"][-1]["loss"] < 0.8 * runs["torch"][0]["loss"]
