#!/usr/bin/env bash
# Download, into .whl/, the wheels of what lmforge needs and a bare GPU machine with PyTorch lacks (Python 3.12,
# x86_64 Linux): gpu_check.sh installs them from there without a package index. Run it where PyPI is reachable;
# the folder (about 25 MB) then travels with the working tree.
#
#   bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${1:-3.12}"
py=".venv/bin/python"
[ -x "$py" ] || py=python3
# Pinned to what this checkout's own environment runs, so the GPU machine tests the same versions.
packages=(pydantic pydantic-core annotated-types typing-inspection tomli-w datatrove dill loguru multiprocess torchao)
pins=()
for name in "${packages[@]}"; do
  version="$("$py" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')"
  if [ -z "$version" ]; then
    echo "gpu_wheels.sh: $name is not installed in $py's environment; install lmforge with '.[dev]' first" >&2
    exit 1
  fi
  pins+=("$name==$version")
done
rm -rf .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -d .whl "${pins[@]}"
echo "gpu_wheels.sh: $(ls .whl | wc -l) wheels in .whl/ ($(du -sh .whl | cut -f1)): ${pins[*]}"
