#!/usr/bin/env bash
# One prepared GPU run, in one command, within 10 minutes on one H200: install what the machine lacks from the wheels
# in .whl/ (benchmarks/gpu_wheels.sh makes them; the machine reaches no package index), run the `gpu`-marked tests
# (the CUDA host-sync test among them), then benchmarks/gpu.py's rows, and write OUT/gpu.json, OUT/gpu.md (the
# table) and OUT/gpu_check.log. Every stage has a time limit: a stage that fails or runs past it stops the run
# with a message naming it (exit 1), and a benchmark row that failed fails the check after the table is written.
#
#   bash benchmarks/gpu_check.sh [--out DIR]        # on the GPU machine; OUT defaults to $OUT, else gpu_check/
#   bash benchmarks/gpu_check.sh --smoke            # anywhere, CPU included: the same stages on tiny rows
#
# GPU_CHECK_ROWS overrides the benchmark rows (default: 125m 350m 1b 1b+tensorwise 1b+rowwise moe) and
# GPU_CHECK_STEPS the timed steps per row (default 6, after 3 warmup steps). PYTHON picks the interpreter (default:
# .venv/bin/python where it exists, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=0
out="${OUT:-gpu_check}"
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --out) out="${2:?--out needs a folder}"; shift ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--smoke] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"
export PYTHONUNBUFFERED=1
started=$SECONDS

say() { echo "gpu_check: $*" | tee -a "$log"; }
fail() { say "FAILED: $*"; exit 1; }

# stage NAME LIMIT_S COMMAND...: run COMMAND with a time limit, its output into the log; stop the check if it fails.
stage() {
  local name="$1" limit="$2" rc=0 t0=$SECONDS
  shift 2
  say "== $name (at most $limit s)"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$log" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then fail "$name ran past its $limit s limit"; fi
  if [ "$rc" -ne 0 ]; then fail "$name exited with status $rc"; fi
  say "== $name: ok in $((SECONDS - t0)) s"
}

imports="import torch, pydantic, tomli_w, datatrove, torchao.float8, lmforge"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "$imports" >/dev/null 2>&1; then
  [ -d .whl ] || fail "lmforge's dependencies do not import and there is no .whl/ to install them from (run benchmarks/gpu_wheels.sh where PyPI is reachable)"
  stage install 120 "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/lmforge-site .whl/*.whl
  export PYTHONPATH="/tmp/lmforge-site:$PYTHONPATH"
fi
stage imports 60 "$py" -c "$imports; print('torch', torch.__version__, '| torchao', torchao.__version__, '| pydantic', pydantic.__version__)"

device_check='
import sys, torch
if not torch.cuda.is_available():
    print("no CUDA device"); sys.exit(0 if sys.argv[1] == "1" else 1)
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
'
stage device 60 "$py" -c "$device_check" "$smoke"

stage gpu-tests 240 "$py" -m pytest -q -x -p no:cacheprovider -m gpu tests/unit

bench=("$py" benchmarks/gpu.py --json "$out/gpu.json" --markdown "$out/gpu.md")
if [ "$smoke" -eq 1 ]; then
  stage benchmark 300 "${bench[@]}" --smoke
else
  read -r -a rows <<< "${GPU_CHECK_ROWS:-125m 350m 1b 1b+tensorwise 1b+rowwise moe}"
  stage benchmark 480 "${bench[@]}" --rows "${rows[@]}" --steps "${GPU_CHECK_STEPS:-6}" --warmup 3 --timeout 100
fi

cat "$out/gpu.md" | tee -a "$log"
failed="$("$py" -c 'import json, sys; print(" ".join(r["size"] for r in json.load(open(sys.argv[1]))["rows"] if "error" in r))' "$out/gpu.json")"
[ -z "$failed" ] || fail "benchmark rows failed: $failed (their errors are in $out/gpu.json)"
say "all stages passed in $((SECONDS - started)) s; table in $out/gpu.md"
