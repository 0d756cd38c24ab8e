"""Training on several nodes, for real: torchrun agents on this machine stand for the nodes, meet at a
c10d rendezvous on 127.0.0.1 and train a tiny SupCon ResNet with gloo on the CPU, each run under its own
``$REPSIM_HOME``. Every agent is started in a session of its own and its processes are killed at the end."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from e2e import free_port, isolated_env
from PIL import Image

from repsim.models.backbones import read_encoder
from repsim.device import TorchrunLaunch

STEPS = 8  # 8 train images in global batches of 4: 2 steps an epoch, 4 epochs
TIMEOUT_S = 120
SEPARATOR = "\n--- next agent ---\n"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """A SupCon config on 16 images of 16×16 pixels (half of them train), checkpointed every 2 steps."""
    folder = tmp_path_factory.mktemp("multinode")
    for index in range(16):
        name = ("cat", "dog")[index % 2]
        (folder / "images" / name).mkdir(parents=True, exist_ok=True)
        pixels = np.random.default_rng(index).integers(0, 256, (16, 16), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "images" / name / f"{index}.png")
    spec = {"name": "pets", "source": {"type": "image_folder", "root": str(folder / "images")},
            "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
            "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}}
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    settings = {"method": {"name": "supcon"}, "data": {"spec": str(folder / "spec.yaml"), "image_size": 16},
                "model": {"small_images": False, "projection_dim": 8, "projection_hidden_dim": 16},
                "optim": {"epochs": 4, "batch_size": 4, "warmup_epochs": 0, "num_workers": 0, "threads": 1,
                          "precision": "fp32", "checkpoint_every": 2},
                "monitor": {"knn": False}}
    (folder / "config.yaml").write_text(yaml.safe_dump(settings))
    return folder / "config.yaml"


@pytest.fixture(scope="module")
def uninterrupted(config, tmp_path_factory) -> Path:
    """The train stage output of ``config`` trained by two ranks on one node (``--standalone``)."""
    home = tmp_path_factory.mktemp("standalone") / "home"
    with Nodes(home) as nodes:
        nodes.start(TorchrunLaunch(nproc_per_node=2), config)
        assert nodes.wait() == [0], nodes.output()
    return trained(home)


class Nodes:
    """torchrun agents under ``home``, each standing for a node: started in a session of its own, with its
    output in ``home/../agent<i>.log``; on exit every agent still running and its workers are killed."""

    def __init__(self, home: Path):
        self.home, self.agents = home, []

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                self.kill(agent)

    def start(self, launch: TorchrunLaunch, config: Path) -> subprocess.Popen:
        """One agent running ``launch``'s command for ``config`` in its environment (its temporary files
        beside ``home``)."""
        env = isolated_env(self.home) | launch.environment | {"TMPDIR": str(self.home.parent)}
        with open(self.home.parent / f"agent{len(self.agents)}.log", "wb") as log:
            agent = subprocess.Popen(launch.command(config, []), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.agents.append(agent)
        return agent

    def kill(self, agent: subprocess.Popen) -> None:
        """SIGKILL ``agent`` and its workers (each in a session of its own) at once, as a lost node loses them."""
        workers = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        for group in [agent.pid, *map(int, workers)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        agent.wait()

    def wait(self) -> list[int]:
        """The exit codes of the agents, once all have ended."""
        return [agent.wait(timeout=TIMEOUT_S) for agent in self.agents]

    def output(self, tail: int = 3000) -> str:
        """The last ``tail`` characters each agent (with its workers) wrote, in the order they started."""
        logs = [self.home.parent / f"agent{index}.log" for index in range(len(self.agents))]
        return SEPARATOR.join(log.read_text(errors="replace")[-tail:] for log in logs)


def two_node_launch(run_id: str) -> TorchrunLaunch:
    return TorchrunLaunch(nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=run_id, max_restarts=1)


def start_two_nodes(nodes: Nodes, launch: TorchrunLaunch, config: Path) -> list[subprocess.Popen]:
    """The first node's agent, hosting the rendezvous store once it listens, then the second's."""
    first = nodes.start(launch, config)
    host, port = launch.rdzv_endpoint.split(":")
    deadline = time.time() + TIMEOUT_S
    while not listening(host, int(port)):
        assert first.poll() is None and time.time() < deadline, nodes.output()
        time.sleep(0.1)
    return [first, nodes.start(launch, config)]


def listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def trained(home: Path) -> Path:
    """The one train stage output under ``home``."""
    [output] = [path for path in (home / "artifacts" / "train").iterdir() if not path.name.startswith(".")]
    return output


def assert_same_encoder(output: Path, expected: Path) -> None:
    """The two train stage outputs have the same key and bit-identical encoder tensors."""
    assert output.name == expected.name
    weights, reference = (read_encoder(path)["state_dict"] for path in (output, expected))
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in reference)


def wait_for_checkpoint(home: Path, nodes: Nodes) -> None:
    """Return once the first training checkpoint is in ``home``'s scratch folder."""
    deadline = time.time() + TIMEOUT_S
    while not list((home / "scratch" / "train").glob("*/checkpoint.pt")):
        assert all(agent.poll() is None for agent in nodes.agents), nodes.output()
        assert time.time() < deadline, nodes.output()
        time.sleep(0.05)


def progress_bars(nodes: Nodes) -> list[list[int]]:
    """For each agent, the steps at which the progress bars its rank 0 drew started (none without rank 0)."""
    return [[int(step) for step in re.findall(rf"\| (\d+)/{STEPS} \[00:00<\?", output)]
            for output in nodes.output(tail=10**7).split(SEPARATOR)]


def test_launch_passes_its_restart_budget_and_the_rendezvous_environment_to_torchrun():
    one_node = TorchrunLaunch(nproc_per_node=2)
    several = TorchrunLaunch(nnodes=2, rdzv_endpoint="h:1", max_restarts=3)
    assert "--max_restarts=0" in one_node.command("c.yaml", []) and one_node.environment == {}
    assert "--max_restarts=3" in several.command("c.yaml", [])
    assert several.environment == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.slow
def test_two_nodes_train_the_encoder_that_two_ranks_of_one_node_train(config, uninterrupted, repsim_home):
    with Nodes(repsim_home) as nodes:
        start_two_nodes(nodes, two_node_launch("two-nodes"), config)
        assert nodes.wait() == [0, 0], nodes.output()
    assert_same_encoder(trained(repsim_home), uninterrupted)


@pytest.mark.slow
def test_a_lost_node_started_again_resumes_the_job_from_its_checkpoint(config, uninterrupted, repsim_home):
    """The second node's agent and worker are killed; the first node's agent restarts its worker (its one
    restart) and meets the second node's new agent at the rendezvous, and both go on from the checkpoint."""
    launch = two_node_launch("lost-node")
    with Nodes(repsim_home) as nodes:
        first, second = start_two_nodes(nodes, launch, config)
        wait_for_checkpoint(repsim_home, nodes)
        nodes.kill(second)
        replacement = nodes.start(launch, config)  # as the lost node's supervisor starts it again
        assert [first.wait(TIMEOUT_S), replacement.wait(TIMEOUT_S)] == [0, 0], nodes.output()
    assert_same_encoder(trained(repsim_home), uninterrupted)
    [started, resumed], [], [] = progress_bars(nodes)  # rank 0 on the first node: its first worker, then its second
    assert started == 0 and resumed in range(2, STEPS, 2)


@pytest.mark.slow
def test_a_job_killed_on_every_node_and_run_again_resumes_from_its_checkpoint(config, uninterrupted, repsim_home):
    """Both nodes' processes are killed (a scheduler ending the job); the job, started again on both nodes (the
    scheduler requeueing it), goes on from the checkpoint."""
    with Nodes(repsim_home) as nodes:
        killed = start_two_nodes(nodes, two_node_launch("killed-job"), config)
        wait_for_checkpoint(repsim_home, nodes)
        for agent in killed:
            nodes.kill(agent)
        again = start_two_nodes(nodes, two_node_launch("requeued-job"), config)
        assert [agent.wait(TIMEOUT_S) for agent in again] == [0, 0], nodes.output()
    assert_same_encoder(trained(repsim_home), uninterrupted)
    started, resumed = sum(progress_bars(nodes), [])  # rank 0: in the killed job, then in the requeued one
    assert started == 0 and resumed in range(2, STEPS, 2)
