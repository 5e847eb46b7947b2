#!/usr/bin/env bash
# One command for the GPU machine: the CUDA tests (`-m cuda`), the GPU benchmark and, with
# --full, the whole suite on the GPU; then a summary (device, pass/fail counts, numbers).
#
#   scripts/gpu-check.sh [--full] [--quick] [--only PHASE]... [--cpu-ok] [OUT_DIR]
#   scripts/gpu-check.sh --prepare        # on a machine with PyPI: pytest for a bare machine
#
# It uses the machine's own python3 ($PIPETORCH_GPU_PYTHON to change it) with pipetorch from
# this working tree on PYTHONPATH: nothing is installed, nothing is downloaded. Results go to
# OUT_DIR (default $OUT, else ./gpu-check-out): device.json, <phase>.xml (JUnit) and
# <phase>.log for the test phases, benchmark.json and benchmark.log, summary.json and
# summary.txt. Phases:
#   cuda      the CUDA tests (without gpt2's file when gpt2 is a phase of its own)
#   gpt2      a small random GPT-2 pipelined over 2 logical devices sharing the first GPU
#             (2 workers, PIPETORCH_NUM_DEVICES=1), against plain PyTorch on that GPU
#   bench     benchmarks/gpu.py
#   full      every test with PIPETORCH_DEVICE=cuda
#   memory, generate   benchmarks/memory.py and benchmarks/generate.py, where they exist
# Default: cuda and bench (up to 9 minutes). --quick: cuda, gpt2 and the benchmark's short
# run, within 8 minutes on one H100 (time limits 230 + 90 + 110 s). --full: every phase;
# where one command may run 10 minutes at most, run them as separate commands (`--only full`,
# `--only memory`, ...). Each phase runs under a time limit ($GPU_CHECK_TEST_TIMEOUT,
# $GPU_CHECK_GPT2_TIMEOUT, $GPU_CHECK_BENCH_TIMEOUT, $GPU_CHECK_FULL_TIMEOUT,
# $GPU_CHECK_EXTRA_TIMEOUT seconds). --cpu-ok: run even without a GPU (a smoke test of this
# script: the CUDA tests skip, the benchmarks run on the CPU). Exit status 0 when every phase
# passed.
#
# A machine whose python3 lacks pytest: run --prepare where PyPI is reachable; it installs
# pytest and pytest-timeout (pure Python) into .gpu-pytest/ (ignored by git), which this
# script puts on PYTHONPATH when it finds it. Carry that folder to the GPU machine. Without
# pytest the test phases are reported as not run (exit status 3) and the benchmarks still run.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PIPETORCH_GPU_PYTHON:-python3}"
PYTEST_DIR="$ROOT/.gpu-pytest"

full=0 quick=0 cpu_ok=0 prepare=0 only=() out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --full) full=1 ;;
    --quick) quick=1 ;;
    --cpu-ok) cpu_ok=1 ;;
    --prepare) prepare=1 ;;
    --only) shift; only+=("${1:?--only needs a phase: cuda, gpt2, bench, full, memory or generate}") ;;
    -h|--help) sed -n '2,33p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done

if [[ "$prepare" == 1 ]]; then
  # Pure-Python wheels only, for any Python >= 3.10 (tomli and exceptiongroup come along
  # for 3.10 and are never imported by newer ones).
  rm -rf "$PYTEST_DIR"
  "$PY" -m pip install -q --disable-pip-version-check --no-compile --target "$PYTEST_DIR" \
    --only-binary=:all: --python-version 3.10 --implementation py pytest pytest-timeout \
    || { echo "gpu-check: --prepare could not install pytest into $PYTEST_DIR" >&2; exit 1; }
  echo "gpu-check: pytest is in $PYTEST_DIR ($(du -sh "$PYTEST_DIR" | cut -f1)); carry it over"
  exit 0
fi

out="${out:-${OUT:-$ROOT/gpu-check-out}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu-check: $PY not found (set PIPETORCH_GPU_PYTHON)" >&2
  exit 2
fi
if ! "$PY" -c "import pytest" >/dev/null 2>&1 && [[ -d "$PYTEST_DIR/pytest" ]]; then
  export PYTHONPATH="$PYTHONPATH:$PYTEST_DIR"
fi

"$PY" - "$out/device.json" <<'EOF'
import json, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
except ImportError as exc:
    info.update(error=f"torch cannot be imported: {exc}", gpus=0)
else:
    info.update(torch=torch.__version__, cuda=torch.version.cuda,
                gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if info["gpus"]:
        info["name"] = torch.cuda.get_device_name(0)
        info["memory"] = torch.cuda.get_device_properties(0).total_memory
    else:
        info["name"] = "no CUDA GPU visible to torch"
for module in ("pytest", "pytest_timeout", "transformers", "sklearn", "tqdm", "numpy",
               "cloudpickle"):
    try:
        info[module] = getattr(__import__(module), "__version__", "present")
    except ImportError:
        info[module] = None
json.dump(info, open(sys.argv[1], "w"), indent=1)
EOF
read -r gpus torch_error < <("$PY" -c "import json,sys; d=json.load(open(sys.argv[1]))
print(d.get('gpus', 0), d.get('error', ''))" "$out/device.json")
if [[ -n "$torch_error" ]]; then
  echo "gpu-check: $PY: $torch_error" >&2
  exit 2
fi
if [[ "$gpus" == 0 && "$cpu_ok" == 0 ]]; then
  echo "gpu-check: no CUDA GPU visible to $PY ($(cat "$out/device.json" | tr -d '\n'))" >&2
  echo "gpu-check: use --cpu-ok to run the script anyway (the CUDA tests then skip)" >&2
  exit 2
fi
device=cuda
[[ "$gpus" == 0 ]] && device=cpu
has_pytest=1
if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
  has_pytest=0
  echo "gpu-check: pytest is not installed for $PY: the test phases cannot run. Run" \
       "'scripts/gpu-check.sh --prepare' on a machine with PyPI and carry .gpu-pytest/" >&2
fi

phases=()
if [[ ${#only[@]} -gt 0 ]]; then phases=("${only[@]}")
elif [[ "$full" == 1 ]]; then
  phases=(cuda gpt2 bench full)
  for extra in memory generate; do [[ -f "benchmarks/$extra.py" ]] && phases+=("$extra"); done
elif [[ "$quick" == 1 ]]; then phases=(cuda gpt2 bench)
else phases=(cuda bench)
fi
gpt2_test=tests/gpu/test_gpu_gpt2.py
cuda_args=(tests -m cuda)
[[ " ${phases[*]} " == *" gpt2 "* ]] && cuda_args+=(--ignore="$gpt2_test")
test_limit="${GPU_CHECK_TEST_TIMEOUT:-360}" bench_limit="${GPU_CHECK_BENCH_TIMEOUT:-180}"
if [[ "$quick" == 1 ]]; then
  test_limit="${GPU_CHECK_TEST_TIMEOUT:-230}" bench_limit="${GPU_CHECK_BENCH_TIMEOUT:-110}"
fi

declare -A status
run_tests() {  # phase, timeout, pytest arguments...
  local phase="$1" limit="$2"; shift 2
  if [[ "$has_pytest" == 0 ]]; then status[$phase]=3; return; fi
  echo "gpu-check: $phase tests (log: $out/$phase.log)"
  PIPETORCH_DEVICE="$device" timeout -k 10 "$limit" "$PY" -m pytest "$@" -q -rfEs \
    -p no:cacheprovider --junitxml="$out/$phase.xml" >"$out/$phase.log" 2>&1
  status[$phase]=$?
  tail -n 3 "$out/$phase.log"
}
run_script() {  # phase, timeout, log, script and its arguments...
  local phase="$1" limit="$2" log="$3"; shift 3
  if [[ ! -f "$1" ]]; then
    echo "gpu-check: $1 does not exist here" >"$log"; status[$phase]=127; return
  fi
  echo "gpu-check: $phase (log: $log)"
  PIPETORCH_DEVICE="$device" timeout -k 10 "$limit" "$PY" "$@" >"$log" 2>&1
  status[$phase]=$?
}
for phase in "${phases[@]}"; do
  case "$phase" in
    cuda) run_tests cuda "$test_limit" "${cuda_args[@]}" ;;
    gpt2) PIPETORCH_NUM_DEVICES=1 run_tests gpt2 "${GPU_CHECK_GPT2_TIMEOUT:-90}" "$gpt2_test" ;;
    full) run_tests full "${GPU_CHECK_FULL_TIMEOUT:-540}" tests ;;
    bench)
      args=(--device "$device" --json "$out/benchmark.json")
      [[ "$quick" == 1 ]] && args+=(--quick)
      run_script bench "$bench_limit" "$out/benchmark.log" benchmarks/gpu.py "${args[@]}" ;;
    memory|generate)
      args=(); [[ "$quick" == 1 ]] && args+=(--quick)
      run_script "$phase" "${GPU_CHECK_EXTRA_TIMEOUT:-300}" "$out/$phase.log" \
        "benchmarks/$phase.py" ${args[@]+"${args[@]}"} ;;
    *) echo "gpu-check: unknown phase $phase (cuda, gpt2, bench, full, memory or generate)" >&2
       exit 2 ;;
  esac
done

codes=(); for phase in "${phases[@]}"; do codes+=("$phase=${status[$phase]}"); done
"$PY" -c 'import json, sys
json.dump({k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}, open(sys.argv[1], "w"))' \
  "$out/phases.json" "${codes[@]}"
"$PY" scripts/gpu_summary.py "$out"
