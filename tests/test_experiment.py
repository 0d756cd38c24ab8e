"""Experiments: the YAML schema and its one-line errors, forced rebuilds, the stage lock, listing and
cleaning the artifact root, the server health check, and the experiment flow end to end."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e import REPO, flow_runs, isolated_env, repsim, tiny_experiment, write_experiment
from mlflow.tracking import MlflowClient

from repsim.flows.cli import main
from repsim.errors import SpecError
from repsim.device import TorchrunLaunch
from repsim.experiment import load_deployments, load_experiment, with_overrides
from repsim.stage import (COMPLETE, INCOMPLETE, LOCKED, Stage, list_outputs, read_record, Reuse, remove_output,
                          run_stage, unreferenced_outputs)

DAY = 86400


TRAIN = {"kind": "train", "methods": [{"config": str(REPO / "configs" / "supcon.yaml")}]}


# ---------------------------------------------------------------------------------------------
# Schema

def test_shipped_experiment_and_deployments_load():
    experiment = load_experiment(REPO / "experiments" / "default.yaml")
    assert [section.kind for section in experiment.stages] == ["precompute", "train", "evaluate", "align"]
    assert experiment.data == REPO / "data_specs" / "animal-mnist.yaml"
    assert experiment.section("evaluate").linear.model_dump() == {"weight_decays": [1e-4, 1e-3, 1e-2],
                                                                    "max_iter": 100}
    specs, experiments = load_deployments(REPO / "experiments" / "deployments.yaml")
    nightly = next(spec for spec in specs if spec.cron)
    assert experiments[specs.index(nightly)].section("train").settings["optim"]["epochs"] == 5


def test_overrides_address_sections_by_kind_and_reach_every_method_config(tmp_path):
    path = write_experiment(tmp_path, [{**TRAIN, "settings": {"optim": {"epochs": 2}}}])
    experiment = load_experiment(path, ["train.settings.optim.lr=0.01", "name=other"])
    train = experiment.section("train")
    assert experiment.name == "other" and experiment.data == tmp_path / "spec.yaml"
    assert train.overrides(train.methods[0], experiment.data) == [
        {"data": {"spec": str(tmp_path / "spec.yaml")}}, {"optim": {"epochs": 2, "lr": 0.01}}, {}]


@pytest.mark.parametrize(("stages", "overrides", "expected"), [
    ([{"kind": "evaluate", "linear": {"weight_decays": []}}], [], "weight_decays"),
    ([{**TRAIN, "epochs": 2}], [], "unknown field 'stages.epochs'"),
    ([{"kind": "finetune"}], [], "field 'stages.kind' is 'finetune', which is not known"),
    ([{"kind": "evaluate", "pixels": False}, TRAIN], [], "a evaluate section needs a train section before it"),
    ([TRAIN, TRAIN], [], "stage kind 'train' appears twice"),
    ([{**TRAIN, "launch": {"nnodes": 2}}], [], "several nodes meet at a rendezvous"),
    ([TRAIN], ["evaluate.suites=[knn]"], "the experiment has no field or section 'evaluate'"),
    ([TRAIN], ["train.methods"], "is not of the form key=value"),
])
def test_mistakes_are_one_line_errors_naming_the_file(tmp_path, stages, overrides, expected):
    path = write_experiment(tmp_path, stages)
    with pytest.raises(SpecError) as raised:
        load_experiment(path, overrides)
    assert expected in str(raised.value) and "\n" not in str(raised.value)
    assert str(path) in str(raised.value) or overrides


def test_override_values_are_validated_like_the_file(tmp_path):
    experiment = load_experiment(write_experiment(tmp_path, [TRAIN]))
    with pytest.raises(SpecError, match=r"--set train.launch.nproc_per_node=0: field 'stages.launch.nproc_per_node'"):
        with_overrides(experiment, ["train.launch.nproc_per_node=0"])


def test_torchrun_command_trains_directly_on_every_rank():
    single = TorchrunLaunch(nproc_per_node=2).command("c.yaml", ["optim.lr=0.1"])
    assert single[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert single[-7:] == ["-m", "repsim.flows.cli", "train", "c.yaml", "--set", "optim.lr=0.1", "--direct"]
    several = TorchrunLaunch(nnodes=2, rdzv_endpoint="head:29400").command("c.yaml", [])
    assert {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=head:29400"} <= set(several)
    assert not TorchrunLaunch().distributed and TorchrunLaunch(nnodes=2, rdzv_endpoint="h:1").distributed


# ---------------------------------------------------------------------------------------------
# Forced rebuilds, the stage lock, listing and cleaning

def build_writing(value, seen_during_build=None):
    def build(tmp):
        if seen_during_build is not None:  # what a reader of the final directory sees meanwhile
            seen_during_build.append((tmp.parent / tmp.name.split(".")[1] / "value.txt").read_text())
        (tmp / "value.txt").write_text(str(value))
    return build


def test_forced_stage_is_rebuilt_once_and_replaces_its_output_only_when_complete():
    stage = Stage("s", "1", {})
    first = run_stage(stage, build_writing(1))
    seen: list[str] = []
    forced = Reuse.forcing(["s"])
    second = run_stage(stage, build_writing(2, seen), reuse=forced)
    third = run_stage(stage, build_writing(3), reuse=forced)
    assert seen == ["1"]  # the old output stayed in place while the new one was built
    assert not second.cached and third.cached and second.path == first.path
    assert (first.path / "value.txt").read_text() == "2"
    assert run_stage(stage, build_writing(4)).cached
    assert sorted(path.name for path in first.path.parent.iterdir()) == [f".{first.path.name}.lock", first.path.name]


def test_a_rebuild_of_another_stage_leaves_this_one_cached():
    stage = Stage("s", "1", {})
    run_stage(stage, build_writing(1))
    assert run_stage(stage, build_writing(2), reuse=Reuse.forcing(["t"])).cached


def _build_slowly_in_process(home: str, counter: str) -> str:
    os.environ["REPSIM_HOME"] = home

    def build(tmp):
        with open(counter, "a") as handle:
            handle.write("built\n")
        time.sleep(1.0)
        (tmp / "value.txt").write_text("done")
    return str(run_stage(Stage("shared", "1", {}), build).path)


def test_concurrent_runs_of_one_stage_build_it_once_and_share_the_output(repsim_home, tmp_path):
    counter = tmp_path / "builds.txt"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        paths = pool.starmap(_build_slowly_in_process, [(str(repsim_home), str(counter))] * 3)
    assert len(set(paths)) == 1 and counter.read_text() == "built\n"
    assert (Path(paths[0]) / "value.txt").read_text() == "done" and read_record(Path(paths[0]))


def _hold_lock(home: str, ready, release) -> None:
    os.environ["REPSIM_HOME"] = home

    def build(tmp):
        ready.set()
        release.wait(30)
    run_stage(Stage("held", "1", {}), build)


@pytest.fixture
def stage_being_written(repsim_home):
    """A process that is writing stage "held" until the test ends."""
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    process = context.Process(target=_hold_lock, args=(str(repsim_home), ready, release))
    process.start()
    assert ready.wait(30)
    yield Stage("held", "1", {})
    release.set()
    process.join(30)


def age(path: Path, days: float) -> None:
    stamp = time.time() - days * DAY
    os.utime(path, (stamp, stamp))


def test_stages_lists_complete_incomplete_and_locked_outputs(repsim_home, stage_being_written, capsys):
    done = run_stage(Stage("s", "1", {}), build_writing(1))
    (done.path.parent / ".abc.tmp-1234").mkdir()
    scratch = repsim_home / "scratch" / "train" / "def"
    scratch.mkdir(parents=True)
    statuses = {(output.stage, output.key): output.status for output in list_outputs()}
    assert statuses == {("s", done.key): COMPLETE, ("s", "abc"): INCOMPLETE, ("train", "def"): INCOMPLETE,
                        ("held", stage_being_written.key): LOCKED}
    assert main(["stages", "s"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert sorted((row[0], row[1], row[2], row[-1]) for row in rows) == sorted([
        ("s", done.key, COMPLETE, str(done.path)), ("s", "abc", INCOMPLETE, str(done.path.parent / ".abc.tmp-1234"))])


def test_clean_removes_only_old_outputs_no_newer_output_depends_on(repsim_home, stage_being_written, capsys):
    old_input = run_stage(Stage("a", "1", {}), build_writing(1))           # old, read by a new output
    old_chain = run_stage(Stage("b", "1", {}, {"a": old_input.key}), build_writing(2))  # old, read by new
    run_stage(Stage("c", "1", {}, {"b": old_chain.key}), build_writing(3))              # new
    orphan = run_stage(Stage("a", "1", {"x": 1}), build_writing(4))        # old, read by nothing
    partial = orphan.path.parent / ".zzz.tmp-1"
    partial.mkdir()
    for path in (old_input.path / "stage.json", old_chain.path / "stage.json", orphan.path / "stage.json", partial):
        age(path, 10)
    age(repsim_home / "artifacts" / "held", 10)

    assert main(["clean", "--older-than", "7d"]) == 0  # a dry run
    assert "2 outputs to remove" in capsys.readouterr().out and orphan.path.exists() and partial.exists()
    assert {output.path for output in unreferenced_outputs(7 * DAY)} == {orphan.path, partial}
    assert main(["clean", "--older-than", "7d", "--yes"]) == 0
    assert "removed 2 outputs" in capsys.readouterr().out
    assert not orphan.path.exists() and not partial.exists()
    assert old_input.path.exists() and old_chain.path.exists()
    assert not remove_output(next(o for o in list_outputs() if o.stage == "held"))  # being written: stays


def test_clean_rejects_a_malformed_duration(capsys):
    with pytest.raises(SystemExit):
        main(["clean", "--older-than", "soon"])
    assert "'soon' is not a duration like 30m, 12h, 7d or 2w" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Server mode

def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_server_is_one_line_before_any_work(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/api"
    done = subprocess.run([sys.executable, "-m", "repsim.flows.cli", "run", str(REPO / "experiments" / "default.yaml")],
                          env=isolated_env(tmp_path / "home") | {"PREFECT_API_URL": url},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: PREFECT_API_URL={url} does not answer") and "make servers" in done.stderr
    assert not (tmp_path / "home" / "artifacts").exists()


def test_every_configured_server_is_checked(monkeypatch):
    from repsim.tasks.servers import ServerUnreachable, check_servers, health_urls

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    assert health_urls() == {}  # the embedded stores need no server
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    with pytest.raises(ServerUnreachable, match=f"MLFLOW_TRACKING_URI={url} does not answer at {url}/health"):
        check_servers(timeout=1)


# ---------------------------------------------------------------------------------------------
# The flow, end to end on the embedded defaults

@pytest.fixture
def tiny(make_image_folder, write_spec, tmp_path) -> Path:
    return tiny_experiment(tmp_path, make_image_folder, write_spec)


def stage_rows(stdout: str) -> list[tuple[str, str]]:
    """(stage, cached) of each row of the stage table that ``repsim run`` prints first."""
    table = stdout.split("\n\n")[0].splitlines()[2:]
    return [(line.split()[0], line.split()[-2]) for line in table]


@pytest.mark.slow
@pytest.mark.orchestration
def test_experiment_reruns_only_what_a_change_reaches(make_image_folder, write_spec, tmp_path):
    experiment, home = str(tiny_experiment(tmp_path, make_image_folder, write_spec, align=True)), tmp_path / "home"
    first = repsim(home, "run", experiment)
    assert first.returncode == 0, first.stderr
    assert stage_rows(first.stdout) == [("shard", "no"), ("wordnet", "no"), ("train", "no"),
                                        ("features", "no"), ("features", "no"), ("features", "no"),
                                        ("features", "no"), ("evaluate", "no"), ("evaluate", "no"), ("align", "no")]
    results = first.stdout.split("\n\n")[1].splitlines()
    assert results[0].split() == ["method", "kNN@3", "zero-shot"]  # the columns some row has
    assert [row.split()[0] for row in results[2:]] == ["pixels", "supcon"]
    assert results[2].split()[2] == "-" and results[3].split()[2] != "-"  # zero-shot through the alignment
    assert "make ui" in first.stdout

    again = repsim(home, "run", experiment)
    assert again.returncode == 0, again.stderr
    assert {cached for _, cached in stage_rows(again.stdout)} == {"yes"}

    changed = repsim(home, "run", experiment, "--set", "train.settings.optim.lr=0.002")
    assert changed.returncode == 0, changed.stderr
    assert stage_rows(changed.stdout) == [("shard", "yes"), ("wordnet", "yes"), ("train", "no"),
                                          ("features", "yes"), ("features", "yes"), ("features", "no"),
                                          ("features", "no"), ("evaluate", "yes"), ("evaluate", "no"), ("align", "no")]

    [trained] = [p for p in (home / "artifacts" / "train").iterdir() if p.name in changed.stdout and p.is_dir()]
    before = read_record(trained)["started"]
    forced = repsim(home, "run", experiment, "--set", "train.settings.optim.lr=0.002", "--force", "train")
    assert forced.returncode == 0, forced.stderr
    assert stage_rows(forced.stdout)[2] == ("train", "no") and read_record(trained)["started"] > before
    assert {cached for stage, cached in stage_rows(forced.stdout) if stage != "train"} == {"yes"}

    runs = flow_runs(home, "experiment")
    assert len(runs) == 4 and all(parent.info.status == "FINISHED" for parent, _ in runs)
    parent, stages = runs[0]
    assert sorted(run.data.tags["repsim.stage"] for run in stages) == sorted(
        ["shard", "wordnet", "train", "features", "features", "evaluate", "features", "features", "evaluate", "align"])
    assert {(run.data.tags["repsim.stage"], run.data.tags.get("repsim.encoder"), run.data.tags.get("repsim.method"))
            for run in stages} == {("shard", None, None), ("wordnet", None, None), ("train", "supcon", "supcon"),
                                   ("features", "pixels", None), ("features", "supcon", None),
                                   ("evaluate", "pixels", None), ("evaluate", "supcon", None), ("align", "supcon", None)}
    assert {"supcon.knn_top1_k3", "pixels.knn_top1_k3", "supcon.zeroshot_top1"} <= set(parent.data.metrics)
    assert json.loads(parent.data.params["overrides"].replace("'", '"')) == []
    assert parent.data.params["source"] == parent.data.params["experiment.name"]  # no name= override
    assert json.loads(runs[-1][0].data.params["overrides"].replace("'", '"')) == ["train.settings.optim.lr=0.002"]


@pytest.mark.slow
@pytest.mark.orchestration
def test_torchrun_launch_trains_on_two_gloo_processes_and_its_ranks_rebuild_a_forced_output(tiny, tmp_path):
    home = tmp_path / "home"
    launch = ["--set", "train.launch.nproc_per_node=2", "--set", "evaluate.pixels=false"]
    done = repsim(home, "run", str(tiny), *launch)
    assert done.returncode == 0, done.stderr
    [trained] = [p for p in (home / "artifacts" / "train").iterdir() if not p.name.startswith(".")]
    metrics = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]  # 8 train samples, global batch 4 over 2 ranks
    [(_, stages)] = flow_runs(home, "experiment")
    [train] = [run for run in stages if run.data.tags["repsim.stage"] == "train"]
    assert train.data.tags["repsim.cached"] == "false" and train.data.params["stage.steps"] == "2"
    started = read_record(trained)["started"]
    assert repsim(home, "run", str(tiny), *launch).returncode == 0 and read_record(trained)["started"] == started
    forced = repsim(home, "run", str(tiny), *launch, "--force", "train")
    assert forced.returncode == 0, forced.stderr
    assert read_record(trained)["started"] > started


@pytest.mark.slow
@pytest.mark.orchestration
def test_killed_run_resumes_from_the_last_stage_and_checkpoint(tiny, tmp_path, monkeypatch):
    home = tmp_path / "home"
    settings = ["--set", "train.settings.optim.epochs=40", "--set", "train.settings.optim.checkpoint_every=1",
                "--set", "evaluate.pixels=false"]
    killed = subprocess.Popen([sys.executable, "-m", "repsim.flows.cli", "run", str(tiny), *settings],
                              env=isolated_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.time() + 300
    while not list((home / "scratch" / "train").glob("*/checkpoint.pt")) and time.time() < deadline:
        assert killed.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(killed.pid, 9)
    killed.wait()
    monkeypatch.setenv("REPSIM_HOME", str(home))
    assert sorted((output.stage, output.status) for output in list_outputs()) == [  # the partial build and
        ("shard", COMPLETE), ("train", INCOMPLETE), ("train", INCOMPLETE), ("wordnet", COMPLETE)]  # its scratch

    resumed = repsim(home, "run", str(tiny), *settings, "--set", "train.settings.optim.checkpoint_every=0")  # only
    # the final checkpoint: the interval is not in the stage key, and 80 checkpoints of the ResNet are slow to write
    assert resumed.returncode == 0, resumed.stderr
    assert stage_rows(resumed.stdout)[:3] == [("shard", "yes"), ("wordnet", "yes"), ("train", "no")]
    [(_, _), (_, stages)] = flow_runs(home, "experiment")
    [train] = [run for run in stages if run.data.tags["repsim.stage"] == "train"]
    [trained] = [p for p in (home / "artifacts" / "train").iterdir() if not p.name.startswith(".")]
    steps = [json.loads(line)["step"] for line in (trained / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 81))  # 2 steps an epoch, none lost or repeated
    logged = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}").get_metric_history(train.info.run_id, "loss")
    assert logged[0].step > 1  # the resumed run started after the checkpoint, not from scratch
