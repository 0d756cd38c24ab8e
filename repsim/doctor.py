"""What this installation has (``repsim doctor``): repsim, torch and its devices, the FAISS build, the offline
data and text model, and where runs are tracked. Only a broken core (no torch, no FAISS, two FAISS
builds) is a *problem*; absent data or models are *missing*, since repsim runs on the user's own data.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import repsim
from repsim.errors import RepsimError

OK, MISSING, PROBLEM = "ok", "missing", "problem"
FAISS_FIX = "pip install 'repsim[cpu]' (faiss-cpu), or 'repsim[gpu]' (faiss-gpu-cu12) on a CUDA 12 machine"


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, its status (ok, missing, problem), what was found, the fix."""

    name: str
    status: str
    detail: str
    fix: str = ""


def faiss_builds() -> list[str]:
    """The installed distributions that provide the ``faiss`` module, e.g. ``["faiss-cpu 1.15.1"]``."""
    names = sorted(set(importlib.metadata.packages_distributions().get("faiss", [])))
    return [f"{name} {importlib.metadata.version(name)}" for name in names]


def torch_check() -> Check:
    import torch

    devices = torch.cuda.device_count()
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    seen = ", ".join(torch.cuda.get_device_name(i) for i in range(devices)) or "no CUDA device"
    return Check("torch", OK, f"{torch.__version__} ({build}); {seen}")


def faiss_check() -> Check:
    builds = faiss_builds()
    if len(builds) > 1:
        names = [build.split()[0] for build in builds]
        return Check("faiss", PROBLEM, f"{' and '.join(builds)} both install the module faiss",
                     f"pip uninstall -y {' '.join(names)}, then {FAISS_FIX}")
    if not builds:
        return Check("faiss", PROBLEM, "no FAISS build is installed (neighbor lists, ASIF, SOP on a CPU)",
                     FAISS_FIX)
    try:
        import faiss
    except ImportError as err:
        return Check("faiss", PROBLEM, f"{builds[0]} is installed but does not import ({err})",
                     f"reinstall it: {FAISS_FIX}")
    return Check("faiss", OK, f"{builds[0]}; {_gpus(faiss.get_num_gpus())} for its indexes")


def _gpus(count: int) -> str:
    return f"{count} GPU{'s' * (count > 1)}" if count else "no GPU"


def file_check(name: str, path: Path, fix: str) -> Check:
    return Check(name, OK, str(path)) if path.exists() else Check(name, MISSING, f"{path} not found", fix)


def located(name: str, locate: Callable[[], Path]) -> Check:
    """OK with the path ``locate`` finds, or MISSING with the what and fix of the error it raises."""
    try:
        path = locate()
    except RepsimError as err:
        return Check(name, MISSING, err.what, err.fix)
    return Check(name, OK, str(path))


def data_checks() -> list[Check]:
    """The offline data and text model that the shipped data specs and configs read."""
    from repsim.data import load_spec
    from repsim.data.sources import animal_mnist_root
    from repsim.similarity.captions import default_text_model
    from repsim.similarity.wordnet import DEBIAN_WORDNET, INSTALL_FIX

    fashion = Path(load_spec("fashion-mnist").source.root)
    return [file_check("wordnet", DEBIAN_WORDNET / "index.sense", INSTALL_FIX),
            file_check("fashion-mnist", fashion, "apt-get install dataset-fashion-mnist"),
            located("animal-mnist", animal_mnist_root),
            located("text model", default_text_model)]


def tracking_checks() -> list[Check]:
    """Where runs go: the Prefect API and MLflow store the environment names, else the embedded ones."""
    from repsim.stage import repsim_home

    home = repsim_home()
    prefect = os.environ.get("PREFECT_API_URL") or f"a temporary local API, its database in {home / 'prefect'}"
    mlflow = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home / 'mlflow.db'}"
    return [Check("repsim home", OK, str(home)),
            Check("prefect", OK, f"{_version('prefect')}; {prefect}"),
            Check("mlflow", OK, f"{_version('mlflow')}; {mlflow}")]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def checks() -> list[Check]:
    return [Check("repsim", OK, f"{repsim.__version__} from {Path(repsim.__file__).parent}"), torch_check(),
            faiss_check(), *data_checks(), *tracking_checks()]


def version_line() -> str:
    """``repsim 0.1.0 (torch 2.14.1, no CUDA device; faiss-cpu 1.15.1, no GPU)``: what ``--version`` says."""
    import torch

    faiss = faiss_check()
    found = faiss.detail.removesuffix(" for its indexes").replace(";", ",") if faiss.status == OK else faiss.detail
    return f"repsim {repsim.__version__} (torch {torch.__version__}, {_gpus(torch.cuda.device_count())}; {found})"
