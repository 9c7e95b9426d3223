#!/usr/bin/env bash
# `make gpu-wheels`: download benchmarks/gpu/wheels.txt for CPython 3.12 x86_64 into .whl/ (ignored through
# .git/info/exclude), build deepspeed's wheel from its sdist, and check the size that travels to the GPU
# machine (the working tree and .whl together must stay well under its 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
LIMIT_MIB=${LIMIT_MIB:-48}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

rm -rf .whl && mkdir .whl
mapfile -t pins < <(grep -vE '^\s*(#|$)' benchmarks/gpu/wheels.txt)
binary=() built=()
for pin in "${pins[@]}"; do
    if [[ $pin == deepspeed==* ]]; then built+=("$pin"); else binary+=("$pin"); fi
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${binary[@]}"
for pin in "${built[@]}"; do
    # pure Python at install; --no-build-isolation: its setup.py reads torch, so PYTHON must have torch
    DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w .whl "$pin"
done

names=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_'; done | sort)
dupes=$(uniq -d <<<"$names")
[[ -z $dupes ]] || { echo "fetch_wheels.sh: two versions of: $dupes" >&2; exit 1; }
expected=${#pins[@]}
have=$(wc -l <<<"$names")
[[ $have -eq $expected ]] || { echo "fetch_wheels.sh: $have wheels for $expected pins" >&2; exit 1; }
for w in .whl/*.whl; do
    case $(basename "$w") in
        *-py3-none-any.whl|*-py312-none-any.whl|*-cp312-cp312-*manylinux*x86_64.whl) ;;
        *) echo "fetch_wheels.sh: $w is not for CPython 3.12 x86_64" >&2; exit 1 ;;
    esac
done

wheels_kib=$(du -sk .whl | cut -f1)
tree_kib=$(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
untracked_kib=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -ck 2>/dev/null | tail -1 | cut -f1)
total_kib=$((wheels_kib + tree_kib + ${untracked_kib:-0}))
ls -l .whl | tail -n +2 | awk '{printf "  %9d  %s\n", $5, $9}'
echo "gpu-wheels: $have wheels, $((wheels_kib / 1024)).$(((wheels_kib % 1024) * 10 / 1024)) MiB in .whl;" \
     "tracked tree $((tree_kib / 1024)) MiB, untracked $(( ${untracked_kib:-0} / 1024 )) MiB;" \
     "together $((total_kib / 1024)).$(((total_kib % 1024) * 10 / 1024)) MiB (limit 64 MiB, checked against $LIMIT_MIB)"
if [[ $total_kib -gt $((LIMIT_MIB * 1024)) ]]; then
    echo "fetch_wheels.sh: $((total_kib / 1024)) MiB would travel: over $LIMIT_MIB MiB" >&2
    exit 1
fi
