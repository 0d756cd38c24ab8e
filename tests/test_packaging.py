"""The wheel holds every module and the shipped YAML files; shipped files are found by name."""

import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml

from repsim.cli import main
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
def wheel_files(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(["bash", str(REPO / "scripts" / "check_wheel.sh"), "--build", str(out)], check=True)
    (wheel,) = out.glob("repsim-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_the_wheel_holds_every_module_and_shipped_file(wheel_files):
    expected = {f"{place}/{path.relative_to(REPO / folder).as_posix()}" for folder, (place, patterns) in TREE.items()
                for pattern in patterns for path in (REPO / folder).glob(pattern)}
    assert {"repsim/align/stage.py", "repsim/flows/align.py", "repsim/configs/defaults.yaml"} <= expected
    assert expected <= wheel_files, sorted(expected - wheel_files)


def test_the_wheel_claims_no_generic_top_level_names(wheel_files):
    top_level = {name.split("/")[0] for name in wheel_files}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"repsim"}


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
                                 "check the path, or name a shipped data spec: animal-mnist, fashion-mnist")


def test_loaders_take_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("xclr") == load_config(REPO / "configs" / "xclr.yaml")
    assert load_experiment("default") == load_experiment(REPO / "experiments" / "default.yaml")


def test_a_missing_packaged_default_is_an_error_naming_it(tmp_path, monkeypatch):
    config = tmp_path / "simclr.yaml"
    config.write_text(yaml.safe_dump({"method": {"name": "simclr"}, "data": {"spec": "spec.yaml"}}))
    monkeypatch.setattr("repsim.shipped.files", lambda package: tmp_path)
    with pytest.raises(SpecError, match=f"the packaged config {tmp_path / 'defaults.yaml'} is missing; reinstall"):
        load_config(config)
    assert load_config(config, defaults=None).method.name == "simclr"


# ---------------------------------------------------------------------------------------------
# The command line

@pytest.mark.parametrize(("argv", "expected"), [
    (["shard", "no-such-spec"], "error: data spec no-such-spec does not exist; check the path, or name a shipped "
                                "data spec: animal-mnist, fashion-mnist"),
    (["precompute", "all", "no-such-spec"], "error: data spec no-such-spec does not exist"),
    (["eval", "no-such-spec"], "error: data spec no-such-spec does not exist"),
    (["train", "no-such-config"], "error: config no-such-config does not exist; check the path, or name a shipped "
                                  "config: align_contrastive, clip, defaults,"),
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
