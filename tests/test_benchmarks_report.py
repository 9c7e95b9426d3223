"""benchmarks/_report.py (provenance, file names, writing) and benchmarks/readme_table.py
(the README's benchmark table, generated from the result files)."""

import argparse
import copy
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
# benchmarks/ is a folder of scripts, not a package: each script puts itself on sys.path.
sys.path.insert(0, str(BENCH))
report = importlib.import_module("_report")
readme_table = importlib.import_module("readme_table")

BENCHMARK_SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")
                           and p.stem != "readme_table")
GPU_SCRIPTS = sorted(p.stem for p in (BENCH / "gpu").glob("*.py") if not p.name.startswith("_"))


def _run(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, capture_output=True, text=True, timeout=600)


# --- the README table ----------------------------------------------------------------------

def test_readme_table_matches_the_committed_results():
    """README.md's table is exactly what benchmarks/readme_table.py renders from benchmarks/results."""
    proc = _run(BENCH / "readme_table.py", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_benchmark_script_has_a_readme_row_and_a_make_bench_line():
    own = [g for g in GPU_SCRIPTS if g not in readme_table.GPU_WRAPPERS]  # a wrapper writes another row's files
    assert sorted(readme_table.ROWS) == sorted(BENCHMARK_SCRIPTS + own)
    assert sorted(readme_table.GPU_ONLY) == own and own
    assert set(readme_table.GPU_WRAPPERS) <= set(GPU_SCRIPTS)
    assert set(readme_table.GPU_WRAPPERS.values()) <= set(BENCHMARK_SCRIPTS)
    makefile = (ROOT / "Makefile").read_text()
    for target, scripts in (("bench", BENCHMARK_SCRIPTS), ("bench-gpu", GPU_SCRIPTS)):
        recipe = makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
        ran = re.findall(r"benchmarks/(?:gpu/)?(\w+)\.py", recipe)
        assert sorted(ran[:-1]) == scripts and ran[-1] == "readme_table", (target, ran)


def _as_gpu_file(tmp_path: Path, source: Path, date: str = "2099-01-02") -> Path:
    """A copy of a result file as if it had been measured on an H100 (its figures unchanged)."""
    data = json.loads(source.read_text())
    what = parse(source)["what"]
    data["provenance"] = {**data.get("provenance", {}), "started_utc": f"{date}T10:00:00+00:00", "date_utc": date,
                          "hardware_slug": "h100-80gb", "device": "cuda",
                          "git": {"commit": "0123456789abcdef", "dirty": False, "changed_paths": []},
                          "non_default_arguments": {}}
    path = tmp_path / f"{what}_h100-80gb_{date}.json"
    path.write_text(json.dumps(data))
    return path


def parse(path: Path) -> dict:
    return report.parse_stem(path.stem)


def test_gpu_column_says_when_nothing_was_measured_on_a_gpu(tmp_path):
    for f in RESULTS.glob("*.json"):
        if not readme_table.is_gpu_hardware(parse(f)["hardware"]):
            shutil.copy(f, tmp_path / f.name)
    table = readme_table.render(tmp_path, tmp_path).split(readme_table.START)[-1].splitlines()
    rows = [r for r in table if r.startswith("| ") and not r.startswith("| what")]
    assert len(rows) == len(readme_table.ROWS)
    assert all(r.endswith(f"| {readme_table.NOT_ON_GPU} |") for r in rows), rows
    for what, text in readme_table.GPU_ONLY.items():  # a GPU-only benchmark keeps its row, saying where it runs
        (row,) = [r for r in rows if r.startswith(f"| {text} |")]
        assert f"benchmarks/gpu/{what}.py" in row


def test_gpu_column_comes_from_the_gpu_file_and_leaves_the_cpu_columns_alone(tmp_path):
    for f in RESULTS.glob("*.json"):
        shutil.copy(f, tmp_path / f.name)
    before = readme_table.render(tmp_path, tmp_path).splitlines()
    cpu_file = next(RESULTS.glob("loss_memory_cpu-*.json"))
    gpu = _as_gpu_file(tmp_path, cpu_file)  # newer than every CPU file, yet never picked for the CPU columns
    data = json.loads(gpu.read_text())
    fused = next(r for r in data["results"] if r["loss_type"] == "fused_linear")
    fused["peak_bytes"] = 321 * 2**20
    gpu.write_text(json.dumps(data))
    after = readme_table.render(tmp_path, tmp_path).splitlines()
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    assert len(before) == len(after) and len(changed) == 2, changed  # the row, and the note counting GPU files
    old, new = changed[0]
    cells_old, cells_new = old.split(" | "), new.split(" | ")
    assert cells_old[:-1] == cells_new[:-1] and cpu_file.with_suffix(".md").name in cells_new[3]
    assert cells_old[-1] == f"{readme_table.NOT_ON_GPU} |"
    assert cells_new[-1].startswith("**h100-80gb**: ") and "`fused_linear` 321 MiB" in cells_new[-1]
    assert gpu.with_suffix(".md").name in cells_new[-1] and "commit `0123456789`" in cells_new[-1]
    had = re.search(r"(\d+) of \d+ benchmarks have one", changed[1][0])  # the committed GPU results, if any
    assert f"{int(had.group(1)) + 1 if had else 1} of" in changed[1][1]


def test_check_fails_when_the_readme_drifts(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    args = ["--readme", str(readme), "--results-dir", str(RESULTS)]
    assert readme_table.main(args) == 0  # the links are relative to the README: written for this place
    generated = readme.read_text()
    assert readme_table.main(["--check", *args]) == 0
    head, block = generated.split(readme_table.START)
    row = block.splitlines()[3]  # START, header, rule, first row
    edited = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), row, count=1)  # a hand-edited figure
    readme.write_text(head + readme_table.START + block.replace(row, edited, 1))
    assert readme_table.main(["--check", *args]) == 1
    assert readme_table.main(args) == 0 and readme.read_text() == generated


def test_committed_files_without_provenance_are_marked():
    rows = readme_table.render().splitlines()
    for what, (path, data) in readme_table.newest_results(RESULTS).items():
        (row,) = [r for r in rows if f"[`{path.with_suffix('.md').name}`]" in r]
        assert (readme_table.NO_PROVENANCE in row) == ("provenance" not in data), what


def _new_format_copy(tmp_path: Path, what: str, date: str, **prov_overrides) -> Path:
    """A committed result re-dressed with another provenance block, in a temporary results folder."""
    old = json.loads(next(RESULTS.glob(f"{what}_*.json")).read_text())
    prov = {"started_utc": f"{date}T10:00:00+00:00", "date_utc": date, "hardware_slug": "cpu-4core",
            "git": {"commit": "0123456789abcdef", "dirty": False, "changed_paths": []},
            "non_default_arguments": {}, **prov_overrides}
    path = tmp_path / f"{what}_cpu-4core_{date}.json"
    path.write_text(json.dumps({**old, "what": what, "provenance": prov}))
    return path


def test_newest_file_with_provenance_wins_and_figures_come_from_its_json(tmp_path):
    for old in RESULTS.glob("dpo_memory_*"):
        shutil.copy(old, tmp_path / old.name)
    path = _new_format_copy(tmp_path, "dpo_memory", "2099-01-02")
    data = json.loads(path.read_text())
    fused = next(r for r in data["results"] if r["layout"] == "padded" and r["kernel"] == "fused_linear")
    fused["peak_bytes"] = 123 * 2**20
    fused["memory_vs_full_same_layout"] = 0.0123
    path.write_text(json.dumps(data))
    (row,) = [r for r in readme_table.render(tmp_path, tmp_path).splitlines() if "dpo_memory_" in r]
    assert "fused 123 MiB (0.012×)" in row
    assert "dpo_memory_cpu-4core_2099-01-02.md" in row and "commit `0123456789`" in row
    assert readme_table.NO_PROVENANCE not in row


def test_dirty_and_small_runs_are_marked(tmp_path):
    _new_format_copy(tmp_path, "packing", "2099-01-02", git={"commit": "abc", "dirty": True, "changed_paths": []},
                     non_default_arguments={"num_sequences": 1000})
    (row,) = [r for r in readme_table.render(tmp_path, tmp_path).splitlines() if "packing_" in r]
    assert "**dirty tree**" in row and "`num_sequences=1000`" in row


def test_ratio_and_count_formats():
    assert [readme_table._x(x) for x in (1.1316, 0.3957, 0.1003, 0.0391, 0.00564)] == \
        ["1.13", "0.40", "0.10", "0.039", "0.0056"]
    assert [readme_table._count(n) for n in (1_000_000, 100_000, 1500)] == ["1M", "100k", "1,500"]


def test_memory_helpers():
    memory = importlib.import_module("_memory")
    res = {"peak_above_baseline_bytes": 100, "records": [{"extra": {"loss": 1.0}}, {"extra": {"loss": 1.0}}]}
    assert memory.peak_bytes(res) == 100
    res["records"] = [{"extra": {memory.CUDA_PEAK: 7}}, {"extra": {memory.CUDA_PEAK: 9}}]
    assert memory.peak_bytes(res) == 9
    assert memory.with_baseline("fused_linear,nll,,chunked_nll") == ["nll", "fused_linear", "chunked_nll"]


# --- provenance and file names ------------------------------------------------------------------

def test_hardware_slug_is_derived_from_what_was_detected():
    assert report.hardware_slug({"usable_cores": 2}, "cpu") == "cpu-2core"
    gpu = {"name": "NVIDIA H100 80GB HBM3", "count": 1, "memory_bytes": 85_520_809_984}
    assert report.hardware_slug({"gpu": gpu}, "cuda") == "h100-80gb"
    assert report.hardware_slug({"gpu": {**gpu, "name": "NVIDIA A100-SXM4-40GB", "count": 8}}, "cuda") == \
        "a100-40gb-x8"
    assert report.hardware_slug({"gpu": {"name": "NVIDIA H200", "count": 1, "memory_bytes": 143771 * 2**20}},
                                "cuda") == "h200-140gb"
    with pytest.raises(ValueError, match="no GPU"):
        report.hardware_slug({"gpu": "none"}, "cuda")


def test_stem_round_trips():
    prov = {"hardware_slug": "h100-80gb", "date_utc": "2026-11-23"}
    stem = report.result_stem("jax_loss_memory", prov)
    assert stem == "jax_loss_memory_h100-80gb_2026-11-23"
    assert report.parse_stem(stem) == {"what": "jax_loss_memory", "hardware": "h100-80gb", "date": "2026-11-23"}


def test_non_default_arguments_leave_out_the_output_location():
    defaults = argparse.Namespace(steps=20, presets=["tiny", "small"], output_dir=Path("a"), no_write=False)
    given = argparse.Namespace(steps=2, presets=["tiny", "small"], output_dir=Path("/tmp"), no_write=True)
    assert report.non_default_arguments(given, defaults) == {"steps": 2}


@pytest.fixture(scope="module")
def prov():
    return report.provenance("cpu", changed_arguments={"steps": 2}, script=str(BENCH / "packing.py"),
                             argv=["--steps", "2"])


def test_provenance_records_commit_command_versions_and_hardware(prov):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:  # an exported tree: recorded as unknown, never guessed
        assert prov["git"]["commit"] is None and prov["git"]["dirty"] is None
    else:
        assert prov["git"]["commit"] == head.stdout.strip() and isinstance(prov["git"]["dirty"], bool)
        assert not any("benchmarks/results/" in line for line in prov["git"]["changed_paths"])
    assert prov["command"]["argv"][0] == sys.executable and prov["command"]["argv"][-2:] == ["--steps", "2"]
    assert set(report.VERSION_PACKAGES) | {"python"} == set(prov["versions"])
    assert prov["versions"]["numpy"] != report.NOT_INSTALLED
    hw = prov["hardware"]
    assert hw["logical_cores"] >= hw["usable_cores"] >= 1 and hw["cpu_model"]
    assert hw["gpu"] == "none" or isinstance(hw["gpu"], dict)
    assert prov["hardware_slug"] == f"cpu-{hw['usable_cores']}core"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", prov["date_utc"]) and prov["started_utc"].startswith(prov["date_utc"])
    assert prov["non_default_arguments"] == {"steps": 2}


def test_write_result_writes_json_md_and_the_callers_png(tmp_path, prov):
    drawn = []
    stem = report.write_result("packing", copy.deepcopy(prov), {"results": [1, 2]}, title="Packing", body="body text",
                               output_dir=tmp_path, plot=lambda png: drawn.append(png) or png.write_bytes(b"png"))
    assert stem.name == f"packing_{prov['hardware_slug']}_{prov['date_utc']}"
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["what"] == "packing" and data["results"] == [1, 2]
    assert data["provenance"]["git"] == prov["git"] and "finished_utc" in data["provenance"]
    md = stem.with_suffix(".md").read_text()
    assert md.startswith(f"# Packing ({prov['hardware_slug']}, {prov['date_utc']})")
    for needle in ("| commit |", "| command |", "| versions |", "| hardware |", "numpy", "body text"):
        assert needle in md
    assert drawn == [stem.with_suffix(".png")]


@pytest.mark.slow
def test_a_benchmark_script_writes_provenance(tmp_path):
    """The smallest packing run, as a user types it: its .json and .md carry the provenance."""
    proc = _run(BENCH / "packing.py", "--num-sequences", "300", "--repeats", "1", "--no-trl",
                "--strategies", "bfd", "--output-dir", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("packing_cpu-*core_*.json")
    prov = json.loads(path.read_text())["provenance"]
    assert prov["command"]["argv"][1:3] == [str(BENCH / "packing.py"), "--num-sequences"]
    assert prov["non_default_arguments"] == {"num_sequences": 300, "strategies": ["bfd"], "repeats": 1,
                                             "no_trl": True}
    assert "| commit |" in path.with_suffix(".md").read_text() and path.with_suffix(".png").exists()
