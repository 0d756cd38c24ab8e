"""repsim doctor and --version: which FAISS build is installed (two are a problem), what torch and
FAISS see, the offline data, and whether the configured servers answer."""

from __future__ import annotations

import importlib.metadata
import socket

import pytest

from repsim import doctor
from repsim.flows.cli import main


def installed_as(monkeypatch, *distributions: str) -> None:
    """Pretend that ``distributions`` (each at version 1.0) are what provides the faiss module."""
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"faiss": list(distributions)})
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0")


def test_the_installed_faiss_build_is_named_with_the_gpus_it_sees():
    import faiss

    (build,) = doctor.faiss_builds()
    assert build == f"faiss-cpu {importlib.metadata.version('faiss-cpu')}"
    check = doctor.faiss_check()
    assert check.status == doctor.OK and check.detail.startswith(build)
    assert ("no GPU" in check.detail) == (faiss.get_num_gpus() == 0)


def test_two_faiss_builds_are_a_problem_that_says_how_to_keep_one(monkeypatch):
    installed_as(monkeypatch, "faiss-gpu-cu12", "faiss-cpu")
    check = doctor.faiss_check()
    assert check.status == doctor.PROBLEM
    assert check.detail == "faiss-cpu 1.0 and faiss-gpu-cu12 1.0 both install the module faiss"
    assert check.fix.startswith("pip uninstall -y faiss-cpu faiss-gpu-cu12, then pip install 'repsim[cpu]'")


def test_no_faiss_build_is_a_problem(monkeypatch):
    installed_as(monkeypatch)
    assert doctor.faiss_check().status == doctor.PROBLEM and "repsim[cpu]" in doctor.faiss_check().fix


def test_doctor_exits_1_on_a_problem_and_0_otherwise(monkeypatch, capsys):
    assert main(["doctor"]) == 0
    report = capsys.readouterr().out
    assert "faiss-cpu" in report and "problem" not in report
    installed_as(monkeypatch, "faiss-gpu-cu12", "faiss-cpu")
    assert main(["doctor"]) == 1
    assert "both install the module faiss" in capsys.readouterr().out


def test_missing_data_is_reported_with_its_fix_but_is_no_problem(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("repsim.similarity.wordnet.DEBIAN_WORDNET", tmp_path)
    [wordnet] = [check for check in doctor.data_checks() if check.name == "wordnet"]
    assert wordnet.status == doctor.MISSING and "apt-get install wordnet-base" in wordnet.fix
    assert main(["doctor"]) == 0


def test_a_configured_server_that_does_not_answer_is_a_problem(monkeypatch, capsys):
    with socket.socket() as bound_not_listening:
        bound_not_listening.bind(("127.0.0.1", 0))
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{bound_not_listening.getsockname()[1]}/api")
        assert main(["doctor"]) == 1
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("PREFECT_API_URL")]
    assert "problem" in line and "does not answer" in line and "make servers" in line


def test_version_names_repsim_torch_and_faiss(capsys):
    import torch

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"repsim {doctor.repsim.__version__} (torch {torch.__version__}")
    assert f"faiss-cpu {importlib.metadata.version('faiss-cpu')}" in line
