"""The command line: subcommands are listed, user mistakes are one line and exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from repsim.flows.cli import main

SPECS = Path(__file__).parent.parent / "data_specs"


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "shard" in out and "synsets" in out


@pytest.mark.slow
def test_synsets_lists_candidates_for_a_class_name(capsys):
    assert main(["synsets", "Ankle boot"]) == 0
    assert "boot.n.01" in capsys.readouterr().out
    assert main(["synsets", "qwzxv"]) == 2
    assert capsys.readouterr().err.startswith("error: WordNet has no noun for 'qwzxv'")


@pytest.mark.parametrize("edit", [
    lambda s: s.update(shuffle_sed=1),
    lambda s: s["source"].update(type="mnist"),
    lambda s: s["classes"].update(bear=None),
    lambda s: s["source"].update(type="image_folder", root="missing-folder"),
])
def test_spec_mistake_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, edit):
    monkeypatch.setenv("REPSIM_HOME", str(tmp_path / "home"))
    spec = yaml.safe_load((SPECS / "animal-mnist.yaml").read_text())
    edit(spec)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["shard", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(path) in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "home" / "artifacts").exists()


def test_console_script_reports_a_missing_spec_without_traceback(tmp_path):
    repsim = Path(sys.executable).parent / "repsim"
    done = subprocess.run([str(repsim), "shard", str(tmp_path / "nope.yaml")], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: data spec {tmp_path / 'nope.yaml'} does not exist; check the path, "
                                   "or name a shipped data spec: animal-mnist, animal-mnist-2000, animal-mnist-val, "
                                   "fashion-mnist, fashion-mnist-10k, fashion-mnist-10k-val, fashion-mnist-2000")


def test_help_lists_the_pipeline_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(command in out for command in ("run", "stages", "clean", "serve"))


@pytest.mark.parametrize(("experiment", "expected"), [
    ({"name": "x", "data": "missing.yaml", "stages": [{"kind": "evaluate"}]}, "data spec"),
    ({"name": "x", "data": "spec.yaml", "stages": [{"kind": "evaluate", "pixels": False}]},
     "a evaluate section needs a train section before it"),
])
def test_experiment_mistake_is_one_line_before_any_orchestration(tmp_path, repsim_home, capsys, experiment, expected):
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(experiment))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err
    assert not (repsim_home / "prefect").exists()


@pytest.mark.parametrize("text", ["nanh", "infd", "-1d", "0d", "0.0h", "1.5.d", "d", "1 d", "1", "7days", "1e3s"])
def test_clean_refuses_anything_but_a_positive_number_and_a_unit(text, repsim_home, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["clean", f"--older-than={text}", "--yes"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"repsim clean: error: argument --older-than: {text!r} is not a duration like 30m, 12h, 7d or 2w "
        "(a positive number, then s, m, h, d or w)")


@pytest.mark.parametrize(("text", "seconds"), [("30m", 1800), ("1.5d", 129600), ("2w", 1209600), ("45s", 45)])
def test_durations_are_a_number_times_its_unit(text, seconds):
    from repsim.flows.cli import duration

    assert duration(text) == seconds


def test_spread_without_a_server_says_how_to_start_one_for_this_repsim_home(repsim_home, capsys, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["run", "default", "--spread", "experiment/sweep-worker"]) == 2
    err = capsys.readouterr().err
    assert f"source {repsim_home.resolve() / 'servers' / 'env.sh'}" in err and err.count("\n") == 1


def test_prefects_lines_around_a_state_hook_are_dropped_and_the_hooks_own_line_kept():
    import logging

    from repsim.flows.cli import _keep_log_record

    def kept(message: str) -> bool:
        return _keep_log_record(logging.LogRecord("prefect.task_runs", logging.INFO, __file__, 1, message, None, None))

    assert not kept("Running hook 'summarize_if_cached' in response to entering state 'Cached'")
    assert not kept("Hook 'summarize_if_cached' finished running successfully")
    assert kept("shard: 10000 samples; found complete in the cache -> /home/artifacts/shard/b460615c")
    assert kept("Finished in state Cached(type=COMPLETED)")


def test_a_failing_stage_leaves_the_console_its_one_error_line_not_prefects_repeats_of_it():
    import io
    import logging

    from repsim.flows.cli import OneErrorLine, _keep_log_record
    from repsim.errors import StageError

    console = io.StringIO()
    handler = logging.StreamHandler(console)
    handler.addFilter(_keep_log_record)
    handler.addFilter(OneErrorLine())
    error = StageError("train: the loss is nan at step 3", "lower optim.lr")

    def emit(message: str, level: int = logging.ERROR, raised: BaseException | None = None) -> None:
        exc_info = (type(raised), raised, None) if raised else None
        handler.handle(logging.LogRecord("prefect.task_runs", level, __file__, 1, message, None, exc_info))
    emit("shard: 16 samples; built in 0.1 s -> /home/artifacts/shard/51aeb967", logging.INFO)
    emit(f"Task run failed with exception: {error!r} - Retries are exhausted", raised=error)
    emit(f"Finished in state Failed('Task run encountered an exception StageError: {error.args[0]}')")
    emit(f"Encountered exception during execution: {error!r}", raised=error)
    emit("Task run 'features' - Finished in state Failed('Task run encountered an exception KeyError: 3')")
    assert console.getvalue().splitlines() == [
        "shard: 16 samples; built in 0.1 s -> /home/artifacts/shard/51aeb967",
        "Task run 'features' - Finished in state Failed('Task run encountered an exception KeyError: 3')"]
