#!/usr/bin/env bash
# Build every wheel the image installs, on the host, so `docker build` needs no network: murmur
# itself and all its dependencies at the versions constraints.txt pins. The Dockerfile installs
# them with `pip install --no-index`.
#
#   deploy/build-wheels.sh [cpu|gpu]     (default cpu; writes build/wheels/VARIANT/{deps,murmur}/)
#
# murmur's own wheel goes to a folder of its own, so the image layer of the dependencies (torch and
# the rest, ~600 MB of wheels) stays cached while only murmur changes.
#
# cpu: torch as constraints.txt pins it (the CPU build). gpu: torch unpinned within the package's
# range from PyPI's default index, which is the CUDA build (several GB; not run on the CPU build
# machines).
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT=${1:-cpu}
PIP=${PIP:-.venv/bin/pip}
OUT=build/wheels/$VARIANT
CONSTRAINTS=constraints.txt
case "$VARIANT" in
    cpu) ;;
    gpu)
        CONSTRAINTS=$(mktemp)
        trap 'rm -f "$CONSTRAINTS"' EXIT
        grep -v '^torch==' constraints.txt > "$CONSTRAINTS"
        ;;
    *) echo "VARIANT must be cpu or gpu, got $VARIANT" >&2; exit 1 ;;
esac
mkdir -p "$OUT/deps" "$OUT/murmur"
rm -f "$OUT"/murmur/*.whl "$OUT"/deps/murmur-*.whl  # the project's own wheel is rebuilt from the tree
# The dependencies only change with pyproject.toml or the pins: skip resolving them (a minute) when
# neither changed since the last build of this folder.
stamp=$(cat pyproject.toml "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$OUT/deps/.stamp" 2>/dev/null)" = "$stamp" ]; then
    "$PIP" wheel --quiet --no-deps --wheel-dir "$OUT/murmur" .
else
    # Start from an empty folder: a wheel left from the last resolution (idna 3.20 beside 3.21) makes
    # the image's `pip install --no-index` refuse the pair. pip's own cache keeps this cheap.
    find "$OUT/deps" -mindepth 1 -delete
    "$PIP" wheel --quiet --wheel-dir "$OUT/deps" -c "$CONSTRAINTS" .
    mv "$OUT"/deps/murmur-*.whl "$OUT/murmur/"
    echo "$stamp" > "$OUT/deps/.stamp"
fi
echo "wheels for $VARIANT in $OUT: $(ls "$OUT/deps" | wc -l) dependencies ($(du -sh "$OUT/deps" | cut -f1)), $(ls "$OUT/murmur")"
