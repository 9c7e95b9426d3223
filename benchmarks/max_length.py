"""The longest sequence that trains: one document of T tokens, one optimizer step, under a memory cap.

This is how the long-context peers measure themselves (ALST, Unsloth): not memory at a fixed length, but
the length at which a step stops fitting. Every probe is a fresh subprocess that trains one optimizer step
(forward + backward + AdamW) of the ``small`` preset in float32 on CPU, on a single document of T random
tokens, and reports its peak memory:

- twinseq torch and TRL: the step's peak RSS above the RSS just before the model is built (parameters,
  gradients and AdamW moments are inside the peak, framework imports are not);
- twinseq jax: the compiled step's ``memory_analysis()`` (argument + output + temp - alias) plus the optimizer
  state, per device (what XLA will allocate; ``benchmarks/_train_peak.py``);
- torch context parallelism (``torchrun``, 2 gloo ranks): the largest rank's peak;
- jax ring attention on 8 host devices: the per-device figure of the sharded program.

A probe *fits* when it trains and its peak is at most ``--cap``. The search doubles T from ``--start`` until a
probe does not fit, then bisects until the bracket is within ``--resolution``. On a CPU attention's
arithmetic grows as T^2 even when its memory does not, so a probe whose step takes longer than
``--max-probe-seconds`` ends the upward search: the row then says "at least T (compute-bound)" rather
than pretend it found the wall.

Setups, each adding one technique to the previous (what the table's "adds" column credits):

- twinseq torch / jax: ``nll`` loss -> + ``fused_linear`` loss -> + gradient checkpointing -> + tiled MLP
  (blocked document attention is the default attention path on CPU on both backends, so every row has it);
- twinseq torch CP=2 and jax ring CP=8, with everything;
- TRL ``SFTTrainer`` with its best CPU settings: its chunked log-probs (the default ``nll`` of TRL >= 1.0),
  gradient checkpointing and ``padding_free``.

``--sweep`` also measures the peak at fixed lengths (2k .. 32k) with everything on, for the linear-growth
check (R^2 of a straight-line fit), and plots peak memory against T.

``--device cuda`` (``benchmarks/gpu/max_length_gpu.py`` runs it) searches on one GPU instead: bf16 autocast over
fp32 parameters, ``--attn`` attention (default ``varlen``: document-masked SDPA, no [T, T] mask), a last rung
``+ offloading`` (activation offloading), TRL with ``bf16=True`` on the GPU; a probe's peak is
``torch.cuda.max_memory_allocated`` over the step minus the bytes allocated before the model, the cap defaults to
the GPU's memory (an out-of-memory error is "does not fit"), and the setups default to ``torch,trl``.

    .venv/bin/python benchmarks/max_length.py                       # all setups, 8 GiB cap
    .venv/bin/python benchmarks/max_length.py --cap 1GiB --setups torch,trl --max-probe-seconds 600
    python benchmarks/max_length.py --device cuda --model small      # on a GPU: twinseq vs TRL
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import MIB, acceptance_line, add_output_args, markdown_table, pyplot, save_figure, start_run  # noqa: E402
from _train_peak import _MARKER, flags_of, measure  # noqa: E402

MODEL = "small"
STAIRCASE = (("nll", dict(loss_type="nll", gradient_checkpointing=False, tiled_mlp=False)),
             ("+ fused loss", dict(loss_type="fused_linear")),
             ("+ checkpointing", dict(gradient_checkpointing=True)),
             ("+ tiled MLP", dict(tiled_mlp=True)))
EVERYTHING = dict(loss_type="fused_linear", gradient_checkpointing=True, tiled_mlp=True)
CUDA_RUNGS = (("+ offloading", dict(activation_offloading=True)),)  # CUDA only: twinseq refuses it on a CPU
CPU_SETUPS, CUDA_SETUPS = "torch,jax,torch-cp2,jax-ring8,trl", "torch,trl"
SWEEP = (2048, 4096, 8192, 16384, 32768)


def parse_bytes(text: str) -> int:
    """``"8GiB"`` / ``"512MiB"`` / ``"1.5GB"`` / a plain number of bytes -> bytes.

    >>> parse_bytes("8GiB"), parse_bytes("512MiB"), parse_bytes("1000")
    (8589934592, 536870912, 1000)
    """
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 8GiB, 512MiB or a number of bytes")
    number, unit, binary = float(match[1]), match[2].upper(), match[3]
    base = 1024 if binary or not unit else 1000
    return int(number * base ** "_KMGT".index(unit or "_"))


def setups(names: Sequence[str], device: str = "cpu", attn: Optional[str] = None,
           model: str = MODEL) -> list[tuple[str, str, dict[str, Any]]]:
    """(setup, row name, flat config changes) for every row of the named setups, staircases cumulative.

    On ``device="cuda"`` the twinseq rows compute in bf16 with ``attn`` attention and the torch staircase
    gains the CUDA rungs (offloading); ``model`` is the model of every row."""
    rows: list[tuple[str, str, dict[str, Any]]] = []
    on_gpu = dict(dtype="bfloat16", attn_implementation=attn or "varlen") if device == "cuda" else {}
    for name in names:
        if name in ("torch", "jax"):
            acc: dict[str, Any] = dict(model_config=model, **(on_gpu if name == "torch" else {}))
            rungs = STAIRCASE + (CUDA_RUNGS if device == "cuda" and name == "torch" else ())
            for step, change in rungs:
                acc = {**acc, **change}
                rows.append((name, step, dict(backend=name, **acc)))
            continue
        if device == "cuda" and name != "trl":
            raise SystemExit(f"--setups {name!r}: on --device cuda only torch and trl are searched")
        if name == "trl":
            rows.append((name, "TRL SFTTrainer (chunked log-probs, checkpointing, padding-free)",
                         dict(backend="trl", model_config=model, device=device)))
            continue
        if name == "torch-cp2":
            rows.append((name, "CP=2 (gloo), everything", dict(backend="torch", context_parallel_size=2,
                                                                 context_parallel_strategy="allgather", **EVERYTHING)))
        elif name == "jax-ring8":
            rows.append((name, "ring CP=8 (host devices), everything",
                         dict(backend="jax", context_parallel_size=8, context_parallel_strategy="ring", **EVERYTHING)))
        else:
            raise SystemExit(f"--setups: unknown setup {name!r}; choose from torch, jax, torch-cp2, jax-ring8, trl")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# probes: one subprocess, one optimizer step, one document of T tokens
# ---------------------------------------------------------------------------------------------------------------

def document_file(folder: Path, length: int) -> Path:
    """A pre-tokenised JSONL with one document of ``length`` random tokens (ids 3.. of the 8192 vocabulary)."""
    import numpy as np

    path = folder / f"document_{length}.jsonl"
    if not path.exists():
        ids = np.random.default_rng(length).integers(3, 8192, length).tolist()
        path.write_text(json.dumps({"input_ids": ids}) + "\n")
    return path


def _env(threads: int, extra: Optional[dict] = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed big blocks leave RSS at once
    env["TWINSEQ_MEASURE_THREADS"] = str(threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(extra or {})
    return env


def _twinseq_values(change: dict[str, Any], doc: Path, length: int) -> dict[str, Any]:
    values = dict(model_config=MODEL, dataset_name=str(doc), max_length=length, per_device_train_batch_size=1,
                  padding_free=True, learning_rate=1e-4, lr_scheduler_type="constant")
    return {**values, **change}


def probe_twinseq(change: dict[str, Any], doc: Path, length: int, timeout: float, threads: int) -> dict[str, Any]:
    values = _twinseq_values(change, doc, length)
    if change.get("backend") == "jax" and change.get("context_parallel_size", 1) > 1:
        extra = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={change['context_parallel_size']}"}
        got = measure(values, max_steps=1, timeout=timeout, threads=threads, extra_env=extra)
    elif change.get("backend") == "torch" and change.get("context_parallel_size", 1) > 1:
        got = _measure_torchrun(values, change["context_parallel_size"], timeout, threads)
    else:
        got = measure(values, max_steps=1, timeout=timeout, threads=threads)
    return {"peak_bytes": got["peak_bytes"], "seconds": max(got["step_seconds"]), "command": got["command"]}


def _measure_torchrun(values: dict[str, Any], nproc: int, timeout: float, threads: int) -> dict[str, Any]:
    """``_train_peak``'s torch child under ``torchrun`` (gloo): every rank prints its record; the largest wins."""
    with tempfile.TemporaryDirectory(prefix="twinseq-maxlen-") as tmp:
        values = dict(values, output_dir=str(Path(tmp) / "run"), max_steps=1, disable_tqdm=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(HERE / "_train_peak.py"), "--child", "torch", json.dumps(flags_of(values))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=_env(max(1, threads // nproc)))
    records = [json.loads(ln[len(_MARKER):]) for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)]
    if proc.returncode != 0 or len(records) != nproc:
        raise RuntimeError(f"torchrun probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    worst = max(records, key=lambda r: r["peak_bytes"])
    return {**worst, "per_rank_peak_bytes": [r["peak_bytes"] for r in records],
            "command": f"torchrun --nproc-per-node {nproc} twinseq train " + " ".join(flags_of(values))}


def probe_trl(doc: Path, length: int, timeout: float, threads: int, device: str = "cpu",
              model: str = MODEL) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-trl", str(doc), str(length), device, model]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(threads))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(_MARKER):])


def _child_trl(doc: str, length: int, device: str = "cpu", model_name: str = MODEL) -> None:
    """One step of TRL's SFTTrainer on the same model and document: on CPU the peak RSS of the step above the
    pre-model RSS, on CUDA ``max_memory_allocated`` over the step above the bytes allocated before the model."""
    import gc

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from twinseq.common.models.configs import resolve_model_config
    from twinseq.common.data.tokenizer import embedded_tokenizer_dir
    from twinseq.torch_backend import build_model

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))

    torch.set_num_threads(int(os.environ.get("TWINSEQ_MEASURE_THREADS", "2")))
    ids = json.loads(Path(doc).read_text())["input_ids"]
    assert len(ids) == length, (len(ids), length)
    dataset = Dataset.from_dict({"input_ids": [ids]})
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    cuda = device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    model = build_model(resolve_model_config(model_name)).to(device)
    rec: dict[str, Any] = {}

    class Peak(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            rec["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            rec["seconds"] = time.perf_counter() - rec["t0"]
            rec["peak_bytes"] = (torch.cuda.max_memory_allocated() if cuda else status("VmHWM")) - baseline

    args = SFTConfig(output_dir=tempfile.mkdtemp(prefix="twinseq-trl-"), max_steps=1, per_device_train_batch_size=1,
                     max_length=None, gradient_checkpointing=True, padding_free=True, use_cpu=not cuda, bf16=cuda,
                     report_to=[], save_strategy="no", learning_rate=1e-4, lr_scheduler_type="constant",
                     disable_tqdm=True)
    SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[Peak()]).train()
    rec["command"] = (f"trl SFTTrainer(model={model_name}, SFTConfig(max_length=None, gradient_checkpointing=True, "
                      f"padding_free=True, per_device_train_batch_size=1, "
                      + ("bf16=True, on CUDA))" if cuda else "use_cpu=True))"))
    print(_MARKER + json.dumps(rec), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------------------------------

def search(probe: Callable[[int], dict[str, Any]], cap: int, *, start: int, limit: int, resolution: float,
           max_seconds: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The longest T (a multiple of 64) whose probe fits under ``cap``: doubling (or halving, when ``start``
    does not fit), then bisection.

    Returns ``{"max_length", "bound", "probes"}``: ``bound`` is ``"memory"`` (the next probe exceeded the cap
    or failed), ``"compute"`` (a probe took longer than ``max_seconds``; the wall was not reached) or
    ``"limit"`` (``limit``, rounded down to a multiple of 64, fitted: the doubling's last probe is the limit
    itself when doubling would pass it).
    """
    probes: list[dict[str, Any]] = []

    def fits(length: int) -> tuple[bool, Optional[dict]]:
        try:
            got = probe(length)
        except Exception as err:  # noqa: BLE001 - an out-of-memory kill or allocation failure is "does not fit"
            probes.append({"length": length, "error": str(err).strip().splitlines()[-1][:200]})
            log(f"    T={length:>7}: failed ({probes[-1]['error'][:80]})")
            return False, None
        probes.append({"length": length, **got})
        ok = got["peak_bytes"] <= cap
        log(f"    T={length:>7}: peak {got['peak_bytes'] / MIB:9.1f} MiB, {got['seconds']:7.1f} s "
            f"-> {'fits' if ok else 'over the cap'}")
        return ok, got

    lo, hi, bound = 0, None, "limit"
    length = start
    first = fits(length)
    while length >= 128 and not first[0]:  # the start is over the cap already: halve down to a fit
        hi, bound, length = length, "memory", length // 2
        first = fits(length) if length >= 128 else (False, None)
    if hi is not None:
        lo = length if length >= 128 else 0
        length = limit + 1  # skip the doubling: bisect between the fit and the first failure
    while length <= limit:
        ok, got = first if first is not None else fits(length)
        first = None
        if not ok:
            hi, bound = length, "memory"
            break
        lo = length
        if got["seconds"] > max_seconds:
            bound = "compute"
            break
        following = min(length * 2, limit // 64 * 64)  # the limit itself is probed when doubling passes it
        if following <= length:
            break
        length = following
    if bound == "memory" and lo:
        while hi / lo > 1 + resolution and hi - lo > 64:
            mid = (lo + hi) // 2 // 64 * 64
            ok, got = fits(mid)
            if ok:
                lo = mid
                if got["seconds"] > max_seconds:
                    break
            else:
                hi = mid
    return {"max_length": lo, "bound": bound, "probes": probes}


def r_squared(xs: Sequence[float], ys: Sequence[float]) -> float:
    """R^2 of the least-squares line through (xs, ys).

    >>> round(r_squared([1, 2, 3, 4], [2, 4, 6, 8]), 6)
    1.0
    """
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = y - y.mean()
    return float(1.0 - (residual @ residual) / (total @ total))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap", type=parse_bytes, default=None,
                        help="memory a step may use (e.g. 8GiB, 768MiB; default 8GiB on CPU, the GPU's memory on CUDA)")
    parser.add_argument("--setups", default=None, help=f"default {CPU_SETUPS} (CPU), {CUDA_SETUPS} (CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default=MODEL, help="the model of every row: a preset or a config.json folder")
    parser.add_argument("--attn", default=None, help="twinseq's attn_implementation on CUDA (default varlen)")
    parser.add_argument("--staircase", choices=("full", "last"), default="full",
                        help="twinseq rows: every rung, or only those with everything on (fewer probes)")
    parser.add_argument("--start", type=int, default=1024, help="first probe length")
    parser.add_argument("--limit", type=int, default=1 << 20, help="longest length probed")
    parser.add_argument("--resolution", type=float, default=0.1, help="stop bisecting at hi/lo <= 1 + this")
    parser.add_argument("--max-probe-seconds", type=float, default=900.0,
                        help="a step slower than this ends the upward search (compute-bound)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a probe is killed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sweep", default=None,
                        help="lengths of the linear-growth sweep (empty: none; default 2k..32k on CPU, none on CUDA)")
    parser.add_argument("--sweep-backends", default="torch,jax")
    add_output_args(parser)
    return parser.parse_args(argv)


def resolve(args: argparse.Namespace) -> str:
    """Fills the device-dependent defaults (cap, setups, sweep) and returns the device."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA GPU here")
        args.cap = args.cap or int(torch.cuda.get_device_properties(0).total_memory)
        args.setups = args.setups or CUDA_SETUPS
        args.sweep = "" if args.sweep is None else args.sweep
    else:
        args.cap = args.cap or parse_bytes("8GiB")
        args.setups = args.setups or CPU_SETUPS
        args.sweep = ",".join(map(str, SWEEP)) if args.sweep is None else args.sweep
    return args.device


def main(argv: Optional[Sequence[str]] = None) -> None:
    from tqdm import tqdm

    run = start_run(parse_args, argv, __file__, device=resolve)
    args = run.args
    tmp = Path(tempfile.mkdtemp(prefix="twinseq-maxlen-"))
    rows = setups([s for s in args.setups.split(",") if s], args.device, args.attn, args.model)
    if args.staircase == "last":
        rows = [r for r in rows if r[0] not in ("torch", "jax") or all(r[2].get(k) == v for k, v in EVERYTHING.items())]
    results: list[dict[str, Any]] = []
    for setup, name, change in tqdm(rows, desc="max length", unit="setup"):
        tqdm.write(f"{setup}: {name}")
        if setup == "trl":
            def probe(length, _c=change):
                return probe_trl(document_file(tmp, length), length, args.timeout, args.threads, args.device,
                                 args.model)
        else:
            def probe(length, _c=change):
                return probe_twinseq(_c, document_file(tmp, length), length, args.timeout, args.threads)
        found = search(probe, args.cap, start=args.start, limit=args.limit, resolution=args.resolution,
                       max_seconds=args.max_probe_seconds, log=tqdm.write)
        results.append({"setup": setup, "row": name, "config": change, **found})
        tqdm.write(f"  -> {found['max_length']:,} tokens ({found['bound']}-bound)")
        if len(results) < len(rows):  # written after every row: a run cut at its time limit keeps what it found
            write_results(run, results, [], partial=f"{len(results)} of {len(rows)} rows searched")

    sweep: list[dict[str, Any]] = []
    lengths = [int(x) for x in args.sweep.split(",") if x]
    for backend in [b for b in args.sweep_backends.split(",") if b and lengths]:
        for length in tqdm(lengths, desc=f"sweep {backend}", unit="length"):
            change = next(c for s, _, c in setups([backend], args.device, args.attn, args.model)
                          if s == backend and all(c.get(k) == v for k, v in EVERYTHING.items()))
            try:
                got = probe_twinseq(change, document_file(tmp, length), length, args.timeout, args.threads)
                sweep.append({"backend": backend, "length": length, **got})
                tqdm.write(f"  sweep {backend} T={length}: {got['peak_bytes'] / MIB:.1f} MiB, {got['seconds']:.1f} s")
            except Exception as err:  # noqa: BLE001 - reported in the table
                sweep.append({"backend": backend, "length": length, "error": str(err).strip().splitlines()[-1][:200]})
    write_results(run, results, sweep)


def write_results(run: Any, results: list[dict[str, Any]], sweep: list[dict[str, Any]], partial: str = "") -> None:
    """The table, the acceptance checks, the plot and the files of the rows searched so far."""
    args = run.args
    fits = {b: [(s["length"], s["peak_bytes"]) for s in sweep if s["backend"] == b and "peak_bytes" in s]
            for b in {s["backend"] for s in sweep}}
    r2 = {b: r_squared(*zip(*pts)) for b, pts in fits.items() if len(pts) >= 3}

    trl = next((r["max_length"] for r in results if r["setup"] == "trl"), 0)
    table = []
    for r in results:
        prev = next((p for p in reversed(results[:results.index(r)]) if p["setup"] == r["setup"]), None)
        adds = f"x{r['max_length'] / prev['max_length']:.2f}" if prev and prev["max_length"] else ""
        vs_trl = f"{r['max_length'] / trl:.1f}x" if trl and r["setup"] != "trl" else ""
        last = next((p for p in reversed(r["probes"]) if p["length"] == r["max_length"] and "peak_bytes" in p), None)
        table.append([r["setup"], r["row"], f"{'>= ' if r['bound'] != 'memory' else ''}{r['max_length']:,}",
                      r["bound"], adds, vs_trl, f"{last['peak_bytes'] / MIB:,.0f}" if last else "",
                      f"{last['seconds']:,.0f}" if last else ""])
    best = {s: max((r["max_length"] for r in results if r["setup"] == s), default=0) for s in ("torch", "jax")}
    checks = {f"{b} >= 4x TRL": best[b] >= 4 * trl for b in best if best[b] and trl}
    checks.update({f"{b} linear (R^2 >= 0.99)": v >= 0.99 for b, v in r2.items()})
    where = (f"bf16 autocast on one GPU (twinseq attention `{args.attn or 'varlen'}`), cap **{args.cap / MIB:,.0f} MiB** "
             "(torch, TRL: torch.cuda.max_memory_allocated over the step above the bytes allocated before the model; "
             "an out-of-memory error does not fit)" if args.device == "cuda" else
             f"float32 on CPU ({args.threads} threads), cap **{args.cap / MIB:,.0f} MiB** per process (torch, TRL: "
             "peak RSS of the step above the RSS before the model; jax: compiled memory_analysis + optimizer state, "
             "per device; CP rows: the largest rank)")
    body = [f"One document of T random tokens, one optimizer step (forward + backward + AdamW) of `{args.model}` in "
            f"{where}. Search: doubling from "
            f"{args.start}, then bisection to {args.resolution:.0%}; a probe slower than {args.max_probe_seconds:.0f} s "
            "stops the upward search (`compute`-bound: the memory wall lies further). `adds`: the length gained "
            "over the row above.", "",
            *([f"**Partial run: {partial}.** The rows below are complete; the run ended before the rest.", ""]
              if partial else []),
            *markdown_table(["setup", "row (cumulative)", "longest T", "bound", "adds", "vs TRL", "peak MiB at T",
                             "step s at T"], table, "llrlrrrr"), ""]
    if sweep:
        body += ["Linear growth, everything on (fused loss, checkpointing, tiled MLP, blocked attention):", "",
                 *markdown_table(["backend", "T", "peak MiB", "step s"],
                                 [[s["backend"], f"{s['length']:,}",
                                   f"{s['peak_bytes'] / MIB:,.1f}" if "peak_bytes" in s else s.get("error", ""),
                                   f"{s['seconds']:,.1f}" if "seconds" in s else ""] for s in sweep], "lrrr"),
                 "", "R^2 of a straight line: " + ", ".join(f"{b} {v:.4f}" for b, v in sorted(r2.items())), ""]
    body.append(acceptance_line(checks))

    def plot(png: Path) -> None:
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        ax = axes[0]
        for backend, pts in sorted(fits.items()):
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, [y / MIB for y in ys], "o-", label=f"twinseq {backend} (R^2 {r2.get(backend, float('nan')):.4f})")
        for r in results:
            for p in r["probes"]:
                if "peak_bytes" in p and r["setup"] == "trl":
                    ax.plot(p["length"], p["peak_bytes"] / MIB, "kx")
        ax.axhline(args.cap / MIB, color="red", ls="--", lw=1, label="cap")
        ax.set_xlabel("sequence length T (tokens)")
        ax.set_ylabel("peak memory of one step (MiB)")
        ax.set_title("peak memory against T (x: TRL probes)")
        ax.legend(fontsize=8)
        ax = axes[1]
        names = [f"{r['setup']}: {r['row'].split(' (')[0]}" for r in results]
        ax.barh(names[::-1], [r["max_length"] for r in results][::-1],
                color=["0.5" if r["setup"] == "trl" else "tab:blue" for r in results][::-1])
        ax.set_xlabel(f"longest T that trains under {args.cap / MIB:,.0f} MiB")
        ax.tick_params(axis="y", labelsize=7)
        save_figure(fig, png)

    run.write({"cap_bytes": args.cap, "model": args.model, "device": args.device, "results": results, "sweep": sweep, "r_squared": r2,
               "acceptance": checks, **({"partial": partial} if partial else {})},
              title="Longest trainable sequence", body="\n".join(body), plot=plot)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-trl":
        _child_trl(sys.argv[2], int(sys.argv[3]), *sys.argv[4:6])
    else:
        main()
