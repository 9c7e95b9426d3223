"""The GPU benchmark scripts (benchmarks/gpu/) in their smoke mode, on whatever device this machine has.

CI has no GPU: the smoke runs here check the plumbing end to end on the CPU (the rows that need CUDA say so and
why), and the loss-kernel check is shown to flag a kernel whose loss or gradients are wrong.
"""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_BENCH = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU_BENCH))
sys.path.insert(0, str(GPU_BENCH.parent))
loss_kernels = importlib.import_module("loss_kernels")
readme_table = importlib.import_module("readme_table")


def _run_script(name: str, tmp_path: Path, *argv: str, writes: str = "") -> dict:
    proc = subprocess.run([sys.executable, str(GPU_BENCH / f"{name}.py"), "--smoke", "--out", str(tmp_path), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob(f"{writes or name}_*_*.json")
    data = json.loads(path.read_text())
    assert data["what"] == (writes or name)
    if not writes:
        assert data["provenance"]["non_default_arguments"] == {"smoke": True}
    assert path.with_suffix(".md").exists()
    return data


@pytest.mark.slow
def test_loss_kernels_smoke_runs_every_kernel_or_says_why_not(tmp_path):
    import torch

    from twinseq.torch_backend import triton_ce

    data = _run_script("loss_kernels", tmp_path)
    md = (tmp_path / f"loss_kernels_{data['provenance']['hardware_slug']}_{data['provenance']['date_utc']}.md"
          ).read_text()
    assert [s["vocab"] for s in data["shapes"]] == [int(v) for v in loss_kernels.SMOKE["vocabs"].split(",")]
    for shape in data["shapes"]:
        rows = {r["kernel"]: r for r in shape["results"]}
        assert list(rows) == list(loss_kernels.KERNELS)
        base = rows[loss_kernels.BASELINE]
        assert base["status"] == "ok" and "check" not in base
        for name, row in rows.items():
            assert name in md
            if row["status"] != "ok":
                assert row["status"] == "skipped" and row["reason"], row
                continue
            assert len(row["seconds"]) == loss_kernels.SMOKE["repeats"] and row["median_seconds"] > 0
            if name != loss_kernels.BASELINE:
                assert row["check"]["agrees"], row  # every kernel that runs computes nll's loss and gradients
        # twinseq's CPU paths and TRL's torch fallback run anywhere; the Triton kernels only on CUDA
        for name in ("twinseq chunked_nll", "twinseq fused_linear", "trl chunked_nll"):
            assert rows[name]["status"] == "ok", rows[name]
        if not torch.cuda.is_available():
            for name in ("twinseq liger", "liger LigerFusedLinearCrossEntropyLoss", "cce linear_cross_entropy"):
                assert rows[name]["status"] == "skipped" and "CUDA" in rows[name]["reason"]
            assert all(r.get("peak_bytes") is None for r in rows.values())
            # twinseq's Triton kernel runs under the interpreter where the tests ask for it (conftest.py), and is
            # never measured as its fused_linear fallback under its own name
            triton = rows["twinseq triton"]
            if triton_ce.kernel_mode(torch.device("cpu")) == "interpret":
                assert triton["status"] == "ok" and "interpreter" in triton["note"]
            else:
                assert triton["status"] == "skipped" and "fallback" in triton["reason"]
    cell = _gpu_readme_cell(tmp_path, data)
    for shape in data["shapes"]:
        assert f"V {shape['vocab']:,}: `nll`" in cell
    assert cell.count(" → `") == len(data["shapes"])  # each vocabulary names its fastest twinseq loss


def _gpu_readme_cell(tmp_path: Path, data: dict) -> str:
    """The README's GPU cell for ``data`` (a script's own output) filed as if measured on an H100: the row
    function reads the fields the script writes."""
    folder = tmp_path / "as_gpu"
    folder.mkdir()
    prov = dict(data["provenance"], hardware_slug="h100-80gb")
    (folder / f"{data['what']}_h100-80gb_{prov['date_utc']}.json").write_text(json.dumps(dict(data, provenance=prov)))
    (row,) = [r for r in readme_table.render(folder, folder).splitlines()
              if r.startswith(f"| {readme_table.GPU_ONLY[data['what']]} |")]
    cell = row.rsplit(" | ", 1)[1]
    assert cell.startswith("**h100-80gb**: ") and readme_table.NOT_ON_GPU not in cell
    return cell


def _tiny_inputs():
    return loss_kernels.make_inputs(48, 16, 40, "float32", "cpu", ignore_fraction=0.2, seed=1)


def test_the_check_flags_a_wrong_loss_and_wrong_gradients():
    from twinseq.torch_backend.losses import causal_lm_loss

    inp = _tiny_inputs()
    base = loss_kernels.measure_kernel(loss_kernels.BASELINE, loss_kernels.KERNELS[loss_kernels.BASELINE], inp,
                                       None, warmup=0, repeats=1, keep_as_reference=True)
    reference = base.pop("reference")

    def nll(h, w):
        return causal_lm_loss(h, w, inp["labels_BT"], inp["num_valid"], "nll")

    def same_loss_scaled_grads(h, w):  # the loss value of nll, gradients 0.9x
        loss = nll(h, w)
        return loss.detach() + 0.9 * (loss - loss.detach())

    kernels = {"right": lambda _: nll, "wrong loss": lambda _: lambda h, w: nll(h, w) * 1.001,
               "wrong gradients": lambda _: same_loss_scaled_grads}
    got = {name: loss_kernels.measure_kernel(name, make, inp, reference, warmup=0, repeats=1)["check"]
           for name, make in kernels.items()}
    assert got["right"]["agrees"] and got["right"]["grad_weight_max_abs_diff"] == 0.0
    assert not got["wrong loss"]["agrees"] and got["wrong loss"]["loss_abs_diff"] > got["wrong loss"]["bounds"]["loss_abs"]
    wrong = got["wrong gradients"]
    assert not wrong["agrees"] and wrong["loss_abs_diff"] == 0.0
    assert wrong["grad_hidden_rel"] == pytest.approx(0.1, rel=1e-4) and wrong["grad_weight_rel"] == pytest.approx(0.1, rel=1e-4)


def test_a_kernel_that_cannot_run_is_a_row_with_its_reason():
    inp = _tiny_inputs()

    def broken(_):
        def loss_fn(h, w):
            raise RuntimeError("CUDA out of memory (simulated by this test)")
        return loss_fn

    row = loss_kernels.measure_kernel("broken", broken, inp, None, warmup=0, repeats=1)
    assert row["status"] == "failed" and "out of memory" in row["reason"]
    row = loss_kernels.measure_kernel("needs cuda", loss_kernels.KERNELS["cce linear_cross_entropy"],
                                      dict(inp, device="cpu"), None, warmup=0, repeats=1)
    assert row["status"] == "skipped" and "CUDA" in row["reason"]


@pytest.mark.slow  # the fast tier is at its 10-minute budget; make test-all runs it
def test_a_kernel_that_loses_the_cuda_context_stops_the_kernels_after_it(monkeypatch):
    def faulty(_):
        def loss_fn(h, w):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return loss_fn

    monkeypatch.setitem(loss_kernels.KERNELS, "faulty", faulty)
    args = loss_kernels._parse(["--smoke", "--device", "cpu"])
    loss_kernels._resolve(args)
    names = [loss_kernels.BASELINE, "faulty", "twinseq fused_linear"]
    first = loss_kernels.run_vocab(args, 50, names)
    assert [r["status"] for r in first["results"]] == ["ok", "failed", "not run"]
    assert first["context_lost_by"] == "faulty" and "--kernels" in first["results"][2]["reason"]
    second = loss_kernels.run_vocab(args, 60, names, lost=first["context_lost_by"])
    assert [r["status"] for r in second["results"]] == ["not run"] * 3
    md = loss_kernels.markdown({"tokens": 1, "hidden": 1, "dtype": "float32", "device": "cpu", "warmup": 0,
                                "repeats": 1, "memory_method": "-"}, [first, second])
    assert md.count("| not run |") == 4
    # an ordinary failure (an out-of-memory error, say) leaves the context usable: the next kernels run
    assert not loss_kernels.context_lost({"status": "failed", "reason": "OutOfMemoryError: CUDA out of memory."})


@pytest.mark.slow
def test_sft_gpu_smoke_trains_twinseq_and_trl_on_the_same_rows(tmp_path):
    import torch

    data = _run_script("sft_gpu", tmp_path)
    rows = {r["setup"]: r for r in data["results"]}
    assert list(rows) == ["twinseq", "twinseq-bf16", "twinseq-offload", "twinseq-bf16-offload", "trl"]
    assert rows["twinseq-bf16"]["config"]["optimizer"] == "adamw_bf16" and "optimizer" not in rows["twinseq"]["config"]
    for name in ("twinseq", "twinseq-bf16", "trl"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert len(r["step_seconds"]) == len(r["step_tokens"]) == data["steps"]
        assert r["tokens_per_second"] > 0
        # packed rows of max_length tokens, rows per step: no step feeds more than that
        assert 0 < max(r["step_tokens"]) <= data["rows"] * data["max_length"]
    # both sides pack the same tokenised rows with bfd into rows of the same length: the steps are alike
    assert abs(sum(rows["twinseq"]["step_tokens"]) - sum(rows["trl"]["step_tokens"])) <= 0.1 * sum(
        rows["trl"]["step_tokens"])
    assert rows["twinseq"]["config"]["gradient_checkpointing"] and rows["twinseq"]["config"]["padding_free"]
    assert data["ratios"]["twinseq_over_trl_tokens_per_second"] > 0
    if not torch.cuda.is_available():
        for name in ("twinseq-offload", "twinseq-bf16-offload"):
            assert rows[name]["status"] == "skipped" and "CPU" in rows[name]["reason"]
        assert data["acceptance"] == {}  # the bars are for GPU runs only
    cell = _gpu_readme_cell(tmp_path, data)
    assert f"{rows['trl']['tokens_per_second']:,.0f} tok/s →" in cell
    assert f"({data['ratios']['twinseq_over_trl_tokens_per_second']:.2f}× TRL)" in cell


@pytest.mark.slow
def test_max_length_gpu_smoke_searches_twinseq_and_trl(tmp_path):
    """The wrapper runs max_length.py (its CUDA mode where there is a GPU); the file is max_length's own."""
    import torch

    data = _run_script("max_length_gpu", tmp_path, writes="max_length")
    cuda = torch.cuda.is_available()
    assert data["device"] == ("cuda" if cuda else "cpu")
    assert data["provenance"]["non_default_arguments"]["staircase"] == "last"
    rows = [(r["setup"], r["row"]) for r in data["results"]]
    # only the twinseq rungs with everything on (+ offloading on a GPU), then TRL
    assert rows == [("torch", "+ tiled MLP"), *([("torch", "+ offloading")] if cuda else []),
                    ("trl", "TRL SFTTrainer (chunked log-probs, checkpointing, padding-free)")]
    for r in data["results"]:
        assert r["probes"] and r["bound"] in ("memory", "compute", "limit")
        for p in r["probes"]:  # every fitting length was measured under the cap
            if p["length"] <= r["max_length"] and "peak_bytes" in p:
                assert p["peak_bytes"] <= data["cap_bytes"]
    torch_row = data["results"][0]
    assert torch_row["config"]["model_config"] == "small" and torch_row["max_length"] >= 256


@pytest.mark.slow
def test_measured_runs_can_skip_the_end_of_run_saves(tmp_path):
    """sft_gpu's twinseq runs write no checkpoint or final model (50 GB for a 3B model), and still train."""
    train_peak = importlib.import_module("_train_peak")
    values = dict(model_config="tiny", max_length=64, packing=True, padding_free=True, per_device_train_batch_size=2)
    got = {}
    for skip in (True, False):
        out = tmp_path / f"skip-{skip}"
        rec = train_peak.measure(dict(values, output_dir=str(out)), max_steps=2, skip_saves=skip)
        assert len(rec["step_seconds"]) == 2 and rec["peak_bytes"] > 0
        got[skip] = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert not any(p.startswith("checkpoint-") or p.endswith(".safetensors") for p in got[True]), got[True]
    assert any(p.startswith("checkpoint-2/") for p in got[False]) and "final/model.safetensors" in got[False]


def _row(kernel, peak_mib, ms, agrees=True):
    row = {"kernel": kernel, "status": "ok", "peak_bytes": peak_mib << 20, "median_seconds": ms / 1e3}
    if kernel != loss_kernels.BASELINE:
        row["check"] = {"agrees": agrees}
    return row


def test_acceptance_needs_an_agreeing_twinseq_loss_within_cce_memory_and_1_1x_its_time():
    def shape(vocab, *rows):
        rows = [_row(loss_kernels.BASELINE, 9000, 50), _row(loss_kernels.CCE, 1000, 20), *rows]
        loss_kernels._add_ratios(rows)
        return {"vocab": vocab, "results": rows}

    shapes = [shape(100, _row("twinseq fused_linear", 1000, 21.9)),                   # 1.0x memory, 1.095x time
              shape(200, _row("twinseq fused_linear", 1001, 10)),                     # over CCE's memory
              shape(300, _row("twinseq triton", 500, 10, agrees=False),               # fast but wrong
                    _row("twinseq fused_linear", 900, 22.2)),                         # 1.11x the time
              {"vocab": 400, "results": [_row(loss_kernels.BASELINE, 9000, 50)]}]     # CCE did not run
    checks, notes = loss_kernels.acceptance(shapes)
    assert [k.split(":")[0] for k in checks] == ["V 100", "V 200", "V 300"]
    assert list(checks.values()) == [True, False, False]
    assert not any("triton" in n for n in notes)  # a kernel that disagrees with nll is never credited


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_without_the_baseline_the_other_kernels_run_unchecked(monkeypatch):
    def out_of_memory(_):
        def loss_fn(h, w):
            raise RuntimeError("CUDA out of memory. Tried to allocate 15.16 GiB")
        return loss_fn

    monkeypatch.setitem(loss_kernels.KERNELS, loss_kernels.BASELINE, out_of_memory)
    args = loss_kernels._parse(["--smoke", "--device", "cpu"])
    loss_kernels._resolve(args)
    shape = loss_kernels.run_vocab(args, 50, [loss_kernels.BASELINE, "twinseq fused_linear"])
    base, fused = shape["results"]
    assert base["status"] == "failed" and shape["context_lost_by"] is None
    assert fused["status"] == "ok" and "check" not in fused and "reference" not in fused
    md = loss_kernels.markdown({"tokens": 1, "hidden": 1, "dtype": "float32", "device": "cpu", "warmup": 0,
                                "repeats": 1, "memory_method": "-"}, [shape])
    assert "unchecked: `twinseq nll` did not run" in md
    assert readme_table.loss_kernels_row({"tokens": 1, "hidden": 1, "dtype": "float32", "shapes": [shape]})[2] == \
        "unchecked (no `nll` to compare)"


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_max_length_run_cut_after_its_first_row_keeps_that_row(tmp_path, monkeypatch):
    """A search killed at its time limit (the GPU runs end so) still leaves a result file with the rows it finished,
    marked partial, and the README's cell says so; a finished run carries no such mark."""
    max_length = importlib.import_module("max_length")
    found = {"max_length": 512, "bound": "memory", "probes": [{"length": 512, "peak_bytes": 1 << 20, "seconds": 1.0}]}
    calls = []

    def search(probe, cap, **_):
        calls.append(cap)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a timeout's signal does to the second row
        return found

    monkeypatch.setattr(max_length, "search", search)
    argv = ["--setups", "torch,trl", "--staircase", "last", "--cap", "300MiB", "--sweep", "", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        max_length.main(argv)
    (path,) = tmp_path.glob("max_length_*_*.json")
    data = json.loads(path.read_text())
    assert data["partial"] == "1 of 2 rows searched" and [r["setup"] for r in data["results"]] == ["torch"]
    assert "**Partial run: 1 of 2 rows searched.**" in path.with_suffix(".md").read_text()
    assert "**partial run**: 1 of 2 rows searched" in readme_table.file_cell(path, data, tmp_path)

    calls.clear()
    monkeypatch.setattr(max_length, "search", lambda probe, cap, **_: found)
    max_length.main(argv)  # the finished run overwrites the partial file, unmarked
    data = json.loads(path.read_text())
    assert "partial" not in data and [r["setup"] for r in data["results"]] == ["torch", "trl"]
    assert "partial" not in readme_table.file_cell(path, data, tmp_path)


@pytest.mark.slow
def test_state_staircase_gpu_smoke_runs_every_rung_and_compares_with_float32(tmp_path):
    data = _run_script("state_staircase_gpu", tmp_path)
    rows = {r["rung"]: r for r in data["results"]}
    assert list(rows) == ["float32", "bf16-state", "bf16-8bit", "bf16-8bit-in-backward"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    last = rows["bf16-8bit-in-backward"]["config"]
    assert last["optimizer"] == "adamw_bf16_8bit" and last["optimizer_in_backward"] and last["max_grad_norm"] is None
    assert "--max-grad-norm None" in rows["float32"]["command"]  # every rung trains without clipping
    for r in rows.values():
        assert len(r["losses"]) == data["steps"] and r["last_loss"] < r["first_loss"]
    assert set(data["acceptance"]) == {"bf16 + 8-bit + in-backward peak <= 0.5x float32",
                                       "its loss within 2 % of float32's"}
    cell = _gpu_readme_cell(tmp_path, data)
    assert "float32 weights + AdamW:" in cell and "bf16-8bit-in-backward:" in cell


@pytest.mark.slow
def test_moe_gpu_smoke_checks_every_torch_variant_against_the_loop(tmp_path):
    """Every variant runs on this machine's device; each torch MoE variant's output and input gradient are checked
    against the eager loop's (agreeing here), and jax's rows carry compiled memory."""
    data = _run_script("moe_gpu", tmp_path)
    rows = {(r["variant"], r["train_weights"]): r for r in data["results"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    for train_weights in (True, False):
        for variant in ("grouped", "hf_grouped_mm", "eager"):
            assert rows[(variant, train_weights)]["check"]["agrees"], (variant, train_weights)
        assert "check" not in rows[("dense", train_weights)]
        assert rows[("jax moe block", train_weights)]["peak_bytes"] > 0
