"""Server mode against real servers on loopback: `make servers`' script starts Prefect and MLflow,
`repsim serve` serves a deployment, a run triggered through the Prefect API with parameter
overrides (what the UI's "Run" does) is tracked in MLflow, a second run is all cache hits, and
headless Chromium renders both UIs' pages of the run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from e2e import REPO, free_port, isolated_env, tiny_experiment
from prefect.client.schemas.objects import FlowRun

pytestmark = [pytest.mark.slow, pytest.mark.orchestration]

DEPLOYMENT = "experiment/tiny"
OVERRIDE = "train.settings.optim.lr=0.002"


def read_env_file(path: Path) -> dict[str, str]:
    """``export NAME=value`` lines as a mapping."""
    return dict(line.removeprefix("export ").split("=", 1) for line in path.read_text().splitlines())


def process_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(int(entry.name)) == pgid:
                found.append(int(entry.name))
    return found


@pytest.fixture
def servers(tmp_path) -> Iterator[dict[str, str]]:
    """Both servers started by scripts/servers.sh on free ports; the environment that points at them."""
    home = tmp_path / "servers-home"
    env = isolated_env(home) | {"PREFECT_PORT": str(free_port()), "MLFLOW_PORT": str(free_port())}
    script = [str(REPO / "scripts" / "servers.sh")]
    started = subprocess.run([*script, "start"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        pids = [int((home / "servers" / f"{name}.pid").read_text()) for name in ("prefect", "mlflow")]
        assert len(process_group(pids[1])) <= 2, "MLflow started its job runner"  # its CLI and one uvicorn worker
        yield env | read_env_file(home / "servers" / "env.sh")
    finally:
        stopped = subprocess.run([*script, "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "a server outlived servers-stop"


@pytest.mark.parametrize("command", ["ui", "start"])
def test_a_taken_port_stops_both_uis_before_either_starts(tmp_path, command):
    home = tmp_path / "home"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        env = isolated_env(home) | {"MLFLOW_PORT": str(port), "PREFECT_PORT": str(free_port())}
        done = subprocess.run(["bash", str(REPO / "scripts" / "servers.sh"), command], env=env, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 1 and done.stdout.count("\n") == 1
    assert f"port {port} for the mlflow UI is taken" in done.stdout and "set MLFLOW_PORT" in done.stdout
    assert not list(home.rglob("*.pid"))  # neither server was started


def test_serve_without_a_server_says_its_api_is_temporary(tmp_path, monkeypatch, capsys):
    from repsim.flows.cli import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr("repsim.flows.serve.serve_deployments", lambda path: None)
    monkeypatch.setattr("repsim.tasks.settings.start_embedded_stores", lambda: None)
    assert main(["serve"]) == 0
    err = capsys.readouterr().err
    assert "temporary API that the Prefect UI and other processes cannot reach" in err and "make servers" in err


def test_the_temporary_api_gets_repsims_startup_timeout_though_prefect_was_imported_first(tmp_path, monkeypatch):
    from prefect.server.api.server import SubprocessASGIServer

    from repsim.tasks.settings import start_embedded_stores, use_embedded_defaults

    monkeypatch.setenv("REPSIM_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "97")
    use_embedded_defaults()  # what every command does first
    timeouts = []
    monkeypatch.setattr(SubprocessASGIServer, "start", lambda server, timeout=None: timeouts.append(timeout))
    start_embedded_stores()
    assert timeouts == [97]  # Prefect's own setting, read at its import, would say 20


@pytest.fixture
def served(servers, tmp_path, make_image_folder, write_spec) -> Iterator[dict[str, str]]:
    """`repsim serve` of a deployment of a tiny experiment (with a nightly cron schedule), its runner's
    health endpoint on (as the compose worker's health check reads it) at ``RUNNER_HEALTH``."""
    folder = tmp_path
    experiment = tiny_experiment(folder, make_image_folder, write_spec)
    deployments = folder / "deployments.yaml"
    deployments.write_text(yaml.safe_dump({"deployments": [
        {"name": "tiny", "experiment": str(experiment), "cron": "0 3 * * *", "description": "tiny"}]}))
    runner_port = free_port()
    env = servers | {"REPSIM_HOME": str(folder / "worker-home"), "PREFECT_RUNNER_SERVER_ENABLE": "true",
                     "PREFECT_RUNNER_SERVER_PORT": str(runner_port)}
    with open(folder / "serve.log", "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "repsim.flows.cli", "serve", str(deployments)], env=env,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 180
            while not deployment_id(servers):
                assert serve.poll() is None and time.time() < deadline, (folder / "serve.log").read_text()
                time.sleep(2)
            yield servers | {"RUNNER_HEALTH": f"http://127.0.0.1:{runner_port}/health"}
        finally:
            os.killpg(serve.pid, signal.SIGINT)
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()


def api(base: str, path: str, body: dict | None = None) -> dict | list:
    """JSON from a GET (or, with ``body``, a POST) to a server's REST API."""
    request = urllib.request.Request(f"{base}{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def answers(url: str, seconds: float = 60) -> int:
    """The status ``url`` answers with, once it answers within ``seconds``."""
    deadline = time.time() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status
        except urllib.error.URLError:
            if time.time() > deadline:
                raise
            time.sleep(1)


def deployment_id(servers: dict[str, str]) -> str | None:
    try:
        return api(servers["PREFECT_API_URL"], f"/deployments/name/{DEPLOYMENT}")["id"]
    except urllib.error.HTTPError:
        return None


def trigger(servers: dict[str, str]) -> FlowRun:
    """Run the deployment with an override through the Prefect client, and wait for it."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: servers["PREFECT_API_URL"]}):
        return run_deployment(DEPLOYMENT, parameters={"overrides": [OVERRIDE]}, timeout=600, poll_interval=2)


def mlflow_runs(servers: dict[str, str], flow_run_id: str) -> tuple[dict, list[dict]]:
    """The parent MLflow run of a Prefect flow run and its nested stage runs, through the REST API."""
    base = f"{servers['MLFLOW_TRACKING_URI']}/api/2.0/mlflow"
    experiment = api(base, "/experiments/get-by-name?experiment_name=repsim")["experiment"]["experiment_id"]
    runs = api(base, "/runs/search", {"experiment_ids": [experiment], "max_results": 100,
                                      "filter": f"tags.`prefect.flow_run_id` = '{flow_run_id}'"})["runs"]
    runs = [run | {"tags": {tag["key"]: tag["value"] for tag in run["data"].get("tags", [])}} for run in runs]
    [parent] = [run for run in runs if run["tags"].get("repsim.flow") == "experiment"]
    return parent, [run for run in runs if run["tags"].get("mlflow.parentRunId") == parent["info"]["run_id"]]


def test_triggered_runs_are_tracked_and_then_cached(served, tmp_path):
    assert answers(served["RUNNER_HEALTH"]) == 200  # what the compose worker's health check reads
    first = trigger(served)
    assert first.state.is_completed(), first.state
    parent, stages = mlflow_runs(served, str(first.id))
    params = {param["key"]: param["value"] for param in parent["data"]["params"]}
    assert OVERRIDE in params["overrides"] and parent["info"]["status"] == "FINISHED"
    assert sorted(run["tags"]["repsim.stage"] for run in stages) == sorted(
        ["shard", "wordnet", "train", "features", "features", "evaluate", "features", "features", "evaluate"])
    assert {run["tags"]["repsim.cached"] for run in stages} == {"false"}
    [train] = [run for run in stages if run["tags"]["repsim.stage"] == "train"]
    train_params = {param["key"]: param["value"] for param in train["data"]["params"]}
    assert train_params["config.optim.lr"] == "0.002"
    assert {metric["key"] for metric in train["data"]["metrics"]} >= {"loss", "lr", "last_epoch_loss"}
    base = f"{served['MLFLOW_TRACKING_URI']}/api/2.0/mlflow"
    artifacts = api(base, f"/artifacts/list?run_id={train['info']['run_id']}")["files"]
    assert {entry["path"] for entry in artifacts} == {"metrics.jsonl", "stage.json"}  # the weights: in the model alone
    metrics = {metric["key"] for metric in parent["data"]["metrics"]}
    assert {"supcon.knn_top1_k3", "pixels.knn_top1_k3"} <= metrics

    second = trigger(served)
    assert second.state.is_completed(), second.state
    _, again = mlflow_runs(served, str(second.id))
    assert len(again) == len(stages) and {run["tags"]["repsim.cached"] for run in again} == {"true"}

    deployment = api(served["PREFECT_API_URL"], f"/deployments/name/{DEPLOYMENT}")
    assert [schedule["schedule"]["cron"] for schedule in deployment["schedules"]] == ["0 3 * * *"]
    screenshots(served, first, parent, train, tmp_path / "screenshots")


def screenshots(servers: dict[str, str], flow_run: FlowRun, parent: dict, train: dict, default_folder: Path) -> None:
    """Headless Chromium opens, in the Prefect UI, the flow run and its results artifact and, in the MLflow
    UI, the runs page repsim links to (in its model-training view, its Run Name column widened), the
    parent run, its results table and the encoder the train run registered; waits until each
    page shows what it is about (the run's name or id, the results artifact, a metric column, the
    model's first version), and saves a screenshot of each."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("the browser check needs Debian's chromium and chromium-driver (scripts/setup.sh installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser check needs selenium (dev extras)")
    from repsim.flows.experiment import RESULTS_TABLE
    from repsim.tasks.tracking import run_link, runs_page

    folder = Path(os.environ.get("REPSIM_TEST_ARTIFACTS") or default_folder)
    folder.mkdir(parents=True, exist_ok=True)
    mlflow = servers["MLFLOW_TRACKING_URI"]
    query = urllib.parse.quote(f"run_id = '{train['info']['run_id']}'")
    [model] = api(f"{mlflow}/api/2.0/mlflow", f"/model-versions/search?filter={query}")["model_versions"]
    [artifact] = api(servers["PREFECT_API_URL"], "/artifacts/filter", {
        "artifacts": {"key": {"any_": ["tiny-results"]}, "flow_run_id": {"any_": [str(flow_run.id)]}}})
    prefect = servers["PREFECT_API_URL"].removesuffix("/api")
    run = parent["info"]
    mlflow_run = f"{mlflow}/{run_link(run['experiment_id'], run['run_id'])}"  # as repsim links it: model training
    pages = {"prefect-flow-run.png": (f"{prefect}/runs/flow-run/{flow_run.id}", flow_run.name),
             "prefect-results-artifact.png": (f"{prefect}/artifacts/artifact/{artifact['id']}", "kNN@3"),
             "mlflow-runs.png": (runs_page(mlflow, run["experiment_id"]), "Run Name"),  # the link repsim prints
             "mlflow-run.png": (mlflow_run, run["run_id"]),
             "mlflow-results-table.png": (f"{mlflow}/#/experiments/{run['experiment_id']}/runs/{run['run_id']}"
                                          f"/artifacts/{RESULTS_TABLE}", "knn_top1_k3"),
             "mlflow-registered-model.png": (f"{mlflow}/#/models/{model['name']}", "Version 1")}
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    try:
        for name, (url, expected) in pages.items():
            browser.get(url)
            deadline = time.time() + 120
            while expected not in browser.find_element("tag name", "body").text and time.time() < deadline:
                time.sleep(1)
            cut_off = stage_names_cut_off(browser, deadline) if name == "mlflow-runs.png" else []
            browser.save_screenshot(str(folder / name))
            assert expected in browser.find_element("tag name", "body").text, f"{url} does not show {expected!r}"
            if name == "mlflow-runs.png":  # the view's first column after the name: the headline result
                shown = browser.find_element("tag name", "body").text
                assert "knn_top1_k3" in shown, shown[:2000]
            assert not cut_off, f"{url} cuts off the run names {cut_off}"
    finally:
        browser.quit()
    print(f"screenshots of the Prefect and MLflow pages of the run: {folder}")


def stage_names_cut_off(browser, deadline: float) -> list[str]:
    """On the MLflow runs page open in ``browser``: once the saved view has widened the Run Name column,
    open the newest parent run's stage runs; the run names that do not fit their cells."""
    from repsim.tasks.tracking import RUN_NAME_COLUMN, RUN_NAME_WIDTH

    cells = f"[col-id='{RUN_NAME_COLUMN}']"
    widths = f"return [...document.querySelectorAll(\"{cells}\")].map(cell => cell.offsetWidth)"
    while set(browser.execute_script(widths)) != {RUN_NAME_WIDTH} and time.time() < deadline:
        time.sleep(1)  # the view's width applies once the table is drawn
    browser.execute_script(f"document.querySelector(\"{cells} button\").click()")  # the first parent's expander
    names = f"return [...document.querySelectorAll(\"{cells} a\")]"
    while len(browser.execute_script(names)) < 3 and time.time() < deadline:
        time.sleep(1)
    return browser.execute_script(f"{names}.filter(name => name.getBoundingClientRect().right > "
                                  "name.closest('[col-id]').getBoundingClientRect().right).map(name => name.textContent)")


def test_sweep_members_run_on_the_deployments_workers_and_the_table_collects_them(served, tmp_path):
    """`repsim run --spread` hands each member to the processes serving the deployment; the sweep's
    own run then finds every stage cached in the shared REPSIM_HOME and aggregates the seeds."""
    experiment = yaml.safe_load((tmp_path / "tiny.yaml").read_text()) | {"seeds": [0, 1]}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(experiment))
    env = served | {"REPSIM_HOME": str(tmp_path / "worker-home")}
    done = subprocess.run([sys.executable, "-m", "repsim.flows.cli", "run", str(tmp_path / "sweep.yaml"),
                           "--spread", DEPLOYMENT], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    stages, table = done.stdout.split("\n\n")[:2]  # no MLflow "View run" lines before them
    assert {line.split()[-2] for line in stages.splitlines()[2:]} == {"yes"}, done.stdout  # built by the members
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["pixels", "supcon"]
    assert table.splitlines()[3].endswith("(2)")  # two seeds
    runs = api(served["PREFECT_API_URL"], "/flow_runs/filter",
               {"deployments": {"id": {"any_": [deployment_id(served)]}}})
    assert sorted((run["name"], run["state_type"]) for run in runs if run["state_type"] != "SCHEDULED") == [
        ("tiny seed=0", "COMPLETED"), ("tiny seed=1", "COMPLETED")]  # not the nightly runs the cron scheduled


def test_spread_without_a_server_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "repsim.flows.cli", "run", "default", "--spread", DEPLOYMENT],
                          env=isolated_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--spread runs members on the workers of a Prefect server" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
