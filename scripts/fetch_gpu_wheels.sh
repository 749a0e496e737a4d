#!/usr/bin/env bash
# Fetch into .whl/ (ignored by git) the wheels the GPU machine's python3 lacks: the pins of
# bench/gpu/preflight.py's GPU_WHEELS, for CPython 3.12 manylinux x86_64, --no-deps (their
# requirements are checked against the pins and the machine instead). Wheels of other versions
# or packages are removed, so .whl/ holds exactly one wheel per pin; then the set is checked
# (bench/gpu/preflight.py --check-wheels). About 5 MB. Needs pip and the package index: run it
# here, then carry=[".whl"] in the device tool's run.
#
#   bash scripts/fetch_gpu_wheels.sh           PYTHON=/path/to/python to choose the pip
#
# Exit 3 when the index cannot be reached (bench/gpu_engine_check.sh --dry-run says so).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEST=.whl
mkdir -p "$DEST"
mapfile -t pins < <("$PYTHON" bench/gpu/preflight.py --pins)
# every file not named by a pin goes (another version, or a package no longer pinned)
for f in "$DEST"/*.whl; do
    [ -e "$f" ] || continue
    base=$(basename "$f")
    keep=no
    for pin in "${pins[@]}"; do
        name=${pin%%==*} version=${pin##*==}
        prefix="$(echo "$name" | tr '-' '_')-$version-"
        [[ "${base,,}" == "${prefix,,}"* ]] && keep=yes
    done
    [ "$keep" = yes ] || { echo "removing $base (not pinned)"; rm -f "$f"; }
done
if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$DEST" "${pins[@]}"; then
    echo "fetch_gpu_wheels: pip download failed (is the package index reachable?)" >&2
    exit 3
fi
du -sh "$DEST"
"$PYTHON" bench/gpu/preflight.py --check-wheels "$DEST"
