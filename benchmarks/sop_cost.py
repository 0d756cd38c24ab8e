"""What SOP costs: its training step against the DINO- and iBOT-style baselines', the share of
drawing SOPs (anchors and their kNN over the memory) in that step, and torch against FAISS for that kNN.

1. Step time (forward + backward + AdamW step + EMA update) of SOP, DINO and iBOT at the same batch
   size, ViT-Tiny on random 28 px multi-crop views (2 global, ``--local-crops`` local), SOP with full
   memories; the three alternated, median of ``--repeats`` after ``--warmup``; ratios to DINO.
2. The time of drawing the [CLS] and patch SOPs (both memories) alone, as a share of SOP's step.
3. The k = 8 nearest supports of ``--knn-anchors`` anchors among ``--knn-memory`` unit embeddings
   (D = 256; the paper's K = 4096 and N_C = 65536 by default): one matrix product and ``topk`` on
   the device (:func:`repsim.losses.sop.nearest_supports`) against an exact FAISS inner-product index
   built from the memory, searched for k + 1 (a fresh index every step, as the memory changes; from
   the GPU that includes copying the memory to the host).

The table goes to ``benchmarks/results/sop_cost.md``.

    python benchmarks/sop_cost.py [--device cpu] [--batch-size 64] [--depth 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from _report import markdown, median_seconds, write_report
from repsim.data.masking import BlockMasking
from repsim.losses import DINOLoss, IBOTPatchLoss, MaskedSOPLoss, SOPLoss
from repsim.losses.sop import nearest_supports
from repsim.methods.config import ModelConfig
from repsim.methods.dino import Dino, Prototypes
from repsim.methods.self_distillation import SelfDistillation, projection_head
from repsim.methods.sop import SOP, SOPBank
from repsim.models import vit

RESULTS = Path(__file__).parent / "results" / "sop_cost.md"
HEAD = ModelConfig(projection_hidden_dim=2048, projection_dim=256, projection_layers=3)


def methods(args: argparse.Namespace) -> dict[str, SelfDistillation]:
    """SOP (memories filled with random unit embeddings), DINO and iBOT on the same ViT-Tiny."""
    torch.manual_seed(0)
    encoders = [vit("tiny", image_size=28, patch_size=4, depth=args.depth, in_channels=1) for _ in range(3)]
    banks = [SOPBank(size, HEAD.projection_dim, args.anchors, 8) for size in (args.cls_memory, args.patch_memory)]
    for bank in banks:
        bank.memory.enqueue(F.normalize(torch.randn(bank.memory.size, HEAD.projection_dim), dim=1))
    sop = SOP(encoders[0], projection_head(192, HEAD), *banks, cls_loss=SOPLoss(), mim_loss=MaskedSOPLoss(),
              masking=BlockMasking())
    dino, ibot = (Dino(encoder, projection_head(192, HEAD), Prototypes(HEAD.projection_dim, args.prototypes),
                       DINOLoss(args.prototypes), **patch_options)
                  for encoder, patch_options in ((encoders[1], {}), (encoders[2], {
                      "patch_loss": IBOTPatchLoss(args.prototypes), "masking": BlockMasking()})))
    return {"SOP": sop, "DINO": dino, "iBOT": ibot}


def training_step(method: SelfDistillation, batch: dict, device: torch.device) -> Callable[[], None]:
    optimizer = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        method.training_step(batch)["loss"].backward()
        optimizer.step()
        method.after_optimizer_step(1, 100)
    return step


def random_views(batch: int, local_crops: int, device: torch.device) -> dict:
    return {"views": [torch.randn(batch, 1, 28, 28, device=device) for _ in range(2)] +
                     [torch.randn(batch, 1, 12, 12, device=device) for _ in range(local_crops)]}


def knn_times(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    generator = torch.Generator(device=device).manual_seed(0)
    memory = F.normalize(torch.randn(args.knn_memory, 256, device=device, generator=generator), dim=1)
    ids = torch.arange(args.knn_memory, device=device)
    rows = torch.randperm(args.knn_memory, device=device, generator=generator)[:args.knn_anchors]
    steps = {backend: functools.partial(nearest_supports, memory[rows], ids[rows], memory, ids, 8, backend=backend)
             for backend in ("torch", "faiss")}
    return median_seconds(steps, device, 1, args.repeats)


def report(command: str, args: argparse.Namespace, device: torch.device, steps: dict[str, float],
           draw: float, knn: dict[str, float]) -> str:
    lines = [
        "# SOP cost", "",
        f"Command: `{command}`", "",
        (f"Device: {device.type}; torch {torch.__version__}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} "
         f"torch threads, {platform.processor() or platform.machine()}. ViT-Tiny, {args.depth} blocks, 28 px "
         f"(patch 4), batch {args.batch_size}, 2 global + {args.local_crops} local views; head 2048-2048-256. "
         f"SOP: K = {args.anchors} anchors, k = 8, memories {args.cls_memory} ([CLS]) and {args.patch_memory} "
         f"(patches), full; DINO and iBOT: {args.prototypes} prototypes; SOP and iBOT mask half the global views. "
         f"Median of {args.repeats} alternated repeats. The "
         "machine may be shared, so absolute times vary between runs; the ratios are the measure."), "",
        markdown(["step", "ms", "ratio"], [
            ["DINO training step", f"{steps['DINO'] * 1e3:,.1f}", "1.00"],
            ["iBOT training step", f"{steps['iBOT'] * 1e3:,.1f}", f"{steps['iBOT'] / steps['DINO']:.2f}"],
            ["SOP training step", f"{steps['SOP'] * 1e3:,.1f}", f"{steps['SOP'] / steps['DINO']:.2f}"],
            ["drawing both SOP sets (anchors + kNN)", f"{draw * 1e3:,.1f}",
             f"{100 * draw / steps['SOP']:.1f} % of SOP's step"],
        ]), "",
        (f"Nearest supports (k = 8) of {args.knn_anchors} anchors among {args.knn_memory} unit embeddings (D = 256):"),
        "",
        markdown(["kNN", "ms", "ratio"], [
            ["torch matmul + topk (on the device)", f"{knn['torch'] * 1e3:,.1f}", "1.00"],
            ["FAISS exact IP (index built from the memory)", f"{knn['faiss'] * 1e3:,.1f}",
             f"{knn['faiss'] / knn['torch']:.2f}"],
        ]), "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--local-crops", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=1024)
    parser.add_argument("--cls-memory", type=int, default=8192)
    parser.add_argument("--patch-memory", type=int, default=8192)
    parser.add_argument("--prototypes", type=int, default=4096)
    parser.add_argument("--knn-anchors", type=int, default=4096)
    parser.add_argument("--knn-memory", type=int, default=65536)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    compared = {name: method.to(device) for name, method in methods(args).items()}
    batch = random_views(args.batch_size, args.local_crops, device)
    steps = median_seconds({name: training_step(method, batch, device) for name, method in compared.items()},
                           device, args.warmup, args.repeats)
    sop = compared["SOP"]
    draw = median_seconds({"draw": lambda: (sop.cls_bank.sops(), sop.patch_bank.sops())}, device, args.warmup,
                          args.repeats)["draw"]
    print(f"steps: {steps}, drawing SOPs: {draw}", flush=True)
    knn = knn_times(args, device)
    print(f"kNN: {knn}", flush=True)
    command = shlex.join(["python", "benchmarks/sop_cost.py", *sys.argv[1:]])
    text = report(command, args, device, steps, draw, knn)
    write_report(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
