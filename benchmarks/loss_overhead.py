"""What X-CLR's soft targets cost: XCLRLoss against NTXentLoss, and training throughput of the backbone.

Forward + backward of each loss on random projections z1, z2 (B, D) is timed at every batch size,
alternating the two losses, median of ``--repeats`` after ``--warmup`` untimed runs; X-CLR gets a
dense soft similarity (B, B) in [0, 1]. Then training images/s of ResNet-18 (one channel, 28 px;
forward + backward + AdamW step on random data) with the small-images stem and the standard stem.
The tables go to ``benchmarks/results/loss_overhead.md``.

    python benchmarks/loss_overhead.py [--device cpu] [--batch-sizes 256 1024 4096] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from _report import median_seconds, synchronise, write_report
from repsim.losses import NTXentLoss, XCLRLoss
from repsim.models.backbones import resnet

RESULTS = Path(__file__).parent / "results" / "loss_overhead.md"
LARGE_BATCH = 4096  # CPU repeats are capped above this size
LARGE_BATCH_CPU_REPEATS = 5


def loss_step(loss: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """Forward + backward of ``loss`` on fresh leaf copies of the projections in ``inputs``."""
    def step() -> None:
        z1, z2 = (z.detach().requires_grad_() for z in inputs[:2])
        loss(z1, z2, *inputs[2:]).backward()
    return step


def loss_times(batch: int, dim: int, device: torch.device, warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds of forward + backward of NT-Xent and X-CLR at batch size ``batch``."""
    generator = torch.Generator(device=device).manual_seed(batch)
    z1, z2 = (torch.randn(batch, dim, device=device, generator=generator) for _ in range(2))
    similarity = torch.rand(batch, batch, device=device, generator=generator)
    steps = {"ntxent": loss_step(NTXentLoss(0.1), (z1, z2)),
             "xclr": loss_step(XCLRLoss(0.1, 0.1), (z1, z2, similarity))}
    return median_seconds(steps, device, warmup, repeats)


def training_images_per_second(small_images: bool, batch: int, steps: int, device: torch.device) -> float:
    """Images/s of forward + backward + AdamW step of ResNet-18 (1 channel, 28 px), after one warm-up step."""
    torch.manual_seed(0)
    model = resnet("resnet18", small_images=small_images, in_channels=1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = torch.randn(batch, 1, 28, 28, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(images).square().mean().backward()
        optimizer.step()

    step()
    synchronise(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    synchronise(device)
    return batch * steps / (time.perf_counter() - started)


def report(command: str, device: torch.device, dim: int, loss_rows: list[tuple[int, int, dict[str, float]]],
           train_rows: list[tuple[str, float]], batch: int) -> str:
    lines = [
        "# X-CLR loss overhead", "",
        f"Command: `{command}`", "",
        (f"Device: {device.type}; torch {torch.__version__}, {os.cpu_count()} CPU cores, "
         f"{torch.get_num_threads()} torch threads, {platform.processor() or platform.machine()}. "
         f"Forward + backward of each loss on random projections (B, {dim}); X-CLR with a dense random "
         "similarity (B, B). Median of the repeats after warm-up, the two losses alternated. The machine "
         "is shared, so absolute times vary between runs; the ratio is the measure. Target: X-CLR / NT-Xent ≤ 1.10."),
        "",
        "| B | repeats | NT-Xent ms | X-CLR ms | X-CLR / NT-Xent |",
        "|---:|---:|---:|---:|---:|",
        *[f"| {size} | {repeats} | {times['ntxent'] * 1e3:,.2f} | {times['xclr'] * 1e3:,.2f} "
          f"| {times['xclr'] / times['ntxent']:.2f} |" for size, repeats, times in loss_rows],
        "",
        (f"Training throughput of ResNet-18, 1 channel, 28 px, batch {batch}: forward + backward + AdamW step "
         "on random data (no data loading), after one warm-up step."), "",
        "| stem | images/s |", "|---|---:|",
        *[f"| {stem} | {rate:,.0f} |" for stem, rate in train_rows], "",
        *step_share(loss_rows, train_rows, batch),
    ]
    return "\n".join(lines)


def step_share(loss_rows: list[tuple[int, int, dict[str, float]]], train_rows: list[tuple[str, float]],
               batch: int) -> list[str]:
    """X-CLR's extra loss time at the training batch size as a share of each stem's training step."""
    times = next((times for size, _, times in loss_rows if size == batch), None)
    if times is None:
        return []
    extra = times["xclr"] - times["ntxent"]
    shares = " and ".join(f"{100 * extra * rate / batch:.2f} % with the {stem.split(' ')[0]} stem"
                          for stem, rate in train_rows)
    return [f"At B = {batch}, X-CLR's extra {extra * 1e3:.2f} ms is, of one training step, {shares}.", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--train-batch-size", type=int, default=256)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    loss_rows = []
    for size in args.batch_sizes:
        repeats = args.repeats
        if device.type == "cpu" and size >= LARGE_BATCH:
            repeats = min(repeats, LARGE_BATCH_CPU_REPEATS)
        times = loss_times(size, args.dim, device, min(args.warmup, repeats), repeats)
        loss_rows.append((size, repeats, times))
        print(f"B={size}: {times}", flush=True)
    train_rows = []
    stems = (("small-images (3×3 stride 1, no max-pool)", True), ("standard (7×7 stride 2 + max-pool)", False))
    for stem, small in stems:
        train_rows.append((stem, training_images_per_second(small, args.train_batch_size, args.train_steps, device)))
        print(f"{stem}: {train_rows[-1][1]:.0f} images/s", flush=True)
    command = shlex.join(["python", "benchmarks/loss_overhead.py", *sys.argv[1:]])
    text = report(command, device, args.dim, loss_rows, train_rows, args.train_batch_size)
    write_report(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
