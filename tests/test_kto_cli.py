"""``twinseq train --config configs/kto.yaml`` on each backend, in a fresh process from the installed command: KTO
trains on the embedded preference data (unpaired) and its target metric, the reward margin, moves.

Invariants: the mean ``rewards/margins`` of the last 10 of 30 steps is at least 0.5 above that of the first 5 (0 at
the first step: the policy is its reference); the KL estimate is logged, 0 at the first step and positive later;
the log names the method and the unpairing.
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
def test_kto_widens_the_reward_margin_on_the_embedded_data(backend, tmp_path):
    twinseq = Path(sys.executable).with_name("twinseq")
    cmd = [str(twinseq), "train", "--config", "configs/kto.yaml", "--backend", backend, "--output-dir",
           str(tmp_path), "--disable-tqdm"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stderr + out.stdout
    assert "kto_loss_type=kto, beta=0.1" in log and "unpaired into" in log
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    margins = [r.get("rewards/margins", np.nan) for r in rows]
    first, last = np.nanmean(margins[:5]), np.nanmean(margins[-10:])
    print(f"{backend}: rewards/margins, first 5 steps {first:.3f} -> last 10 {last:.3f}; kl {rows[0]['kl']:.3f} -> "
          f"{max(r['kl'] for r in rows):.3f} (max)")  # fmt: skip
    assert len(rows) == 30 and last > first + 0.5, margins
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and max(r["kl"] for r in rows) > 0
