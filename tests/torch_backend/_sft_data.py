"""The embedded SFT rows as a prompt-completion JSONL file: the data the torch training tests run on."""

import json
import shutil
from pathlib import Path

from twinseq.common.data.corpus import load_embedded


def write_embedded_sft_jsonl(folder: Path, rows: int) -> str:
    """The first ``rows`` embedded SFT examples as ``folder/sft.jsonl``; returns its path."""
    path = Path(folder) / "sft.jsonl"
    with path.open("w") as f:
        for row in load_embedded("embedded-sft").select(range(rows)):
            f.write(json.dumps({"prompt": row["prompt"], "completion": row["completion"]}) + "\n")
    return str(path)


def packed_tiny_config(data: str, out, **overrides):
    """The ``tiny`` preset on packed, padding-free 128-token rows of ``data`` (4 a step, ``varlen``), 50 steps at
    3e-3 after 2 warmup steps, seed 4, writing to ``out``: the optimizer tests' run, with ``overrides``."""
    from twinseq.common.config import TrainConfig

    base = dict(dataset_name=data, model_config="tiny", max_length=128, per_device_train_batch_size=4,
                packing=True, padding_free=True, attn_implementation="varlen", learning_rate=3e-3,
                warmup_steps=2, max_steps=50, output_dir=str(out), disable_tqdm=True, seed=4)  # fmt: skip
    return TrainConfig.from_flat(**{**base, **overrides})


def resume_folder(straight: Path, resumed: Path, step: int) -> str:
    """``resumed`` as a run stopped after ``step``: ``straight``'s ``checkpoint-<step>`` and the first ``step``
    lines of its ``metrics.jsonl``; returns the checkpoint's path (for ``resume_from_checkpoint``)."""
    resumed.mkdir()
    shutil.copytree(straight / f"checkpoint-{step}", resumed / f"checkpoint-{step}")
    lines = (straight / "metrics.jsonl").read_text().splitlines()[:step]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return str(resumed / f"checkpoint-{step}")
