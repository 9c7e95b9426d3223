"""The golden-loss rule (house style 9): a refactor that is not meant to change numerics gives
bit-identical losses at a fixed seed on CPU.

``tests/assets/golden_losses.json`` holds 20-step loss trajectories of SFT and DPO on both
backends, recorded before the trainers were rebuilt on the common runner (commit named in the
file). Each run is replayed here through the CLI with the same flags, and every logged loss must
be float-equal: not close, equal.

The runs go through a subprocess with a pinned environment: XLA's CPU reductions depend on how
many host devices the process exposes (this suite's conftest asks for 8), so the JAX trajectory is
only reproducible bit for bit under the environment it was recorded in (one device).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinseq.common.metrics import read_metrics

GOLDEN = json.loads((Path(__file__).parent / "assets" / "golden_losses.json").read_text())
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}


def run_golden(argv: list[str], output_dir: Path) -> list[float]:
    """Losses of one ``twinseq train`` run in a fresh interpreter with the recording environment."""
    cmd = [sys.executable, "-m", "twinseq.common.cli", "train", *argv, "--output-dir", str(output_dir),
           "--disable-tqdm"]
    out = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return [r["loss"] for r in read_metrics(output_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GOLDEN["runs"]))
def test_losses_are_bit_identical_to_the_golden_trajectory(name, tmp_path):
    run = GOLDEN["runs"][name]
    losses = run_golden(run["argv"], tmp_path)
    assert len(losses) == len(run["loss"]) == 20
    assert losses == run["loss"], next((i, a, b) for i, (a, b) in enumerate(zip(losses, run["loss"])) if a != b)


if __name__ == "__main__":  # re-record (only where numerics are meant to change): python tests/test_golden_losses.py
    import tempfile

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for name, run in GOLDEN["runs"].items():
        run["loss"] = run_golden(run["argv"], Path(tempfile.mkdtemp()))
        print(name, run["loss"][0], run["loss"][-1])
    GOLDEN["recorded_at_commit"] = commit
    (Path(__file__).parent / "assets" / "golden_losses.json").write_text(json.dumps(GOLDEN, indent=1) + "\n")
