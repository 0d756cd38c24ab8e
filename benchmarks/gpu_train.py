"""GPU training throughput: X-CLR against SimCLR on ResNet-50, the shard loader alone, and model FLOP utilisation.

Training: forward + backward + AdamW step of each method on synthetic batches (two views of
``--image-size`` px, random labels; X-CLR with the same-label similarity, a dense (B, B) target), in
bf16 autocast and channels-last, timed over ``--steps`` steps after ``--warmup-steps``; ``--compile``
adds the same with the encoder compiled. FLOPs per image (both views, forward + backward, counted by
``torch.utils.flop_counter.FlopCounterMode`` on a small batch) × images/s ÷ ``--peak-tflops`` gives the
model FLOP utilisation (MFU). Loader: images/s of ``make_loader`` with the simclr preset over the
spec's shards, upscaled to ``--image-size``, for each ``--loader-workers``. Writes ``gpu_train.json``
and ``gpu_train.md`` into ``--out`` (default ``$OUT``, else benchmarks/results).

    python benchmarks/gpu_train.py [--compile]                       # an H200: a few minutes
    python benchmarks/gpu_train.py --device cpu --image-size 32 --batch-size 4 --steps 2 \\
        --warmup-steps 1 --loader-images 64 --loader-workers 0       # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from loader import artifact_home, throughput
from repsim.data.loader import ShardLoader, make_loader
from repsim.data.stage import shard
from repsim.methods.config import ModelConfig, OptimConfig
from repsim.methods.contrastive import TwoViewMethod, backbone_and_projection
from repsim.methods.simclr import SimCLR
from repsim.methods.trainer import Batch, autocast, make_optimizer
from repsim.methods.xclr import XCLR
from repsim.similarity.targets import LabelSource

REPO = Path(__file__).resolve().parents[1]
H200_BF16_DENSE_TFLOPS = 989.0
CLASSES = 1000
METHODS = ("simclr", "xclr")


def build_method(name: str, backbone: str, image_size: int) -> TwoViewMethod:
    """``name`` on a standard-stem ``backbone`` for 3-channel images (projection 2048-2048-128)."""
    config = ModelConfig(backbone=backbone, small_images=False, projection_hidden_dim=2048)
    parts = backbone_and_projection(config, 3, image_size)
    return XCLR(*parts, LabelSource()) if name == "xclr" else SimCLR(*parts)


def synthetic_batch(batch_size: int, image_size: int, device: torch.device) -> Batch:
    """Two random views (channels-last), random labels, indices 0..B-1, on ``device``."""
    views = [torch.randn(batch_size, 3, image_size, image_size, device=device)
             .contiguous(memory_format=torch.channels_last) for _ in range(2)]
    return {"views": views, "label": torch.randint(CLASSES, (batch_size,), device=device),
            "index": torch.arange(batch_size, device=device)}


def training_step(method: TwoViewMethod, optimizer: torch.optim.Optimizer, batch: Batch,
                  device: torch.device, dtype: torch.dtype | None) -> None:
    with autocast(device, dtype):
        loss = method.training_step(batch)["loss"]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def flops_per_image(method: TwoViewMethod, batch: Batch, device: torch.device, dtype: torch.dtype | None) -> float:
    """FLOPs of forward + backward of one training step (both views), per image of ``batch``."""
    with FlopCounterMode(display=False) as counter:
        with autocast(device, dtype):
            loss = method.training_step(batch)["loss"]
        loss.backward()
    method.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(batch["index"])


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_throughput(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype | None,
                     compiled: bool) -> dict[str, float | str | bool]:
    """Images/s, FLOPs per image and MFU of method ``name``."""
    torch.manual_seed(0)
    method = build_method(name, args.backbone, args.image_size).to(device).to(memory_format=torch.channels_last)
    flops = flops_per_image(method, synthetic_batch(args.flop_batch_size, args.image_size, device), device, dtype)
    if compiled:
        method.encoder.compile()
    optimizer = make_optimizer(method, OptimConfig())
    batch = synthetic_batch(args.batch_size, args.image_size, device)
    for _ in range(args.warmup_steps):
        training_step(method, optimizer, batch, device, dtype)
    synchronise(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        training_step(method, optimizer, batch, device, dtype)
    synchronise(device)
    images_per_second = args.batch_size * args.steps / (time.perf_counter() - started)
    return {"method": name, "compiled": compiled, "images_per_second": images_per_second,
            "gflops_per_image": flops / 1e9, "mfu": flops * images_per_second / (args.peak_tflops * 1e12)}


def loader_throughput(args: argparse.Namespace) -> list[dict[str, float | int]]:
    """Images/s of the simclr-preset loader over the spec's training shards, per worker count."""
    with artifact_home():
        shards = shard(args.spec, progress=False).path
        return [{"workers": workers, "images_per_second": loader_rate(shards, workers, args)}
                for workers in args.loader_workers]


def loader_rate(shards: Path, workers: int, args: argparse.Namespace) -> float:
    def batches() -> ShardLoader:
        return make_loader(shards, "simclr", args.batch_size, image_size=args.image_size, channels=3,
                           num_workers=workers)
    return throughput(batches, args.loader_images).images_per_second


def report(command: str, device: torch.device, args: argparse.Namespace, training: list[dict],
           loading: list[dict]) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    baseline = {row["compiled"]: row["images_per_second"] for row in training if row["method"] == "simclr"}
    lines = [
        "# GPU training throughput", "",
        f"Command: `{command}`", "",
        (f"Device: {name}; torch {torch.__version__}. {args.backbone}, {args.image_size} px, batch {args.batch_size} "
         f"(two views each), {'bf16 autocast' if args.precision == 'bf16' else 'fp32'}, channels-last, AdamW; "
         f"synthetic batches; {args.steps} timed steps after {args.warmup_steps} warm-up steps. MFU: FLOPs per "
         f"image (forward + backward, both views) × images/s ÷ {args.peak_tflops:g} TFLOP/s."), "",
        "| method | compiled | images/s | vs SimCLR | GFLOPs/image | MFU |",
        "|---|---|---:|---:|---:|---:|",
        *[f"| {row['method']} | {'yes' if row['compiled'] else 'no'} | {row['images_per_second']:,.1f} "
          f"| {row['images_per_second'] / baseline[row['compiled']]:.2f} | {row['gflops_per_image']:,.1f} "
          f"| {row['mfu']:.1%} |" for row in training], "",
        (f"Loader alone: `make_loader(..., \"simclr\", image_size={args.image_size}, channels=3)` over the "
         f"training shards of {Path(args.spec).name}, first {args.loader_images} images, start-up included."), "",
        "| workers | images/s |", "|---:|---:|",
        *[f"| {row['workers']} | {row['images_per_second']:,.0f} |" for row in loading], "",
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--flop-batch-size", type=int, default=2)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--compile", action="store_true", help="also time each method with its encoder compiled")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument("--spec", default=str(REPO / "data_specs" / "animal-mnist.yaml"))
    parser.add_argument("--loader-images", type=int, default=4096)
    parser.add_argument("--loader-workers", type=int, nargs="+", default=[0, 8, 15])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks" / "results"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    torch.backends.cudnn.benchmark = True
    training = [train_throughput(name, args, device, dtype, compiled)
                for compiled in ((False, True) if args.compile else (False,)) for name in METHODS]
    write_results(args, device, training, [])  # kept should the loader part fail
    print(write_results(args, device, training, loader_throughput(args)))


def write_results(args: argparse.Namespace, device: torch.device, training: list[dict], loading: list[dict]) -> str:
    """Write ``gpu_train.json`` and ``gpu_train.md`` into ``args.out``; returns the markdown."""
    command = shlex.join(["python", "benchmarks/gpu_train.py", *sys.argv[1:]])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_train.json").write_text(json.dumps({"command": command, "training": training,
                                                         "loader": loading}, indent=2))
    text = report(command, device, args, training, loading)
    (args.out / "gpu_train.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
