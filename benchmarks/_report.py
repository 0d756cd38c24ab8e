"""What the benchmarks share: markdown tables, reports that keep their analysis, timing of alternated steps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of ``rows`` under ``header``."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


ANALYSIS = "## Analysis"  # a rerun rewrites a report above this heading and keeps what follows


def write_report(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, keeping the hand-written analysis of an existing report there."""
    existing = path.read_text() if path.is_file() else ""
    kept = existing[existing.index(ANALYSIS):] if ANALYSIS in existing else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n\n" + kept if kept else text)


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(steps: dict[str, Callable[[], object]], device: torch.device, warmup: int,
                   repeats: int) -> dict[str, float]:
    """Median wall-clock seconds of each step, the steps alternated so that load drifts hit all alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            synchronise(device)
            started = time.perf_counter()
            step()
            synchronise(device)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(spent) for name, spent in times.items()}
