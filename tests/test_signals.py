"""SIGTERM during a run, as a scheduler sends it: the process stops within its grace period, leaves
no child process behind, says in one line where it stopped, and the same command resumes to the
encoder an uninterrupted run trains, bit for bit."""

import signal
import subprocess
import sys
import time

import pytest
import torch
from e2e import REPSIM, isolated_env

from repsim.models.backbones import read_encoder
from repsim.stopping import CHILDREN_S, GRACE_S, _alive, _descendants, _end


def test_children_that_ignore_sigterm_are_killed_once_their_time_is_up():
    ignoring = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    obeying = subprocess.Popen(["sleep", "60"])
    ignoring.stdout.readline()  # its handler is in place
    started = time.monotonic()
    _end([ignoring.pid, obeying.pid])
    assert ignoring.wait(timeout=5) == -signal.SIGKILL and obeying.wait(timeout=5) == -signal.SIGTERM
    assert CHILDREN_S <= time.monotonic() - started < CHILDREN_S + 1


SETTINGS = ["optim.epochs=50", "optim.batch_size=4", "optim.num_workers=0", "optim.warmup_epochs=0",
            "optim.checkpoint_every=0", "monitor.knn=false", "model.small_images=false", "model.projection_dim=8",
            "model.projection_hidden_dim=16"]


def encoder_weights(home) -> dict[str, torch.Tensor]:
    [output] = [path for path in (home / "artifacts" / "train").iterdir() if not path.name.startswith(".")]
    return read_encoder(output)["state_dict"]


def steps_logged(home) -> int:
    return sum(len(path.read_text().splitlines()) for path in home.glob("scratch/train/*/metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.orchestration
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
    assert time.time() - sent < GRACE_S + CHILDREN_S + 1 and running.returncode == 128 + signal.SIGTERM, err[-3000:]
    [error] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: stopped by SIGTERM at step ") and error.endswith(
        "its checkpoint written; run the same command again to resume from there"), error
    assert "Traceback" not in err, err[-3000:]
    assert children and not [pid for pid in children if _alive(pid)]  # the temporary Prefect API went too

    for where in (home, reference):
        done = subprocess.run(command, env=isolated_env(where), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    resumed, uninterrupted = encoder_weights(home), encoder_weights(reference)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
