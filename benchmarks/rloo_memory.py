"""RLOO memory and time: twinseq's torch RLOO trainer (``--task rloo``) vs TRL 1.16's ``RLOOTrainer``, same run, same
inputs: ``grpo_memory.py``'s measurement (its docstring says what is measured) with RLOO's advantage and loss,
``beta`` 0 (no reference model) on both sides.

    .venv/bin/python benchmarks/rloo_memory.py                         # tiny, 16 completions of 32 tokens
    .venv/bin/python benchmarks/rloo_memory.py --steps 2 --completion 8 --no-write   # quick
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_memory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], method="rloo", script=__file__))
