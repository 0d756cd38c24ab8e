"""How a training process splits its cores between torch threads and loader workers, and how stages
that run at once share the GPUs."""

import threading
import time

import pytest
import torch

from repsim import device as devices
from repsim.device import cores_per_process, cpu_plan, torch_threads

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("cores", [1, 2, 3, 4, 8, 16, 64])
def test_default_plan_never_oversubscribes_the_cores(device, cores):
    plan = cpu_plan(device, cores=cores)
    assert plan.threads >= 1 and plan.workers >= 0
    assert plan.threads + plan.workers == cores


def test_a_small_cpu_gives_every_core_to_the_model_and_reads_in_the_main_process():
    assert (cpu_plan(CPU, cores=2).threads, cpu_plan(CPU, cores=2).workers) == (2, 0)
    assert (cpu_plan(CPU, cores=16).threads, cpu_plan(CPU, cores=16).workers) == (12, 4)


def test_a_gpu_process_feeds_its_gpu_with_up_to_eight_workers_and_keeps_a_core():
    assert (cpu_plan(GPU, cores=4).threads, cpu_plan(GPU, cores=4).workers) == (1, 3)
    assert (cpu_plan(GPU, cores=32).threads, cpu_plan(GPU, cores=32).workers) == (24, 8)


def test_given_workers_or_threads_are_kept():
    assert cpu_plan(CPU, workers=1, cores=2).threads == 1
    assert cpu_plan(CPU, workers=3, cores=2).threads == 1
    assert cpu_plan(CPU, threads=1, cores=8) == cpu_plan(CPU, workers=2, threads=1, cores=8)
    assert (cpu_plan(CPU, threads=1, cores=8).threads, cpu_plan(GPU, threads=3, cores=8).threads) == (1, 3)


def test_ranks_on_one_machine_share_its_cores(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = cores_per_process()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * alone))
    assert cores_per_process() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores_per_process() == max(1, alone // 2)


def test_torch_threads_restores_the_previous_number():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_concurrent_stages_each_hold_a_gpu_of_their_own(monkeypatch):
    monkeypatch.setattr(devices, "_free_gpus", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    held, release, third = [], threading.Event(), []

    def hold():
        with devices.gpu_slot() as gpu:
            held.append(gpu)
            release.wait(10)

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for thread in holders:
        thread.start()
    while len(held) < 2:
        time.sleep(0.01)
    waiting = threading.Thread(target=lambda: third.append(devices.gpu_slot().__enter__()))
    waiting.start()
    waiting.join(0.3)
    assert sorted(str(gpu) for gpu in held) == ["cuda:0", "cuda:1"] and third == []  # the third waits
    release.set()
    waiting.join(10)
    for thread in holders:
        thread.join(10)
    assert third and third[0].type == "cuda"


def test_without_cuda_a_stage_takes_its_default_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with devices.gpu_slot() as gpu:
        assert gpu is None
