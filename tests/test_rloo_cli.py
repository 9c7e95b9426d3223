"""``twinseq train --config configs/rloo.yaml`` on each backend, in a fresh process from the installed command: RLOO
trains on the embedded last-word task and the target metric moves.

Invariants: the mean reward of the last 5 of 30 steps is at least 0.2 above that of the first 5 (observed ~0.6 ->
1.0 on both backends); the KL penalty is live: 0 at the first step (the policy is its reference) and positive
after; the log names the method.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_rloo_raises_the_mean_reward_on_the_embedded_task(backend, tmp_path):
    twinseq = Path(sys.executable).with_name("twinseq")
    cmd = [str(twinseq), "train", "--config", "configs/rloo.yaml", "--backend", backend, "--output-dir",
           str(tmp_path), "--disable-tqdm"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loss=rloo (leave-one-out), rloo_beta=0.01" in out.stderr + out.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    rewards = [r["reward"] for r in rows]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    print(f"{backend}: mean reward, first 5 steps {first:.3f} -> last 5 {last:.3f}; kl {rows[1]['kl']:.3f} -> "
          f"{rows[-1]['kl']:.3f}")  # fmt: skip
    assert len(rows) == 30 and last > first + 0.2, rewards
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[-1]["kl"] > 0
