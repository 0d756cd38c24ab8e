"""SIGTERM during a run, as a scheduler sends it: the process stops within its grace period, leaves
no child process behind, says in one line where it stopped, and the same command resumes to the
encoder an uninterrupted run trains, bit for bit."""

import signal
import subprocess
import time

import pytest
import torch
from e2e import REPSIM, isolated_env

from repsim.stopping import GRACE_S, _descendants

pytestmark = [pytest.mark.slow, pytest.mark.orchestration]

SETTINGS = ["optim.epochs=150", "optim.batch_size=4", "optim.num_workers=0", "optim.warmup_epochs=0",
            "optim.checkpoint_every=0", "monitor.knn=false", "model.small_images=false", "model.projection_dim=8",
            "model.projection_hidden_dim=16"]


def encoder_weights(home) -> dict[str, torch.Tensor]:
    [output] = [path for path in (home / "artifacts" / "train").iterdir() if not path.name.startswith(".")]
    return torch.load(output / "encoder.pt", weights_only=False)["state_dict"]


def steps_logged(home) -> int:
    return sum(len(path.read_text().splitlines()) for path in home.glob("scratch/train/*/metrics.jsonl"))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_during_training_checkpoints_stops_and_resumes_bitwise(make_image_folder, write_spec, tmp_path):
    root = make_image_folder({"cat": 6, "dog": 6}, size=16)
    spec = write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})
    config = tmp_path / "simclr.yaml"
    config.write_text(f"data: {{spec: {spec}, image_size: 16}}\nmethod: {{name: simclr}}\n")
    command = [REPSIM, "train", str(config), *(arg for setting in SETTINGS for arg in ("--set", setting))]
    home, reference = tmp_path / "home", tmp_path / "reference"

    running = subprocess.Popen(command, env=isolated_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.time() + 300
    while steps_logged(home) < 5:
        assert running.poll() is None and time.time() < deadline, running.communicate()[1][-3000:]
        time.sleep(0.2)
    children = _descendants(running.pid)
    sent = time.time()
    running.send_signal(signal.SIGTERM)
    _, err = running.communicate(timeout=60)
    assert time.time() - sent < GRACE_S + 2 and running.returncode == 128 + signal.SIGTERM, err[-3000:]
    [error] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: stopped by SIGTERM at step ") and error.endswith(
        "its checkpoint written; run the same command again to resume from there"), error
    assert "Traceback" not in err, err[-3000:]
    assert children and not [pid for pid in children if alive(pid)]  # the temporary Prefect API went too

    for where in (home, reference):
        done = subprocess.run(command, env=isolated_env(where), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    resumed, uninterrupted = encoder_weights(home), encoder_weights(reference)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
