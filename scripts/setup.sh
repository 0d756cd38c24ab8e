#!/usr/bin/env bash
# Set up repsim on this machine: .venv (Python 3.11), torch + torchvision, the project with its
# dev extras and one FAISS build, animal-mnist (without its tensorflow requirement) and, where apt is
# usable, the Debian packages (data, and chromium for the browser test). Every Python package is
# installed at the version constraints.txt pins (the tested set; the worker image uses it too).
# Idempotent: seconds when everything is there.
#   bash scripts/setup.sh            set up (FAISS=gpu: faiss-gpu-cu12 instead of faiss-cpu)
#   bash scripts/setup.sh --freeze   rewrite constraints.txt from .venv, once a new set has passed the tests
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
CONSTRAINTS=${CONSTRAINTS:-constraints.txt}
FAISS=${FAISS:-cpu}  # the FAISS build: cpu (faiss-cpu) or gpu (faiss-gpu-cu12); they install the same module
DEBIAN_PACKAGES="dataset-fashion-mnist wordnet-base wordnet-sense-index chromium chromium-driver"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
FROZEN_MARK="# frozen from the tested .venv by scripts/setup.sh --freeze:"
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

faiss_distribution() {  # the PyPI distribution of a FAISS build name
  case $1 in
    cpu) echo faiss-cpu ;;
    gpu) echo faiss-gpu-cu12 ;;
    *) say "error: FAISS must be cpu or gpu, not '$1'"; exit 2 ;;
  esac
}

install_python_packages() {
  local faiss other stamp="$VENV/.repsim-installed"
  faiss=$(faiss_distribution "$FAISS")
  other=$(faiss_distribution "$([ "$FAISS" = cpu ] && echo gpu || echo cpu)")
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import torch, torchvision" 2>/dev/null; then
    require_free_space "$VENV" "$TORCH_FREE_GB"
    require_free_space "${TMPDIR:-/tmp}" 4
    say "installing torch and torchvision as $CONSTRAINTS pins them"
    $PIP install --no-cache-dir -c "$CONSTRAINTS" torch torchvision
  fi
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$FAISS" ] || [ pyproject.toml -nt "$stamp" ] ||
     [ "$CONSTRAINTS" -nt "$stamp" ] || ! "$VENV/bin/python" -c "import repsim" 2>/dev/null; then
    if $PIP show "$other" >/dev/null 2>&1; then  # removed first: uninstalling it later would delete the shared module
      say "removing $other: $faiss replaces it"
      $PIP uninstall -y "$other"
    fi
    say "installing repsim with $faiss and its dependencies as $CONSTRAINTS pins them"
    $PIP install -c "$CONSTRAINTS" -e ".[dev,$FAISS]"
    echo "$FAISS" >"$stamp"
  fi
  if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('animal_mnist') is None)"; then
    say "installing animal-mnist (data only, without its tensorflow requirement)"
    $PIP install -c "$CONSTRAINTS" --no-deps animal-mnist
  fi
}

freeze_constraints() {  # keep the hand-written head of $CONSTRAINTS, refreeze what follows its mark
  local head pinned
  head=$(awk -v mark="$FROZEN_MARK" 'index($0, mark) == 1 {exit} {print}' "$CONSTRAINTS")
  pinned=$(printf '%s\n' "$head" | sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' | paste -sd '|')
  { printf '%s\n%s\n' "$head" "$FROZEN_MARK"
    $PIP freeze --exclude-editable | grep -viE "^(${pinned:-^})=="; } >"$CONSTRAINTS.new"
  mv "$CONSTRAINTS.new" "$CONSTRAINTS"
  say "$CONSTRAINTS: $(grep -c '==' "$CONSTRAINTS") pinned versions"
}

if [ "${1:-}" = "--freeze" ]; then
  freeze_constraints
  exit
fi

install_debian_packages
install_python_packages
