"""What a trained encoder costs the store: the default experiment (`make run`) in a fresh ``$REPSIM_HOME``,
then the bytes on disk that belong to each trained encoder (its train stage output, its logged MLflow
model, its train runs' artifacts and any scratch left) against the bytes of its weights. A file with
several hard links counts once. The table goes to ``benchmarks/results/store_size.md``.

    python benchmarks/store_size.py [--steps 20] [--home DIR]

``--steps`` ends each training after that many steps (the files written do not depend on it; 0: the
full schedule, as `make run`); ``--home`` measures a store that already holds the run instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from mlflow.tracking import MlflowClient

from _report import HERE, markdown, write_report
from repsim.models.backbones import read_encoder
from repsim.stage import read_record

RESULTS = HERE / "results" / "store_size.md"
EXPERIMENT = HERE.parent / "experiments" / "default.yaml"
GOAL = 1.3  # store bytes per encoder over its weights


def unique_bytes(paths: Iterable[Path]) -> int:
    """Bytes of the files under ``paths``, each inode once."""
    seen: dict[tuple[int, int], int] = {}
    for root in paths:
        for file in [root] if root.is_file() else root.rglob("*"):
            if file.is_file() and not file.is_symlink():
                stat = file.stat()
                seen[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(seen.values())


def weight_bytes(train_dir: Path) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in read_encoder(train_dir)["state_dict"].values())


def local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def encoder_files(home: Path) -> dict[str, list[Path]]:
    """For each trained encoder (its stage output), the folders that hold its files."""
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    client = MlflowClient()
    experiment = client.get_experiment_by_name("repsim").experiment_id
    trains = client.search_runs([experiment], "tags.`repsim.stage` = 'train'")
    models = {model.source_run_id: local(model.artifact_location)
              for model in client.search_logged_models(experiment_ids=[experiment])}
    folders: dict[str, list[Path]] = {}
    for run in trains:
        output = Path(run.data.tags["repsim.output"])
        key = read_record(output)["key"]
        folders.setdefault(str(output), [output, home / "scratch" / "train" / key])
        folders[str(output)] += [local(run.info.artifact_uri)] + ([models[run.info.run_id]]
                                                                  if run.info.run_id in models else [])
    return folders


def measure(home: Path) -> list[list[str]]:
    rows = []
    for output, folders in sorted(encoder_files(home).items()):
        weights, stored = weight_bytes(Path(output)), unique_bytes(folder for folder in folders if folder.exists())
        rows.append([read_record(Path(output))["config"]["method"]["name"], f"{weights / 2**20:.1f}",
                     f"{stored / 2**20:.1f}", f"{stored / weights:.2f}"])
    total = unique_bytes([home])
    rows.append(["whole store", "", f"{total / 2**20:.1f}", ""])
    return rows


def run_default(home: Path, steps: int) -> float:
    started = time.time()
    command = [sys.executable, "-m", "repsim.flows.cli", "run", str(EXPERIMENT)]
    if steps:
        command += ["--set", f"train.settings.optim.max_steps={steps}"]
    env = os.environ | {"REPSIM_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--home", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        home = args.home or Path(scratch)
        seconds = 0.0 if args.home else run_default(home, args.steps)
        rows = measure(home)
    ratios = [float(row[3]) for row in rows if row[3]]
    verdict = "within" if max(ratios) <= GOAL else "above"
    text = (f"# Store bytes per trained encoder\n\n`python benchmarks/{Path(__file__).name} "
            f"{shlex.join(sys.argv[1:])}`".rstrip() + f" — the default experiment"
            f"{f' cut to {args.steps} steps a training' if args.steps and not args.home else ''}"
            f"{f', run in {seconds:.0f} s' if seconds else ''}.\n\n"
            + markdown(["encoder", "weights MiB", "stored MiB", "stored / weights"], rows)
            + f"\n\nEvery encoder is {verdict} the goal of {GOAL}x its weights. Stored: its train stage output, "
            "logged MLflow model, train runs' artifacts and scratch left, each file once however many hard "
            "links it has.\n")
    write_report(RESULTS, text)
    print(text)


if __name__ == "__main__":
    main()
