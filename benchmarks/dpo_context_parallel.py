"""The longest DPO document that trains, one process against context parallelism (CP), under a memory cap per rank.

One probe = one optimizer step of ``twinseq train --task dpo`` (policy forward + backward, live reference forward,
AdamW) in fresh processes, on one preference pair whose chosen and rejected documents are both exactly T tokens
(prompt + completion, cut by ``--max-length T``), the two documents in one padding-free row of 2T tokens. Peak
memory is ``_train_peak``'s: the step's peak RSS above the RSS just before the model is built (parameters,
gradients, AdamW moments and the reference copy are inside it); under CP (``torchrun``, ``--cp`` gloo ranks,
``allgather``) the largest rank's. A probe fits when it trains and its peak is at most ``--cap``; the search is
``max_length.search`` (doubling, then bisection to ``--resolution``).

Both setups run the same settings (``--model-config``, fp32, ``--loss-type``, gradient checkpointing with
``--gradient-checkpointing``, ``sdpa``: the blocked document attention for rows of 2048 tokens or more, and
``allgather`` CP's blocked attention). Acceptance: the CP setup trains documents at least ``--target`` (1.8) times
longer than one process.

Why the defaults (``tiny``, ``nll``, no checkpointing, 512 MiB): CP divides the per-token memory by cp, not the
fixed part (weights, optimizer state, the reference copy, the framework; a CP rank's is a little larger: gloo,
FSDP2), so the ratio nears cp only where the per-token part dominates the cap. With the full logits (``nll``,
~220 KB per document token here) it does at lengths a 2-core CPU trains in seconds; with ``fused_linear`` and
checkpointing (~18 KB per document token) the same would need caps of several hundred MiB and documents of
10k+ tokens, whose O(T^2) attention takes many minutes per probe on this CPU (``--loss-type fused_linear
--gradient-checkpointing --cap 1GiB`` runs it where there is time).

    .venv/bin/python benchmarks/dpo_context_parallel.py                          # tiny, nll, 512 MiB cap, cp=2
    .venv/bin/python benchmarks/dpo_context_parallel.py --cap 256MiB --no-write  # quicker
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402
from _train_peak import measure  # noqa: E402
from max_length import _measure_torchrun, parse_bytes, search  # noqa: E402

TARGET = 1.8


def preference_file(folder: Path, length: int) -> Path:
    """A JSONL with one preference pair whose completions are long enough that ``--max-length length`` cuts both
    documents to exactly ``length`` tokens (random words, seeded; the embedded tokenizer)."""
    import numpy as np

    path = folder / f"pair_{length}.jsonl"
    if not path.exists():
        rng = np.random.default_rng(length)
        words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]

        def text(n: int) -> str:
            return " ".join(rng.choice(words, size=n).tolist())

        row = {"prompt": text(8), "chosen": text(2 * length), "rejected": text(2 * length)}
        path.write_text(json.dumps(row) + "\n")
    return path


def dpo_values(args: argparse.Namespace, doc: Path, length: int, cp: int) -> dict[str, Any]:
    values: dict[str, Any] = dict(
        backend="torch",
        task="dpo",
        model_config=args.model_config,
        dataset_name=str(doc),
        max_length=length,
        max_prompt_length=8,
        per_device_train_batch_size=1,
        padding_free=True,
        pad_to_multiple_of=4 * cp,
        loss_type=args.loss_type,
        gradient_checkpointing=args.gradient_checkpointing,
        attn_implementation="sdpa",
        dtype="float32",
        learning_rate=1e-4,
        lr_scheduler_type="constant",
    )
    if cp > 1:
        values["context_parallel_size"] = cp
    return values


def probe(args: argparse.Namespace, folder: Path, length: int, cp: int) -> dict[str, Any]:
    values = dpo_values(args, preference_file(folder, length), length, cp)
    if cp > 1:
        got = _measure_torchrun(values, cp, args.timeout, args.threads)
    else:
        got = measure(values, max_steps=1, timeout=args.timeout, threads=args.threads)
    out = {"peak_bytes": got["peak_bytes"], "seconds": max(got["step_seconds"]), "command": got["command"]}
    if "per_rank_peak_bytes" in got:
        out["per_rank_peak_bytes"] = got["per_rank_peak_bytes"]
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap", type=parse_bytes, default=parse_bytes("512MiB"), help="memory cap per process")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--model-config", default="tiny")
    parser.add_argument("--loss-type", default="nll")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--start", type=int, default=1024, help="first document length probed")
    parser.add_argument("--limit", type=int, default=65536)
    parser.add_argument("--resolution", type=float, default=0.05)
    parser.add_argument("--max-probe-seconds", type=float, default=900.0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of a probe (split over its ranks)")
    parser.add_argument("--target", type=float, default=TARGET)
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    run = start_run(parse_args, argv, __file__, device="cpu")
    args = run.args
    results = []
    with tempfile.TemporaryDirectory(prefix="twinseq-dpo-cp-") as tmp:
        for cp in (1, args.cp):
            name = "1 process" if cp == 1 else f"cp={cp} allgather (FSDP2, gloo)"
            print(f"{name}:", flush=True)
            found = search(lambda n, _cp=cp: probe(args, Path(tmp), n, _cp), args.cap, start=args.start,
                           limit=args.limit, resolution=args.resolution, max_seconds=args.max_probe_seconds)
            results.append({"setup": name, "cp": cp, **found})
    single, sharded = results
    ratio = sharded["max_length"] / single["max_length"] if single["max_length"] else float("nan")
    rows = []
    for r in results:
        fit = [p for p in r["probes"] if p["length"] == r["max_length"] and "peak_bytes" in p]
        peak = f"{fit[-1]['peak_bytes'] / MIB:.0f}" if fit else ""
        secs = f"{fit[-1]['seconds']:.0f}" if fit else ""
        rows.append([r["setup"], f"{r['max_length']:,}", f"{2 * r['max_length']:,}", r["bound"], peak, secs,
                     f"{r['max_length'] / single['max_length']:.2f}x" if single["max_length"] else ""])
    commands = [next((p["command"] for p in r["probes"] if "command" in p), "") for r in results]
    checks = {f"cp={args.cp} >= {args.target}x one process": ratio >= args.target}
    body = "\n".join([
        f"One DPO optimizer step (policy forward + backward, live reference forward, AdamW) on one pair whose "
        f"chosen and rejected documents are T tokens each, in one padding-free row of 2T tokens; model "
        f"`{args.model_config}`, fp32, loss `{args.loss_type}`, gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}, blocked document attention; cap "
        f"{args.cap / MIB:.0f} MiB of peak RSS above the pre-build baseline, per process (CP: the largest rank).", "",
        *markdown_table(["setup", "longest document T", "row tokens", "bound", "peak MiB at T", "s/step at T",
                         "vs 1 process"], rows, "lrrlrrr"), "",
        f"CP / one process = **{ratio:.2f}x**. {acceptance_line(checks)}", "",
        "Probes (T: peak MiB, seconds):", "",
        *[f"- {r['setup']}: " + ", ".join(
            f"{p['length']}: " + (f"{p['peak_bytes'] / MIB:.0f}, {p['seconds']:.0f}s" if "peak_bytes" in p
                                  else f"failed ({p.get('error', '')[:60]})") for p in r["probes"]) for r in results],
        "", "Commands: " + "; ".join(f"`{c}`" for c in commands) + "."])
    run.write({"cap_bytes": args.cap, "cp": args.cp, "target": args.target, "ratio": ratio, "results": results},
              title="DPO under context parallelism: the longest trainable document", body=body)


if __name__ == "__main__":
    main()
