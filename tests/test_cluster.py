"""Split stages on a real Dask cluster started here: a ``dask scheduler`` and ``dask worker`` processes on
127.0.0.1. The shard stage's bytes and key equal one process's for one worker and for three, survive a worker
killed mid-piece, and a lost scheduler ends the command in one line (exit 2) keeping the pieces done, which a
rerun reuses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from e2e import REPO, REPSIM, free_port, isolated_env, prefect_query, repsim, tiny_experiment
from repsim.data import load_spec
from repsim.data.stage import shard_stage
from repsim.errors import SpecError
from repsim.pieces import PIECE_FILE
from repsim.tasks.cluster import requested_cluster
from test_pieces import output_bytes

DASK = str(Path(sys.executable).parent / "dask")


class Cluster:
    """A scheduler and its workers, each a process group this test starts and stops."""

    def __init__(self, tmp_path: Path):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.logs = tmp_path / "dask-logs"
        self.logs.mkdir(exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, home: Path | None = None) -> None:
        """``dask ARGS`` as process ``name``; a worker with the ``home`` of the run it serves (and its stores)."""
        with open(self.logs / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen([DASK, *args], stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True, env=isolated_env(home) if home else None)

    def scheduler(self) -> None:
        self.start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", self.address.rsplit(":", 1)[1],
                   "--no-dashboard")

    def worker(self, name: str, home: Path, processes: int = 1, *options: str) -> None:
        self.start(name, "worker", self.address, "--nworkers", str(processes), "--nthreads", "1", "--no-dashboard",
                   "--host", "127.0.0.1", *options, home=home)

    def wait_for_workers(self, count: int) -> None:
        from distributed import Client

        with Client(self.address, timeout=60) as client:
            client.wait_for_workers(count, timeout=120)

    def kill(self, name: str) -> None:
        process = self.processes.pop(name)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def stop(self) -> None:
        for name in list(self.processes):
            self.kill(name)


@pytest.fixture
def cluster(tmp_path):
    started = Cluster(tmp_path)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def noisy_spec(tmp_path_factory) -> Path:
    """160 noise images of 96 × 96 in 16 tars of 10 (pieces of a fraction of a second each)."""
    tmp_path = tmp_path_factory.mktemp("noise")
    root = tmp_path / "noise"
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(80):
            pixels = np.random.default_rng([i, name == "dog"]).integers(0, 256, (96, 96, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{name}-{i:03d}.png")
    spec = tmp_path / "noise.yaml"
    spec.write_text(yaml.safe_dump({"name": "noise", "source": {"type": "image_folder", "root": str(root)},
                                    "classes": {"cat": "cat.n.01", "dog": "dog.n.01"}, "shard_size": 10,
                                    "split": {"type": "random", "fractions": {"train": 0.75, "test": 0.25}}}))
    return spec


@pytest.fixture(scope="module")
def alone(noisy_spec, tmp_path_factory) -> Path:
    """The shard output of ``noisy_spec`` from one process, no cluster."""
    return shard_with(tmp_path_factory.mktemp("alone"), noisy_spec)


def shard_output(home: Path, spec: Path) -> Path:
    return home / "artifacts" / "shard" / shard_stage(load_spec(spec)).key


def shard_with(home: Path, spec: Path, *cluster: str) -> Path:
    done = subprocess.run([REPSIM, "shard", str(spec), *cluster], capture_output=True, text=True,
                          env=isolated_env(home), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return shard_output(home, spec)


def started_shard(home: Path, spec: Path, cluster: str) -> subprocess.Popen:
    return subprocess.Popen([REPSIM, "shard", str(spec), "--cluster", cluster], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=isolated_env(home), start_new_session=True)


def pieces_done(home: Path, spec: Path) -> int:
    return len(list((home / "scratch" / "shard" / shard_stage(load_spec(spec)).key).glob(f"*/{PIECE_FILE}")))


def wait_for_pieces(home: Path, spec: Path, count: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while pieces_done(home, spec) < count:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no pieces were done in 5 minutes"
        time.sleep(0.05)


def test_a_cluster_is_an_address_or_local_workers_and_anything_else_is_refused(monkeypatch):
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tcp://10.0.0.1:8786")
    assert requested_cluster(None) == "tcp://10.0.0.1:8786" and requested_cluster("local:2") == "local:2"
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "10.0.0.1")
    with pytest.raises(SpecError, match="DASK_SCHEDULER_ADDRESS=10.0.0.1 is neither a Dask scheduler address nor local:N"):
        requested_cluster(None)


@pytest.mark.slow
def test_one_worker_and_three_write_the_bytes_of_one_process_under_one_key(cluster, noisy_spec, alone, tmp_path):
    one = shard_with(tmp_path / "one", noisy_spec, "--cluster", "local:1")
    cluster.scheduler()
    cluster.worker("pair", tmp_path / "three", 2)
    cluster.worker("third", tmp_path / "three")
    cluster.wait_for_workers(3)
    three = shard_with(tmp_path / "three", noisy_spec, "--cluster", cluster.address)
    assert alone.name == one.name == three.name
    assert output_bytes(one) == output_bytes(alone) == output_bytes(three)
    assert len([name for name in output_bytes(alone) if name.endswith(".tar")]) == 16


@pytest.mark.slow
def test_a_worker_killed_mid_piece_has_its_piece_rerun_elsewhere_with_the_same_bytes(cluster, noisy_spec, alone, tmp_path):
    home = tmp_path / "spread"
    cluster.scheduler()
    cluster.worker("doomed", home)
    cluster.worker("survivor", home)
    cluster.wait_for_workers(2)
    run = started_shard(home, noisy_spec, cluster.address)
    try:
        wait_for_pieces(home, noisy_spec, 2, run)  # each worker holds one of the 14 pieces left
        cluster.kill("doomed")
        _, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert output_bytes(shard_output(home, noisy_spec)) == output_bytes(alone)


@pytest.mark.slow
def test_a_lost_scheduler_is_one_line_and_exit_2_and_a_rerun_finishes_with_the_pieces_kept(cluster, noisy_spec,
                                                                                             alone, tmp_path):
    home = tmp_path / "spread"
    cluster.scheduler()
    cluster.worker("worker", home)
    cluster.wait_for_workers(1)
    run = started_shard(home, noisy_spec, cluster.address)
    try:
        wait_for_pieces(home, noisy_spec, 2, run)
        cluster.kill("scheduler")
        _, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1, stderr[-3000:]
    assert "(its scheduler stopped or is unreachable)" in errors[0] and "Traceback" not in stderr
    kept = pieces_done(home, noisy_spec)
    assert 2 <= kept < 16
    rerun = shard_with(home, noisy_spec)
    assert output_bytes(rerun) == output_bytes(alone)
    assert json.loads((rerun / "stage.json").read_text())["metrics"]["pieces_kept"] == kept


@pytest.mark.slow
def test_pieces_that_want_a_gpu_run_only_on_workers_that_offer_one(cluster, noisy_spec, alone, tmp_path):
    from distributed import Client

    home = tmp_path / "home"
    cluster.scheduler()
    cluster.worker("cpu", home)
    cluster.worker("gpu", home, 1, "--resources", "GPU=1")
    cluster.wait_for_workers(2)
    shard_with(home, noisy_spec)  # its pieces ran here; what runs on the cluster below is features and the kNN
    with Client(cluster.address, timeout=60) as client:
        client.get_task_stream()  # records every task from now on
        gpu = {address for address, worker in client.scheduler_info(n_workers=-1)["workers"].items()
               if worker["resources"].get("GPU")}
        done = subprocess.run([REPSIM, "eval", str(noisy_spec), "--suite", "knn", "--k", "10", "--cluster", cluster.address],
                              capture_output=True, text=True, env=isolated_env(home), timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        pieces = [task for task in client.get_task_stream() if str(task["key"]).startswith("build_piece")]
    assert len(pieces) == 16 + 1  # a features piece per tar, and the kNN's one piece of 40 queries
    assert {task["worker"] for task in pieces} == gpu


@pytest.fixture
def two_method_experiment(tmp_path, make_image_folder, write_spec) -> Path:
    """The tiny experiment with two methods to train, SupCon and SimCLR."""
    experiment = tiny_experiment(tmp_path, make_image_folder, write_spec)
    values = yaml.safe_load(experiment.read_text())
    values["stages"][1]["methods"].append({"config": str(REPO / "configs" / "simclr.yaml")})
    experiment.write_text(yaml.safe_dump(values, sort_keys=False))
    return experiment


def stage_table(stdout: str) -> list[list[str]]:
    """(stage, key, cached) of each row of the stage table ``repsim run`` prints, and the result table's rows."""
    stages, results = stdout.split("\n\n")[:2]
    return [[row.split()[0], row.split()[-1].rsplit("/", 1)[-1], row.split()[-2]] for row in stages.splitlines()[2:]], \
        results.splitlines()


@pytest.mark.slow
@pytest.mark.orchestration
def test_an_experiment_on_two_local_workers_trains_at_once_with_the_keys_and_table_of_one_process(
        two_method_experiment, tmp_path):
    alone = repsim(tmp_path / "alone", "run", str(two_method_experiment))
    home = tmp_path / "spread"
    spread = repsim(home, "run", str(two_method_experiment), "--cluster", "local:2")
    assert alone.returncode == 0 and spread.returncode == 0, spread.stderr[-3000:]
    (alone_stages, alone_table), (stages, table) = stage_table(alone.stdout), stage_table(spread.stdout)
    assert stages == alone_stages and table == alone_table
    trainings = [json.loads(path.read_text()) for path in (home / "artifacts" / "train").glob("*/stage.json")]
    (first, second) = sorted((record["started"], record["started"] + record["seconds"]) for record in trainings)
    assert second[0] < first[1]  # the second training started before the first ended
    again = repsim(home, "run", str(two_method_experiment), "--cluster", "local:2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [cached for _, _, cached in stage_table(again.stdout)[0]] == ["yes"] * len(stages)
    seen = prefect_query(home, """
runs = await client.read_task_runs()
artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=['tiny-results'])))
print(json.dumps({'trainings': sorted([run.name, run.state.name] for run in runs if run.name.startswith('train')),
                  'tables': [artifact.data for artifact in artifacts]}))""")
    assert seen["trainings"] == [["train simclr", "Cached"], ["train simclr", "Completed"],
                                 ["train supcon", "Cached"], ["train supcon", "Completed"]]
    assert len(seen["tables"]) == 2 and all("simclr" in table and "supcon" in table for table in seen["tables"])
    forced = repsim(home, "run", str(two_method_experiment), "--cluster", "local:2", "--force", "train")
    assert forced.returncode == 0, forced.stderr[-3000:]  # the workers rebuild what the command line forces
    rows = {(stage, cached) for stage, _, cached in stage_table(forced.stdout)[0] if stage in ("shard", "train")}
    assert rows == {("shard", "yes"), ("train", "no")}
