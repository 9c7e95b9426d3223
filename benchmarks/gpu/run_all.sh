#!/usr/bin/env bash
# The GPU lane in one command: benchmarks/gpu/run_all.sh OUTDIR [STAGE...]   (README, "GPU lane")
#
# Stages (default: all), each under ~9 minutes on one H100, so a session can split them over commands:
#   env    only the setup below and OUTDIR/env.txt
#   lane   pytest -m gpu -rA over tests/ and parity_tests/ -> OUTDIR/gpu_lane.log, gpu_lane.xml, gpu_lane_summary.txt
#   bench  every benchmarks/gpu/*.py (not _*.py), as `python benchmarks/gpu/NAME.py --out OUTDIR`
#          -> OUTDIR/bench_NAME.log
#   all    lane, then bench
# Every run first installs the brought wheels (.whl/*.whl, from `make gpu-wheels`) into /tmp/site and puts
# them on PYTHONPATH, makes twinseq importable without installing it (a shim folder mapping twinseq.common,
# .torch_backend, .jax_backend to the repository's folders, as pyproject's package-dir does), and writes
# OUTDIR/env.txt (nvidia-smi, driver, CUDA, package versions).
#
# Exit status: 0 every gpu test that ran passed (and every benchmark ran); 1 a gpu test failed or errored, or
# a benchmark failed; 2 usage error; 3 no CUDA device: the lane ran but every gpu test skipped, nothing was
# proven (set TWINSEQ_ALLOW_NO_CUDA=1 to exit 0 instead, as the CPU test of this script does).
# Environment: PYTHON (default: .venv/bin/python if present, else python3), TWINSEQ_GPU_SITE (default
# /tmp/site), PYTEST_ARGS (extra pytest arguments, e.g. "-k flex" or test paths: a way to split the lane),
# TWINSEQ_LANE_TIMEOUT (default 540 s: the lane is interrupted, and reported, before a 600 s command limit),
# TWINSEQ_TEST_TIMEOUT (default 300 s a test), TWINSEQ_WHEELS=0 (skip .whl).
set -uo pipefail

usage() {
    cat <<'EOF'
usage: benchmarks/gpu/run_all.sh OUTDIR [STAGE...]
  stages: env (OUTDIR/env.txt only), lane (pytest -m gpu), bench (benchmarks/gpu/*.py --out OUTDIR),
          all (lane then bench; the default)
  writes OUTDIR/env.txt always; exit 0 passed, 1 failed, 2 usage, 3 no CUDA (nothing ran)
EOF
}

if [[ $# -lt 1 ]]; then usage >&2; exit 2; fi
case "$1" in -h|--help) usage; exit 0 ;; -*) echo "run_all.sh: unknown option $1" >&2; usage >&2; exit 2 ;; esac
ARGS="$*"
OUT=$1
shift
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(all)
RUN_LANE=0 RUN_BENCH=0
for stage in "${STAGES[@]}"; do
    case "$stage" in
        env) ;;
        lane) RUN_LANE=1 ;;
        bench) RUN_BENCH=1 ;;
        all) RUN_LANE=1 RUN_BENCH=1 ;;
        *) echo "run_all.sh: unknown stage '$stage' (choose from: env lane bench all)" >&2; usage >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# JAX: the root conftest.py pins JAX_PLATFORMS=cpu unless set; empty = JAX picks the GPU when it has one.
# No preallocation: torch and JAX share the GPU in one pytest process.
export JAX_PLATFORMS="" XLA_PYTHON_CLIENT_PREALLOCATE=false

say() { echo "run_all.sh: $*"; }

# ---- the brought wheels -------------------------------------------------------------------------------
SITE=${TWINSEQ_GPU_SITE:-/tmp/site}
shopt -s nullglob
WHEELS=(.whl/*.whl)
shopt -u nullglob
PYVER=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') || {
    say "cannot run PYTHON=$PYTHON"; exit 2; }
if [[ ${#WHEELS[@]} -gt 0 && "${TWINSEQ_WHEELS:-1}" != 0 ]]; then
    if [[ "$PYVER" != 3.12 ]]; then
        say "not installing .whl: they are for Python 3.12, this is $PYVER (TWINSEQ_WHEELS=0 silences this)"
    else
        say "installing ${#WHEELS[@]} wheels from .whl into $SITE"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${WHEELS[@]}" || { say "FAILED to install .whl/*.whl into $SITE"; exit 1; }
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

# ---- twinseq importable from this tree ----------------------------------------------------------------
where=$("$PYTHON" -c 'import twinseq.common, os; print(os.path.dirname(os.path.realpath(twinseq.common.__file__)))' \
    2>/dev/null || true)
if [[ "$where" != "$ROOT/common" ]]; then
    SHIM=$(mktemp -d "${TMPDIR:-/tmp}/twinseq_shim.XXXXXX") && mkdir "$SHIM/twinseq" || exit 2
    trap 'rm -rf "$SHIM"' EXIT
    for layer in common torch_backend jax_backend; do ln -s "$ROOT/$layer" "$SHIM/twinseq/$layer"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    where=$("$PYTHON" -c 'import twinseq.common, os; print(os.path.dirname(os.path.realpath(twinseq.common.__file__)))') \
        || { say "FAILED to make twinseq importable"; exit 1; }
    [[ "$where" == "$ROOT/common" ]] || { say "FAILED: twinseq.common resolves to $where, not $ROOT/common"; exit 1; }
    say "twinseq imported through the shim $SHIM -> $where"
fi

# ---- env.txt -----------------------------------------------------------------------------------------
{
    echo "# run_all.sh $ARGS  stages: ${STAGES[*]}"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: ${TWINSEQ_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo 'unknown (no .git)')}${TWINSEQ_COMMIT:+ (TWINSEQ_COMMIT: a copy of that tree)}"
    echo "python: $PYTHON ($("$PYTHON" --version 2>&1)); PYTHONPATH=${PYTHONPATH:-}"
    echo "wheels: ${WHEELS[*]:-none}"
    echo "## nvidia-smi"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
    echo "## nvcc"
    nvcc --version 2>&1 | tail -2 || echo "nvcc: not available"
    echo "## packages"
    "$PYTHON" - <<'EOF' 2>&1
import importlib, importlib.metadata as md

for dist in ["torch", "triton", "jax", "jaxlib", "flax", "optax", "transformers", "accelerate", "peft",
             "liger-kernel", "cut-cross-entropy", "trl", "deepspeed", "datasets", "tyro", "huggingface-hub",
             "pydantic", "numpy", "pyarrow", "pytest", "bitsandbytes", "flash-attn", "vllm"]:
    try:
        print(f"{dist}: {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
try:
    import torch

    print(f"torch.version.cuda: {torch.version.cuda}; cudnn: {torch.backends.cudnn.version()}; "
          f"cuda available: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
              f"capability {p.major}.{p.minor}; devices: {torch.cuda.device_count()}")
except Exception as exc:  # the report must not stop the run
    print(f"torch: {exc!r}")
try:
    import jax

    print(f"jax backend: {jax.default_backend()}; devices: {jax.devices()}")
except Exception as exc:
    print(f"jax: {exc!r}")
for module in ["twinseq.common", "twinseq.torch_backend", "twinseq.jax_backend", "liger_kernel",
               "cut_cross_entropy", "trl", "deepspeed", "datasets", "tyro"]:
    try:
        importlib.import_module(module)
        print(f"import {module}: ok")
    except Exception as exc:
        print(f"import {module}: FAILED {exc!r}")
EOF
} > "$OUT/env.txt"
say "wrote $OUT/env.txt"
grep -E "^(torch|jax|liger-kernel|trl|deepspeed|cut-cross-entropy|jax backend|import .*FAILED|device 0)" "$OUT/env.txt" \
    | sed 's/^/  /'

STATUS=0
TEST_LIMIT=${TWINSEQ_TEST_TIMEOUT:-300}
CUDA=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# ---- lane --------------------------------------------------------------------------------------------
if [[ $RUN_LANE == 1 ]]; then
    LANE_LIMIT=${TWINSEQ_LANE_TIMEOUT:-540}
    say "lane: pytest -m gpu, at most $LANE_LIMIT s, $TEST_LIMIT s a test (log: $OUT/gpu_lane.log)"
    start=$SECONDS
    # SIGINT at the limit: pytest stops, still prints its summary and writes the junit report.
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
    timeout -s INT -k 30 "$LANE_LIMIT" "$PYTHON" -m pytest -m gpu -rA -p no:cacheprovider --durations=20 \
        --timeout="$TEST_LIMIT" --junitxml="$OUT/gpu_lane.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_lane.log"
    rc=${PIPESTATUS[0]}
    say "lane: pytest exit status $rc after $((SECONDS - start)) s"
    "$PYTHON" - "$OUT/gpu_lane.xml" "$rc" <<'EOF' | tee "$OUT/gpu_lane_summary.txt"
import collections, sys
import xml.etree.ElementTree as ET

path, rc = sys.argv[1], int(sys.argv[2])
try:
    cases = list(ET.parse(path).getroot().iter("testcase"))
except (OSError, ET.ParseError) as exc:
    print(f"GPU lane: no junit report ({exc}); pytest exit status {rc}")
    sys.exit(0)
outcome = collections.Counter()
reasons = collections.Counter()
for case in cases:
    name = f"{case.get('classname')}::{case.get('name')}"
    if case.find("failure") is not None or case.find("error") is not None:
        kind = "failed" if case.find("failure") is not None else "errors"
        outcome[kind] += 1
        print(f"  {kind.upper()}: {name}")
    elif case.find("skipped") is not None:
        outcome["skipped"] += 1
        reasons[case.find("skipped").get("message", "").strip()] += 1
    else:
        outcome["passed"] += 1
print(f"GPU lane: {outcome['passed']} passed, {outcome['failed']} failed, {outcome['skipped']} skipped, "
      f"{outcome['errors']} errors (pytest exit status {rc})")
for reason, n in reasons.most_common():
    print(f"  skipped {n}: {reason}")
if rc == 124:
    print("  INTERRUPTED at the lane's time limit (TWINSEQ_LANE_TIMEOUT): the counts are partial and the last test "
          "counted did not finish; split the lane with PYTEST_ARGS")
EOF
    # 5: no test selected (PYTEST_ARGS chose none)
    if [[ $rc -ne 0 && $rc -ne 5 ]]; then
        say "lane FAILED (pytest exit status $rc): see $OUT/gpu_lane.log"
        STATUS=1
    fi
fi

# ---- bench -------------------------------------------------------------------------------------------
if [[ $RUN_BENCH == 1 ]]; then
    shopt -s nullglob
    SCRIPTS=()
    for script in benchmarks/gpu/*.py; do [[ $(basename "$script") == _* ]] || SCRIPTS+=("$script"); done
    shopt -u nullglob
    if [[ ${#SCRIPTS[@]} -eq 0 ]]; then
        say "bench: no benchmark scripts under benchmarks/gpu/"
    elif [[ $CUDA != 1 ]]; then
        say "bench: no CUDA device: not running ${SCRIPTS[*]}"
    fi
    for script in "${SCRIPTS[@]}"; do
        [[ $CUDA == 1 ]] || break
        name=$(basename "$script" .py)
        say "bench: $script --out $OUT (log: $OUT/bench_$name.log)"
        start=$SECONDS
        "$PYTHON" "$script" --out "$OUT" 2>&1 | tee "$OUT/bench_$name.log"
        brc=${PIPESTATUS[0]}
        say "bench: $name exit status $brc after $((SECONDS - start)) s"
        [[ $brc -eq 0 ]] || STATUS=1
    done
fi

if [[ $STATUS -ne 0 ]]; then
    say "FAILED (exit 1)"
    exit 1
fi
if [[ $CUDA != 1 ]]; then
    why="no CUDA: nothing ran"
    [[ $RUN_LANE == 1 ]] && why="$why (every gpu test skipped)"
    if [[ "${TWINSEQ_ALLOW_NO_CUDA:-0}" == 1 ]]; then
        say "$why; TWINSEQ_ALLOW_NO_CUDA=1, so exit 0"
        exit 0
    fi
    say "$why; exit 3"
    exit 3
fi
say "done: results in $OUT"
exit 0
