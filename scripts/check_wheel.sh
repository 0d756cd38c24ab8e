#!/usr/bin/env bash
# Check the wheel as users get it: build it from a copy of what the build reads (pyproject.toml,
# README.md and the folders of its package-dir; tracked and untracked files, not ignored ones),
# install it apart from the source tree (the venv's dependencies, none of the checkout), and from
# outside the repository import every repsim module, find every shipped YAML file by name, load
# the default experiment and the xclr config by name, and plan the default experiment.
#   scripts/check_wheel.sh                 the whole check
#   scripts/check_wheel.sh --build DIR     only build the wheel into DIR
set -euo pipefail
[ "${1:-}" = "--build" ] && set -- --build "$(realpath -m "$2")"  # DIR relative to where it was called
cd "$(dirname "$0")/.."
PY="$PWD/${VENV:-.venv}/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

build_wheel() {  # build_wheel DIR
  local folders
  folders=$("$PY" -c 'import tomllib
print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"].values())')
  mkdir "$work/source"
  git ls-files -z -co --exclude-standard -- pyproject.toml README.md $folders |
    tar --null -T - --ignore-failed-read -cf - | tar -xf - -C "$work/source"
  "$PY" -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation -q -w "$1" "$work/source"
}

if [ "${1:-}" = "--build" ]; then
  build_wheel "$2"
  exit
fi

build_wheel "$work/dist"
"$PY" -m pip install --disable-pip-version-check --no-deps -q --target "$work/site" "$work"/dist/repsim-*.whl
cd "$work"
PYTHONPATH="$work/site" "$PY" - "$work/site" <<'EOF'
import importlib
import pkgutil
import sys
from pathlib import Path

import repsim

site = Path(sys.argv[1])
print(f"check_wheel: repsim from {repsim.__file__}")
assert Path(repsim.__file__).is_relative_to(site), "repsim was not imported from the installed wheel"

modules = [module.name for module in pkgutil.walk_packages(repsim.__path__, "repsim.")]
for name in modules:
    importlib.import_module(name)
print(f"check_wheel: imported {len(modules)} modules")

from repsim.experiment import check_experiment, load_experiment
from repsim.methods.config import load_config
from repsim.shipped import FOLDERS, locate, shipped

for kind in FOLDERS:
    for name, path in shipped(kind).items():
        assert locate(name, kind) == path and path.is_relative_to(site), f"{kind} {name}: {path}"
    print(f"check_wheel: shipped {kind}s: {', '.join(shipped(kind))}")
experiment = load_experiment("default")
check_experiment(experiment)
assert experiment.data.is_relative_to(site), experiment.data
config = load_config("xclr")
assert config.data.spec.is_relative_to(site), config.data.spec
print("check_wheel: the default experiment and the xclr config load by name")
EOF
REPSIM_HOME="$work/home" PYTHONPATH="$work/site" "$PY" -m repsim.flows.cli run default --plan | tail -n 1 |
  sed 's/^/check_wheel: repsim run default --plan: /'
