"""The longest trainable sequence on one GPU, twinseq against TRL: ``benchmarks/max_length.py --device cuda``.

This is ``max_length.py``'s CUDA mode with settings that fit a few minutes of a GPU: the ``small`` model, the
twinseq rows with everything on (fused loss, checkpointing, tiled MLP, then + activation offloading) and TRL's
SFTTrainer, a 16 GiB cap, doubling from 16,384 tokens, bisection to 50 %, a probe slower than 60 s ending the
upward search. The cap is below the GPU's memory on purpose: with the whole GPU a model this small becomes
compute-bound (a step over a minute) before it runs out of memory, and a larger model spends most of each probe
drawing its weights; ``--cap`` and ``--model`` change it. The result is ``max_length_<gpu>_<date>.json``: the README's ``max_length`` row
shows it in its GPU column. Any further argument goes to ``max_length.py`` (a later one wins).

    python benchmarks/gpu/max_length_gpu.py --out DIR
    python benchmarks/gpu/max_length_gpu.py --smoke --no-write     # tiny search, CPU or GPU
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import max_length  # noqa: E402

GPU = ["--device", "cuda", "--model", "small", "--cap", "16GiB", "--setups", "torch,trl", "--staircase", "last",
       "--start", "16384",
       "--limit", "1048576", "--resolution", "0.5", "--max-probe-seconds", "60", "--timeout", "600"]
# a search that ends in seconds: a 300 MiB cap, lengths 256 .. 512
SMOKE = ["--setups", "torch,trl", "--staircase", "last", "--cap", "300MiB", "--start", "256", "--limit", "512",
         "--resolution", "0.5", "--sweep", ""]


def arguments(argv: Sequence[str], cuda: bool) -> list[str]:
    """``max_length.py``'s arguments: the GPU settings (or the smoke ones, on the GPU when there is one)."""
    argv = list(argv)
    if "--smoke" in argv:
        argv.remove("--smoke")
        return SMOKE + (["--device", "cuda"] if cuda else []) + argv
    return GPU + argv


def main(argv: Optional[Sequence[str]] = None) -> None:
    import torch

    max_length.main(arguments(sys.argv[1:] if argv is None else argv, torch.cuda.is_available()))


if __name__ == "__main__":
    main()
