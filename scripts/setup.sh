#!/usr/bin/env bash
# Set up repsim on this machine: .venv (Python 3.11), torch + torchvision, the project with its
# dev extras, animal-mnist (without its tensorflow requirement) and, where apt is usable, the Debian
# packages (data, and chromium for the browser test). Idempotent: seconds when everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
TORCH_SPEC=${TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
DEBIAN_PACKAGES="dataset-fashion-mnist wordnet-base wordnet-sense-index chromium chromium-driver"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
TORCH_FREE_GB=${TORCH_FREE_GB:-9}  # the CUDA build of torch takes ~5.6 GB in the venv, plus its unpacked wheels

say() { printf 'setup: %s\n' "$*"; }

install_debian_packages() {
  local missing=()
  for pkg in $DEBIAN_PACKAGES; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
    say "installing Debian packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    say "warning: apt-get is not usable here; install ${missing[*]} yourself (Fashion-MNIST and WordNet need them)"
  fi
}

require_free_space() {  # require_free_space DIR GB
  local free_kb
  free_kb=$(df -Pk "$1" | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $(($2 * 1024 * 1024)) ]; then
    say "error: $(($free_kb / 1024 / 1024)) GB free in $1, installing torch needs about $2 GB there: free some space (or set TMPDIR to a larger disk) and rerun"
    exit 1
  fi
}

install_python_packages() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import torch, torchvision" 2>/dev/null; then
    require_free_space "$VENV" "$TORCH_FREE_GB"
    require_free_space "${TMPDIR:-/tmp}" 4
    say "installing $TORCH_SPEC"
    $PIP install --no-cache-dir $TORCH_SPEC
  fi
  local stamp="$VENV/.repsim-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! "$VENV/bin/python" -c "import repsim" 2>/dev/null; then
    say "installing repsim and its dependencies"
    $PIP install -e ".[dev]"
    touch "$stamp"
  fi
  if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('animal_mnist') is None)"; then
    say "installing animal-mnist (data only, without its tensorflow requirement)"
    $PIP install --no-deps animal-mnist
  fi
}

install_debian_packages
install_python_packages
