"""The embedded SFT rows as a prompt-completion JSONL file: the data the torch training tests run on."""

import json
from pathlib import Path

from twinseq.common.data.corpus import load_embedded


def write_embedded_sft_jsonl(folder: Path, rows: int) -> str:
    """The first ``rows`` embedded SFT examples as ``folder/sft.jsonl``; returns its path."""
    path = Path(folder) / "sft.jsonl"
    with path.open("w") as f:
        for row in load_embedded("embedded-sft").select(range(rows)):
            f.write(json.dumps({"prompt": row["prompt"], "completion": row["completion"]}) + "\n")
    return str(path)
