"""The wheel holds every module and the shipped YAML files, shipped files are found by name, FAISS comes
from one of two extras, and the environment is the tested set of versions in constraints.txt."""

import importlib.metadata
import re
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

import repsim
from repsim.flows.cli import main
from repsim.errors import SpecError
from repsim.experiment import load_experiment
from repsim.methods.config import load_config
from repsim.shipped import locate, shipped

REPO = Path(__file__).parent.parent
TREE = {  # folder of the checkout: (its place in the wheel, the files it ships)
    "repsim": ("repsim", ("**/*.py",)), "tasks": ("repsim/tasks", ("*.py",)), "flows": ("repsim/flows", ("*.py",)),
    "configs": ("repsim/configs", ("*.py", "*.yaml")), "experiments": ("repsim/experiments", ("*.py", "*.yaml")),
    "data_specs": ("repsim/data_specs", ("*.py", "*.yaml"))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(["bash", str(REPO / "scripts" / "check_wheel.sh"), "--build", str(out)], check=True)
    (path,) = out.glob("repsim-*.whl")
    return zipfile.ZipFile(path)


@pytest.fixture(scope="module")
def wheel_files(wheel) -> set[str]:
    return set(wheel.namelist())


def test_the_wheel_holds_every_module_and_shipped_file(wheel_files):
    expected = {f"{place}/{path.relative_to(REPO / folder).as_posix()}" for folder, (place, patterns) in TREE.items()
                for pattern in patterns for path in (REPO / folder).glob(pattern)}
    assert {"repsim/align/stage.py", "repsim/flows/experiment.py", "repsim/configs/xclr.yaml"} <= expected
    assert expected <= wheel_files, sorted(expected - wheel_files)


def test_the_wheel_claims_no_generic_top_level_names(wheel_files):
    top_level = {name.split("/")[0] for name in wheel_files}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"repsim"}


def test_faiss_comes_from_exactly_one_extra_of_two(wheel):
    metadata = wheel.read(f"repsim-{repsim.__version__}.dist-info/METADATA").decode()
    faiss = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines()
             if line.startswith("Requires-Dist: faiss")]
    assert sorted(faiss) == ['faiss-cpu>=1.8; extra == "cpu"', 'faiss-gpu-cu12>=1.8; extra == "gpu"']
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [need for need in project["dependencies"] + project["optional-dependencies"]["dev"] if "faiss" in need]


# ---------------------------------------------------------------------------------------------
# The tested set of versions

def pins() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_the_environment_is_the_tested_set_of_versions():
    installed = {canonical(dist.metadata["Name"]): dist.version for dist in importlib.metadata.distributions()}
    wrong = {name: (version, installed[canonical(name)]) for name, version in pins().items()
             if canonical(name) in installed and installed[canonical(name)].split("+")[0] != version.split("+")[0]}
    assert not wrong, f"installed versions differ from constraints.txt (pinned, installed): {wrong}"
    assert {"torch", "torchvision", "prefect", "mlflow", "faiss-cpu", "faiss-gpu-cu12"} <= set(pins())


def test_setup_and_the_worker_image_install_from_the_same_constraints():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "CONSTRAINTS=${CONSTRAINTS:-constraints.txt}" in setup
    assert setup.count('-c "$CONSTRAINTS"') == 3  # torch, repsim with its extras, animal-mnist
    for dockerfile in ("repsim.Dockerfile", "mlflow.Dockerfile"):
        text = (REPO / "docker" / dockerfile).read_text()
        assert "COPY constraints.txt /tmp/constraints.txt" in text and "-c /tmp/constraints.txt" in text


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------
# Names

def test_a_bare_name_with_or_without_yaml_is_the_shipped_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("animal-mnist", "animal-mnist.yaml"):
        assert locate(name, "data spec").resolve() == (REPO / "data_specs" / "animal-mnist.yaml").resolve()
    assert set(shipped("experiment")) == {path.stem for path in (REPO / "experiments").glob("*.yaml")} >= {
        "default", "deployments", "reproduce-xclr"}


def test_an_existing_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("xclr.yaml").write_text("method: {name: simclr}\n")
    assert locate("xclr.yaml", "config") == Path("xclr.yaml")
    assert load_config("xclr.yaml").method.name == "simclr"
    assert load_config("xclr").method.name == "xclr"


def test_a_path_is_never_taken_for_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match="config configs/xclr.yaml does not exist"):
        locate("configs/xclr.yaml", "config")


def test_an_unknown_name_is_one_line_listing_the_shipped_names():
    with pytest.raises(SpecError) as raised:
        locate("no-such-spec", "data spec")
    assert str(raised.value) == ("data spec no-such-spec does not exist; "
                                 "check the path, or name a shipped data spec: animal-mnist, animal-mnist-2000, "
                                 "animal-mnist-val, fashion-mnist, fashion-mnist-10k, fashion-mnist-10k-val, fashion-mnist-2000")


def test_loaders_take_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("xclr") == load_config(REPO / "configs" / "xclr.yaml")
    assert load_experiment("default") == load_experiment(REPO / "experiments" / "default.yaml")


def test_defaults_live_in_the_config_models_alone(tmp_path):
    config = tmp_path / "simclr.yaml"
    config.write_text(yaml.safe_dump({"method": {"name": "simclr"}}))
    from repsim.methods.config import Config

    assert load_config(config) == Config.model_validate({"method": {"name": "simclr"}})
    assert not list((REPO / "configs").glob("default*"))


def test_a_missing_packaged_default_is_an_error_naming_it(tmp_path, monkeypatch):
    config = tmp_path / "simclr.yaml"
    config.write_text(yaml.safe_dump({"method": {"name": "simclr"}}))
    monkeypatch.setattr("repsim.shipped.files", lambda package: tmp_path)
    with pytest.raises(SpecError, match=f"the packaged data spec {tmp_path / 'animal-mnist.yaml'} is missing; reinstall"):
        load_config(config)
    config.write_text(yaml.safe_dump({"method": {"name": "simclr"}, "data": {"spec": "spec.yaml"}}))
    assert load_config(config).data.spec == tmp_path / "spec.yaml"


# ---------------------------------------------------------------------------------------------
# The command line

@pytest.mark.parametrize(("argv", "expected"), [
    (["shard", "no-such-spec"], "error: data spec no-such-spec does not exist; check the path, or name a shipped "
                                "data spec: animal-mnist, animal-mnist-2000, animal-mnist-val, fashion-mnist, fashion-mnist-10k, "
                                "fashion-mnist-10k-val, fashion-mnist-2000"),
    (["precompute", "all", "no-such-spec"], "error: data spec no-such-spec does not exist"),
    (["eval", "no-such-spec"], "error: data spec no-such-spec does not exist"),
    (["train", "no-such-config"], "error: config no-such-config does not exist; check the path, or name a shipped "
                                  "config: align_contrastive, clip, dino,"),
    (["serve", "no-such-file"], "name a shipped deployments file: default, deployments"),
    # shipped names found, then a later mistake, before any orchestration
    (["shard", "animal-mnist", "animal-mnist.yaml", "--out", "x"], "error: --out names one directory but several"),
    (["train", "xclr", "--set", "data.spec=nowhere.yaml"], "nowhere.yaml does not exist"),
    (["align", "gera", "--set", "geometry.samples=300"], "exceeds neighbors.count"),
    (["run", "default", "--set", "evaluate.knn_k=[0]"], "experiments/default.yaml with --set evaluate.knn_k=[0]"),
])
def test_cli_names_are_resolved_and_mistakes_are_one_line(tmp_path, monkeypatch, capsys, repsim_home, argv, expected):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err
    assert not (repsim_home / "prefect").exists()
