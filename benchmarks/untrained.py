"""The untrained-encoder floor: the evaluate stage's kNN on the features of a randomly initialised backbone.

A self-supervised encoder that scores below its own initialisation has not learned yet at its budget, whatever
it scores against the raw pixels. Each seed initialises the backbone as the train stage would (``torch``'s
default initialisation after ``torch.manual_seed(seed)``), in eval mode, saved as an ``encoder.pt``; its
features are scored by the evaluate stage's kNN on a data spec's splits.

    python benchmarks/untrained.py [--spec data_specs/animal-mnist-val.yaml] [--test-split val] [--seeds 0 1 2]

Prints a table (backbone, stem, seed, kNN top-1) with the mean ± std and writes it to benchmarks/results/untrained.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from repsim.data import load_spec, shard
from repsim.data.loader import peek_image
from repsim.eval.stage import evaluate_features, extract_features, read_results
from repsim.models.backbones import backbone, save_encoder
from _report import markdown, write_report

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "benchmarks" / "results" / "untrained.md"


def untrained_knn(spec: Path, test_split: str, seed: int, name: str, small_images: bool, k: int) -> float:
    """kNN top-1 on ``test_split`` (memory: the train split) of backbone ``name`` as initialised under ``seed``."""
    shards = shard(load_spec(spec), progress=False)
    channels, size = peek_image(str(shards.shards["train"][0]))
    torch.manual_seed(seed)
    encoder = backbone(name, channels, size, small_images=small_images).eval()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "encoder.pt"
        save_encoder(encoder, path, size)
        train, test = (extract_features(shards, str(path), split, progress=False) for split in ("train", test_split))
        results = read_results(evaluate_features(train, test, ["knn"], [k]))
    return results["suites"]["knn"][f"knn_top1_k{k}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "data_specs" / "animal-mnist-val.yaml")
    parser.add_argument("--test-split", default="val")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--small-images", action="store_true", help="the small-image stem (default: the standard one)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args()
    scores = [untrained_knn(args.spec, args.test_split, seed, args.backbone, args.small_images, args.k)
              for seed in args.seeds]
    stem = "small-image" if args.small_images else "standard"
    rows = [[args.backbone, stem, str(seed), f"{100 * score:.2f}"] for seed, score in zip(args.seeds, scores)]
    rows.append([args.backbone, stem, "mean ± std", f"{100 * statistics.mean(scores):.2f} ± "
                                                      f"{100 * statistics.stdev(scores) if len(scores) > 1 else 0:.2f}"])
    table = markdown(["backbone", "stem", "seed", f"kNN top-1 (k = {args.k}, %)"], rows)
    report = (f"# The untrained-encoder floor\n\nData: `{args.spec.relative_to(ROOT)}`, memory its train split, "
              f"scored on its {args.test_split} split. Produced by `python benchmarks/untrained.py`.\n\n{table}\n")
    print(table)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
