"""LM-head loss kernels side by side on one GPU: forward and backward, peak memory, time, and a check of each
kernel's loss and gradients against twinseq's ``nll``.

One process, the same inputs for every kernel: the last hidden state ``[1, T, H]``, the lm_head weight
``[V, H]`` and labels ``[1, T]`` (a fraction set to -100, the first one too, as the collator writes a document
start). The loss is the mean next-token cross-entropy over the valid targets. Kernels:

- twinseq ``causal_lm_loss`` with every ``loss_type`` of ``common.config.LOSS_TYPES``: ``nll`` (the full
  ``[T, V]`` logits, upcast to fp32; the baseline), ``chunked_nll``, ``fused_linear``, ``liger`` and, when this
  commit has it, ``triton``;
- TRL's chunked NLL: ``trl.kernels.ChunkedLogProbFunction``, what ``SFTTrainer`` runs for ``loss_type="nll"``
  (``"chunked_nll"`` is its deprecated alias), on the valid positions only, as TRL does on a GPU;
- Liger's ``LigerFusedLinearCrossEntropyLoss``, called directly;
- Cut Cross-Entropy's ``cut_cross_entropy.linear_cross_entropy``, with its default gradient filter
  (``filter_eps="high"``) and with the filter off (exact gradients).

A kernel that cannot run here (no CUDA, a package missing, an API this script does not know) is a row with the
reason, printed and written to the results. Per kernel: ``--warmup`` untimed calls (Triton autotuning happens
there), then ``--repeats`` timed calls; time from CUDA events around the forward and the backward (median),
peak memory ``torch.cuda.max_memory_allocated`` minus the bytes allocated before the call (the inputs), reset
before each call. The gradients of the last call are compared with ``nll``'s: max |a - b| of the loss, of the
hidden-state gradient and of the weight gradient, and ``||a - b|| / ||b||`` per gradient, held to the parity
tolerance table's bound for the dtype (``parity_tests/tolerances.py``): a fast but wrong kernel is flagged.

    python benchmarks/gpu/loss_kernels.py --out DIR                 # 16384 x 2048 x {128256, 248320}, bf16
    python benchmarks/gpu/loss_kernels.py --smoke --no-write        # tiny shapes, CPU or GPU, seconds

On CPU (``--smoke``, or ``--device cpu``) time is wall-clock and memory is not measured.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import inspect
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402

from parity_tests.tolerances import UNIT_ROUNDOFF, bf16_ulp, tol  # noqa: E402

IGNORE_INDEX = -100
BASELINE = "twinseq nll"
SMOKE = dict(tokens=96, hidden=32, vocabs="160,250", warmup=1, repeats=2)
PACKAGES = ("torch", "triton", "liger-kernel", "cut-cross-entropy", "trl", "transformers")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


class Skip(Exception):
    """A kernel that cannot run here; the message is the reason written to the results."""


# --- the kernels: each ``make(inputs) -> loss_fn(hidden_BTH, weight_VH) -> 0-dim loss`` or raises Skip ---------

def _twinseq(loss_type: str) -> Callable[[dict], Callable]:
    def make(inp: dict) -> Callable:
        from twinseq.common.config import LOSS_TYPES
        from twinseq.torch_backend.losses import causal_lm_loss

        if loss_type not in LOSS_TYPES:
            raise Skip(f"loss_type {loss_type!r} is not in common.config.LOSS_TYPES on this commit {LOSS_TYPES}")
        if loss_type == "liger":
            _need_cuda(inp, "twinseq liger calls Liger's Triton kernels")
            _need_module("liger_kernel", "liger-kernel")
        if loss_type == "triton":  # measure the kernel itself, never its fused_linear fallback under its name
            from twinseq.torch_backend import triton_ce

            reason = triton_ce.fallback_reason(inp["hidden"])
            if reason is not None:
                raise Skip(f"loss_type='triton' would run its fused_linear fallback here: {reason}")
            if inp["device"] != "cuda":
                inp["notes"]["twinseq triton"] = ("the kernel under Triton's CPU interpreter (TRITON_INTERPRET=1): "
                                                  "a correctness check, not a timing")
        labels, num_items = inp["labels_BT"], inp["num_valid"]
        return lambda h, w: causal_lm_loss(h, w, labels, num_items, loss_type)
    return make


def _twinseq_triton_filtered(accumulate: str) -> Callable[[dict], Callable]:
    """The triton kernel with cut cross-entropy's gradient filter (``filter_eps="auto"``: dtype eps / 32), the
    setting CCE's default row runs, with float32 gradient buffers or (``accumulate="input"``) gradients accumulated
    in the inputs' dtype as CCE accumulates them; twinseq's ``loss_type='triton'`` itself computes exact gradients
    in float32 buffers. All rows go in; the kernel skips those whose target is -100."""
    def make(inp: dict) -> Callable:
        _twinseq("triton")(inp)  # the same skips as the exact row
        from twinseq.torch_backend import triton_ce

        targets, num_valid = inp["targets_N"], inp["num_valid"]

        def loss_fn(h, w):
            logp = triton_ce.linear_logps(h.reshape(-1, h.shape[-1]), w, targets, filter_eps="auto",
                                          accumulate=accumulate)[0]
            return -logp.sum() / num_valid
        return loss_fn
    return make


def _trl_chunked(inp: dict) -> Callable:
    _need_module("trl", "trl")
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError as err:
        raise Skip(f"trl {_version('trl')} has no trl.kernels.ChunkedLogProbFunction ({err}); TRL's chunked "
                   "NLL is not importable as a function in this version") from err
    expected = ["ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size"]
    params = list(inspect.signature(ChunkedLogProbFunction.forward).parameters)
    if params[:len(expected)] != expected:
        raise Skip(f"trl {_version('trl')}: ChunkedLogProbFunction.forward{tuple(params)} is not the signature "
                   f"this script calls ({', '.join(expected)}, ...)")
    try:  # the vocabulary tile SFTTrainer uses
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    except ImportError:
        chunk = 32768
    inp["notes"]["trl chunked_nll"] = f"vocabulary tile {chunk} (SFTTrainer's), valid positions only"
    mask, targets, num_valid = inp["mask_N"], inp["targets_N"], inp["num_valid"]
    extra = ([None, 1.0, ("log_probs",)] if len(params) >= len(expected) + 3 else [])

    def loss_fn(h, w):
        h_nH = h.reshape(-1, h.shape[-1])[mask]
        out = ChunkedLogProbFunction.apply(h_nH, w, None, targets[mask], 1.0, chunk, *extra)
        logprobs = out[0] if isinstance(out, tuple) else out
        return -logprobs.float().sum() / num_valid
    return loss_fn


def _liger_flce(inp: dict) -> Callable:
    _need_cuda(inp, "Liger's kernels are Triton")
    _need_module("liger_kernel", "liger-kernel")
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    targets, num_valid = inp["targets_N"], inp["num_valid"]

    def loss_fn(h, w):
        out = fn(w, h.reshape(-1, h.shape[-1]), targets)
        out = getattr(out, "loss", out)
        return (out[0] if isinstance(out, tuple) else out) / num_valid
    return loss_fn


def _cce(filter_eps: Any) -> Callable[[dict], Callable]:
    def make(inp: dict) -> Callable:
        _need_cuda(inp, "Cut Cross-Entropy's kernels are Triton")
        _need_module("cut_cross_entropy", "cut-cross-entropy")
        from cut_cross_entropy import linear_cross_entropy

        targets, num_valid = inp["targets_N"], inp["num_valid"]

        def loss_fn(h, w):
            return linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, targets, ignore_index=IGNORE_INDEX,
                                        reduction="sum", filter_eps=filter_eps) / num_valid
        return loss_fn
    return make


KERNELS: dict[str, Callable[[dict], Callable]] = {
    BASELINE: _twinseq("nll"),
    "twinseq chunked_nll": _twinseq("chunked_nll"),
    "twinseq fused_linear": _twinseq("fused_linear"),
    "twinseq liger": _twinseq("liger"),
    "twinseq triton": _twinseq("triton"),
    "twinseq triton (filter_eps=auto)": _twinseq_triton_filtered("float32"),
    "twinseq triton (filter_eps=auto; accumulate=input)": _twinseq_triton_filtered("input"),
    "trl chunked_nll": _trl_chunked,
    "liger LigerFusedLinearCrossEntropyLoss": _liger_flce,
    "cce linear_cross_entropy": _cce("high"),
    "cce linear_cross_entropy (filter_eps=None)": _cce(None),
}
CCE = "cce linear_cross_entropy"
# An error with one of these in its message leaves the CUDA context unusable: the kernels after it cannot run.
CONTEXT_LOST = ("illegal memory access", "device-side assert", "unspecified launch failure", "CUDA error")


def _need_cuda(inp: dict, why: str) -> None:
    if inp["device"] != "cuda":
        raise Skip(f"needs CUDA ({why}); this run is on {inp['device']}")


def _need_module(module: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise Skip(f"{package} is not installed")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# --- measuring ---------------------------------------------------------------------------------------------

def make_inputs(tokens: int, hidden: int, vocab: int, dtype: str, device: str, ignore_fraction: float,
                seed: int = 0) -> dict:
    """The inputs every kernel gets: drawn on the CPU from one seed, then moved (the same values on any device)."""
    import torch

    from twinseq.torch_backend.losses import shift_labels

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    hidden_BTH = (torch.randn(1, tokens, hidden, generator=gen) * 0.5).to(device, dt).requires_grad_()
    weight_VH = (torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5).to(device, dt).requires_grad_()
    labels_BT = torch.randint(0, vocab, (1, tokens), generator=gen)
    labels_BT[torch.rand(1, tokens, generator=gen) < ignore_fraction] = IGNORE_INDEX
    labels_BT[:, 0] = IGNORE_INDEX
    labels_BT = labels_BT.to(device)
    targets_N = shift_labels(labels_BT).reshape(-1).long()
    mask_N = targets_N != IGNORE_INDEX
    return {"hidden": hidden_BTH, "weight": weight_VH, "labels_BT": labels_BT, "targets_N": targets_N,
            "mask_N": mask_N, "num_valid": int(mask_N.sum()), "device": device, "dtype": dtype, "notes": {},
            "input_bytes": sum(t.numel() * t.element_size() for t in (hidden_BTH, weight_VH, labels_BT, targets_N,
                                                                       mask_N))}


def _one_call(loss_fn: Callable, inp: dict) -> dict:
    """Forward + backward once from cleared gradients: seconds of each, the peak above the bytes allocated before."""
    import torch

    h, w = inp["hidden"], inp["weight"]
    h.grad = w.grad = None
    if inp["device"] != "cuda":
        t0 = time.perf_counter()
        loss = loss_fn(h, w)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        return {"loss": float(loss.detach()), "forward_s": t1 - t0, "backward_s": t2 - t1, "peak_bytes": None}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    events[0].record()
    loss = loss_fn(h, w)
    events[1].record()
    loss.backward()
    events[2].record()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return {"loss": float(loss.detach()), "forward_s": events[0].elapsed_time(events[1]) / 1e3,
            "backward_s": events[1].elapsed_time(events[2]) / 1e3, "peak_bytes": int(peak)}


def _difference(a, b, rows: int = 8192) -> tuple[float, float]:
    """(max |a - b|, ||a - b|| / ||b||) in fp32, a block of rows at a time (no second full-size copy)."""
    import torch

    worst, diff_sq, ref_sq = 0.0, 0.0, 0.0
    a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    for i in range(0, a2.shape[0], rows):
        x, y = a2[i:i + rows].float(), b2[i:i + rows].to(a.device).float()
        d = x - y
        worst = max(worst, float(d.abs().max()))
        diff_sq += float(torch.linalg.vector_norm(d, dtype=torch.float64) ** 2)
        ref_sq += float(torch.linalg.vector_norm(y, dtype=torch.float64) ** 2)
    return worst, math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq else math.inf


def bounds(dtype: str, loss: float) -> dict[str, float]:
    """What a kernel may differ from ``nll`` by (the parity tolerance table): per gradient ``||a - b|| / ||b||``,
    and the loss by ``token_loss_ulps`` bf16 ulps at the loss (bf16) or ``loss_rel`` (fp32)."""
    if dtype == "bfloat16":
        return {"grad_rel": tol("bfloat16", "grad_rel"),
                "loss_abs": tol("bfloat16", "token_loss_ulps") * bf16_ulp(loss)}
    return {"grad_rel": tol("float32", "grad_rel"), "loss_abs": tol("float32", "loss_rel") * abs(loss)}


def measure_kernel(name: str, make: Callable, inp: dict, reference: Optional[dict], warmup: int,
                   repeats: int, keep_as_reference: bool = False) -> dict:
    """One row: ``status`` ok / skipped / failed, figures, and the comparison with ``reference`` (nll's; None:
    no check). ``keep_as_reference``: the row keeps its loss and gradients (on the CPU) under ``"reference"``."""
    import torch

    row: dict[str, Any] = {"kernel": name}
    try:
        loss_fn = make(inp)
        for _ in range(warmup):
            _one_call(loss_fn, inp)
        calls = [_one_call(loss_fn, inp) for _ in range(repeats)]
    except Skip as why:
        row.update(status="skipped", reason=str(why))
        print(f"{name:>44}: skipped: {why}", flush=True)
        return row
    except Exception as err:  # noqa: BLE001 - an out-of-memory error or a kernel's failure is a row, not the end
        row.update(status="failed", reason=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
                   if str(err).strip() else type(err).__name__)
        print(f"{name:>44}: FAILED: {row['reason']}", flush=True)
        traceback.print_exc(limit=3)
        return row
    finally:
        if inp["device"] == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a lost context fails here too; the row already says why
                pass
    total = [c["forward_s"] + c["backward_s"] for c in calls]
    peaks = [c["peak_bytes"] for c in calls if c["peak_bytes"] is not None]
    row.update(status="ok", loss=calls[-1]["loss"], forward_seconds=statistics.median(c["forward_s"] for c in calls),
               backward_seconds=statistics.median(c["backward_s"] for c in calls),
               median_seconds=statistics.median(total), seconds=total, peak_bytes=max(peaks) if peaks else None)
    if name in inp["notes"]:
        row["note"] = inp["notes"][name]
    h, w = inp["hidden"], inp["weight"]
    if keep_as_reference:
        row["reference"] = {"loss": row["loss"], "grad_hidden": h.grad.detach().cpu(),
                            "grad_weight": w.grad.detach().cpu()}
    elif reference is not None:
        lim = bounds(inp["dtype"], reference["loss"])
        gh, gh_rel = _difference(h.grad, reference["grad_hidden"])
        gw, gw_rel = _difference(w.grad, reference["grad_weight"])
        row["check"] = {"loss_abs_diff": abs(row["loss"] - reference["loss"]), "grad_hidden_max_abs_diff": gh,
                        "grad_weight_max_abs_diff": gw, "grad_hidden_rel": gh_rel, "grad_weight_rel": gw_rel,
                        "bounds": lim}
        row["check"]["agrees"] = bool(row["check"]["loss_abs_diff"] <= lim["loss_abs"]
                                      and max(gh_rel, gw_rel) <= lim["grad_rel"])
    h.grad = w.grad = None
    mem = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / MIB:,.0f} MiB"
    agrees = "" if "check" not in row else ("  agrees" if row["check"]["agrees"] else "  DISAGREES with nll")
    print(f"{name:>44}: peak {mem:>12}  fwd {row['forward_seconds'] * 1e3:8.2f} ms  bwd "
          f"{row['backward_seconds'] * 1e3:8.2f} ms  loss {row['loss']:.6f}{agrees}", flush=True)
    return row


def context_lost(row: dict) -> bool:
    """Did this failed row leave the CUDA context unusable (an asynchronous kernel fault)?"""
    return row["status"] == "failed" and any(s in row.get("reason", "") for s in CONTEXT_LOST)


def run_vocab(args: argparse.Namespace, vocab: int, names: Sequence[str], lost: Optional[str] = None) -> dict:
    """One table. ``lost``: the kernel whose failure already lost the CUDA context (nothing runs then)."""
    import torch

    if lost is not None:
        return {"vocab": vocab, "input_bytes": None, "num_valid": None, "context_lost_by": lost,
                "results": [_not_run(name, lost) for name in names]}
    inp = make_inputs(args.tokens, args.hidden, vocab, args.dtype, args.device, args.ignore_fraction, args.seed)
    print(f"--- {args.tokens} tokens x hidden {args.hidden} x vocab {vocab}, {args.dtype} on {args.device} "
          f"({inp['num_valid']} valid targets)", flush=True)
    rows, reference = [], None
    for name in names:
        if lost is not None:
            rows.append(_not_run(name, lost))
            continue
        row = measure_kernel(name, KERNELS[name], inp, reference, args.warmup, args.repeats,
                             keep_as_reference=name == BASELINE)
        if context_lost(row):
            lost = name
        if name == BASELINE:  # without it (out of memory, say) the others run unchecked, and the table says so
            reference = row.pop("reference", None)
        rows.append(row)
        gc.collect()
        if args.device == "cuda" and lost is None:
            torch.cuda.empty_cache()
    _add_ratios(rows)
    out = {"vocab": vocab, "input_bytes": inp["input_bytes"], "num_valid": inp["num_valid"], "results": rows,
           "context_lost_by": lost}
    del inp, reference
    gc.collect()
    if args.device == "cuda" and lost is None:
        torch.cuda.empty_cache()
    return out


def _not_run(name: str, lost: str) -> dict:
    return {"kernel": name, "status": "not run",
            "reason": f"the CUDA context was lost when {lost!r} failed; measure it alone with --kernels"}


def _add_ratios(rows: list[dict]) -> None:
    ok = {r["kernel"]: r for r in rows if r["status"] == "ok"}
    for key, ref in (("nll", ok.get(BASELINE)), ("cce", ok.get(CCE))):
        if ref is None:
            continue
        for r in ok.values():
            r[f"time_ratio_vs_{key}"] = r["median_seconds"] / ref["median_seconds"]
            if r["peak_bytes"] is not None and ref["peak_bytes"]:
                r[f"memory_ratio_vs_{key}"] = r["peak_bytes"] / ref["peak_bytes"]


def acceptance(shapes: list[dict]) -> tuple[dict[str, bool], list[str]]:
    """Issue 16's bar per vocabulary: a twinseq loss that agrees with ``nll`` at or below Cut Cross-Entropy's
    peak memory and within 1.1x its time (forward + backward). Checked where CCE ran with memory measured."""
    checks, notes = {}, []
    for shape in shapes:
        ok = {r["kernel"]: r for r in shape["results"] if r["status"] == "ok"}
        cce = ok.get(CCE)
        if cce is None or cce.get("peak_bytes") is None:
            continue
        ours = [r for name, r in ok.items() if name.startswith("twinseq ") and name != BASELINE
                and r.get("check", {}).get("agrees")]
        passing = [r for r in ours if r["memory_ratio_vs_cce"] <= 1.0 and r["time_ratio_vs_cce"] <= 1.1]
        name = f"V {shape['vocab']:,}: twinseq <= CCE memory, <= 1.1x CCE time"
        checks[name] = bool(passing)
        for r in sorted(ours, key=lambda r: r["median_seconds"]):
            notes.append(f"V {shape['vocab']:,}: `{r['kernel']}` {r['memory_ratio_vs_cce']:.2f}x CCE's memory, "
                         f"{r['time_ratio_vs_cce']:.2f}x its time" + (" (passes)" if r in passing else ""))
    return checks, notes


# --- writing ------------------------------------------------------------------------------------------------

def _cell(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(meta: dict, shapes: list[dict]) -> str:
    lines = [f"Forward + backward of the LM-head loss, {meta['tokens']} tokens x hidden {meta['hidden']}, "
             f"{meta['dtype']} on {meta['device']}, {meta['warmup']} warmup + median of {meta['repeats']} calls. "
             f"Memory: {meta['memory_method']}. `check`: loss and gradients against `{BASELINE}` within the parity "
             "tolerance table's bound for the dtype (per gradient ||a - b|| / ||b||).", ""]
    for shape in shapes:
        lines += [f"### vocab {shape['vocab']:,}" + (f" ({shape['num_valid']:,} valid targets; inputs "
                                                    f"{shape['input_bytes'] / MIB:,.0f} MiB)" if shape["num_valid"]
                                                    else ""), ""]
        table = []
        for r in shape["results"]:
            if r["status"] != "ok":
                table.append([r["kernel"], r["status"], *["-"] * 10, r["reason"].replace("|", "\\|")])
                continue
            c = r.get("check", {})
            table.append([r["kernel"], "ok", "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / MIB:,.0f}",
                          _cell(r.get("memory_ratio_vs_nll"), ".3f"), _cell(r.get("memory_ratio_vs_cce"), ".2f"),
                          f"{r['forward_seconds'] * 1e3:,.2f}", f"{r['backward_seconds'] * 1e3:,.2f}",
                          _cell(r.get("time_ratio_vs_nll"), ".2f"), _cell(r.get("time_ratio_vs_cce"), ".2f"),
                          f"{r['loss']:.5f}", _cell(c.get("loss_abs_diff"), ".2e"),
                          _cell(c.get("grad_hidden_max_abs_diff"), ".2e") + " / "
                          + _cell(c.get("grad_weight_max_abs_diff"), ".2e"),
                          ("baseline" if r["kernel"] == BASELINE else f"unchecked: `{BASELINE}` did not run") if not c
                          else ("agrees" if c["agrees"] else
                                                    f"**DISAGREES** (grad rel {max(c['grad_hidden_rel'], c['grad_weight_rel']):.2e})")
                          + (f"; {r['note']}" if r.get("note") else "")])
        lines += markdown_table(["kernel", "status", "peak MiB", "vs nll", "vs CCE", "fwd ms", "bwd ms", "time vs nll",
                                 "time vs CCE", "loss", "abs Δloss", "max abs Δgrad hidden / weight", "check"],
                                table, "llrrrrrrrrrll")
        lines.append("")
    checks, notes = acceptance(shapes)
    if checks:
        lines += [f"- {n}" for n in notes] + ["", acceptance_line(checks)]
    return "\n".join(lines) + "\n"


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocabs", default="128256,248320", help="comma-separated vocabulary sizes, one table each")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated; {BASELINE!r} always runs first")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ignore-fraction", type=float, default=0.1, help="fraction of labels set to -100")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny shapes for a check that runs anywhere in seconds ({SMOKE}); overrides those flags")
    add_output_args(p)
    return p.parse_args(argv)


def _resolve(args: argparse.Namespace) -> str:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.dtype = DTYPES[args.dtype] if args.dtype else ("bfloat16" if args.device == "cuda" else "float32")
    unknown = [k for k in args.kernels.split(",") if k and k not in KERNELS]
    if unknown:
        raise SystemExit(f"--kernels: unknown {unknown}; choose from {list(KERNELS)}")
    return args.device


def main(argv: Optional[Sequence[str]] = None) -> dict:
    run = start_run(_parse, argv, __file__, device=_resolve)
    args = run.args
    names = [BASELINE] + [k for k in args.kernels.split(",") if k and k != BASELINE]
    shapes: list[dict] = []
    for v in [int(v) for v in args.vocabs.split(",") if v]:
        shapes.append(run_vocab(args, v, names, lost=shapes[-1]["context_lost_by"] if shapes else None))
    meta = {"tokens": args.tokens, "hidden": args.hidden, "dtype": args.dtype, "device": args.device,
            "warmup": args.warmup, "repeats": args.repeats, "ignore_fraction": args.ignore_fraction,
            "memory_method": ("torch.cuda.max_memory_allocated minus the bytes allocated before the call, reset "
                              "before each call" if args.device == "cuda" else "not measured on CPU"),
            "packages": {p: _version(p) for p in PACKAGES}, "unit_roundoff": UNIT_ROUNDOFF[args.dtype]}
    payload = {**meta, "arguments": run.arguments(), "shapes": shapes, "acceptance": acceptance(shapes)[0]}
    run.write(payload, title="LM-head loss kernels", body=markdown(meta, shapes))
    return payload


if __name__ == "__main__":
    main()
