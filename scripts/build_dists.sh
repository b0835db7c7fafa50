#!/usr/bin/env bash
# Build a wheel and an sdist for dlrover-core and for every plugin under plugins/,
# then `twine check` all of them. Output: dist/ (the core) and dist/plugins/ (the
# plugins), emptied first.
#
# Usage: scripts/build_dists.sh [PYTHON]   (default: .venv/bin/python)
# Builds run without build isolation, with the setuptools of that Python (no download
# of build backends); `build` and `twine` are installed into it when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON_BIN:-.venv/bin/python}}
OUT=dist
if ! "$PY" -c "import build, twine, wheel" 2>/dev/null; then
  if command -v flock >/dev/null; then
    flock /tmp/dlrover-pip.lock "$PY" -m pip install -q "build>=1.2" "twine>=5" wheel
  else
    "$PY" -m pip install -q "build>=1.2" "twine>=5" wheel
  fi
fi
rm -rf "$OUT"
mkdir -p "$OUT/plugins"
build() {  # build DIR OUTDIR
  echo "== $1"
  # egg-info and build/ left by a build in the source tree would leak into the next one
  rm -rf "$1/build"
  "$PY" -m build --no-isolation --sdist --wheel --outdir "$2" "$1" >/dev/null
  rm -rf "$1/build"
}
build . "$OUT"
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] || continue
  build "${p%/}" "$OUT/plugins"
done
"$PY" -m twine check --strict "$OUT"/*.whl "$OUT"/*.tar.gz "$OUT"/plugins/*.whl "$OUT"/plugins/*.tar.gz
echo "built: $(ls "$OUT"/*.whl "$OUT"/plugins/*.whl | wc -l) wheels, $(ls "$OUT"/*.tar.gz "$OUT"/plugins/*.tar.gz | wc -l) sdists in $OUT/"
