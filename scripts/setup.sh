#!/usr/bin/env bash
# Create the virtualenv (.venv, or $PIPETORCH_VENV) and install pipetorch with its demo, test
# and docs extras. Safe to run again: it does nothing when nothing that decides the install changed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${PIPETORCH_VENV:-.venv}"
TORCH_VERSION="2.13.0"
PY="$VENV/bin/python"

if nvidia-smi >/dev/null 2>&1; then gpu=1; else gpu=0; fi

if [[ ! -x "$PY" ]]; then
  echo "setup: creating virtualenv $VENV"
  python3 -m venv "$VENV"
fi

# The stamp records what the last successful install was made from; a match means the
# environment is already right and pip (seconds of resolving, an editable rebuild) is skipped.
stamp="$VENV/.pipetorch-setup"
want="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(b"".join(
    open(f, "rb").read() for f in sys.argv[1:])).hexdigest())' pyproject.toml scripts/setup.sh) gpu=$gpu"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if [[ "$gpu" == 1 ]]; then
  # PyPI's Linux torch is the CUDA build. `===` compares the version string exactly, so a
  # local 2.13.0+cpu wheel (which `==` accepts and which sorts above 2.13.0) cannot win, and
  # an installed CPU build is replaced.
  echo "setup: GPU found; installing torch==$TORCH_VERSION (CUDA build)"
  pip_install "torch===$TORCH_VERSION"
elif [[ "$(uname -s)" == Linux ]]; then
  # Plain torch==X on Linux pulls the CUDA build and ~3 GB of nvidia-* wheels; the +cpu
  # build never does. It comes from pip's configured sources (a local wheelhouse, a mirror)
  # when they hold it, else from PyTorch's CPU index.
  echo "setup: no GPU; installing torch==$TORCH_VERSION+cpu"
  if ! pip_install "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
    pip_install "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
else
  # macOS and Windows wheels on PyPI are CPU builds already.
  echo "setup: no GPU; installing torch==$TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
fi

echo "setup: installing pipetorch (editable) with the demo, test and docs extras"
pip_install -e ".[demo,test,docs]"
echo "$want" >"$stamp"
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
