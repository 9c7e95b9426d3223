"""Resumable checkpoints: model (safetensors), optimizer, scheduler, data position and RNG.

A run resumed from ``checkpoint-N`` continues bitwise-identically to one that never stopped
(CPU, fp32): the data iterator restarts at the same row, and every RNG is restored.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

TRAINER_STATE = "trainer_state.json"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, *, model, optimizer, scheduler, step: int, data_state: dict,
                    config: dict) -> Path:
    from twinseq.torch_backend.model import save_pretrained

    path.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, path)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": _rng_state()},
               path / "training_state.pt")
    (path / TRAINER_STATE).write_text(json.dumps({"step": step, "data": data_state, "config": config}, indent=2))
    return path


def load_checkpoint(path: str | Path, *, model, optimizer, scheduler) -> dict:
    """Restore model weights, optimizer, scheduler and RNG in place; return the trainer state."""
    path = Path(path)
    if not (path / TRAINER_STATE).is_file():
        raise ValueError(f"resume_from_checkpoint={str(path)!r} holds no {TRAINER_STATE}; pass a "
                         f"'checkpoint-N' directory written by `twinseq train --save-steps N`.")
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # lm_head is absent from the file when embeddings are tied.
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(path)!r} does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; resume with the same --model-config.")
    state = torch.load(path / "training_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return json.loads((path / TRAINER_STATE).read_text())
