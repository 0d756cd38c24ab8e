"""The project files that ``repsim train`` passes through between the command line and ``Trainer.fit``.

A profiler hook (``sys.setprofile``, and ``threading.setprofile`` for the Prefect task's thread)
records every function call into a file of this repository (``repsim/``, ``tasks/``, ``flows/``)
from ``repsim.flows.cli.main`` on, until the first call of ``Trainer.fit``, on a tiny generated dataset
(2 classes, 8 images each, one training step). It prints how many files those calls enter and the
returns (calls that come back into a file entered before, other than the one just left), then the
same for the call stack at ``Trainer.fit``: the path from the command line into the trainer, and how
many times each settings file was read.

    python benchmarks/call_path.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
SOURCES = tuple(str(REPO / folder) + "/" for folder in ("repsim", "tasks", "flows"))


def tiny_config(folder: Path) -> Path:
    """A SimCLR config on 16 images of 16 px in two classes, trained for one step."""
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (folder / "images" / name).mkdir(parents=True)
        for index in range(8):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
                folder / "images" / name / f"{index}.png")
    (folder / "spec.yaml").write_text(
        f"name: pets\nsource: {{type: image_folder, root: {folder / 'images'}}}\n"
        "classes: {cat: cat.n.01, dog: dog.n.01}\nsplit: {type: random, fractions: {train: 0.5, test: 0.5}}\n")
    config = folder / "config.yaml"
    config.write_text(f"data: {{spec: {folder / 'spec.yaml'}, image_size: 16}}\nmethod: {{name: simclr}}\n"
                      "optim: {batch_size: 4, max_steps: 1, num_workers: 0, warmup_epochs: 0}\nmonitor: {knn: false}\n"
                      "model: {small_images: false, projection_dim: 8, projection_hidden_dim: 16}\n")
    return config


class CallPath:
    """The project files that function calls enter (module imports left out) until ``Trainer.fit`` is
    called, and the call stack at that moment: the main thread's (the command line down to where it
    waits on the flow) followed by the training thread's (the Prefect task down to ``fit``)."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.stack: list[str] = []
        self.reads: Counter[str] = Counter()  # settings file name: times read
        self.done = threading.Event()

    def __call__(self, frame, event: str, _arg) -> None:
        if event != "call" or self.done.is_set() or frame.f_code.co_name == "<module>":
            return
        name = _project_file(frame)
        if name is None:
            return
        if not self.files or self.files[-1] != name:
            self.files.append(name)
        if frame.f_code.co_name == "read_yaml_mapping" and name == "repsim/config_errors.py":
            self.reads[Path(frame.f_locals["path"]).name] += 1
        if frame.f_code.co_name == "fit" and name == "repsim/methods/trainer.py":
            main = sys._current_frames()[threading.main_thread().ident]
            threads = [main] if main is frame else [main, frame]
            self.stack = [file for top in threads for file in _stack_files(top)]
            self.done.set()


def _project_file(frame) -> str | None:
    path = frame.f_code.co_filename
    return str(Path(path).relative_to(REPO)) if path.startswith(SOURCES) else None


def _stack_files(top) -> list[str]:
    """The project files of the frames from the thread's first one down to ``top``, a run of frames
    in one file counted once."""
    frames = []
    while top is not None:
        frames.append(top)
        top = top.f_back
    files = [name for name in map(_project_file, reversed(frames)) if name is not None]
    return [name for position, name in enumerate(files) if position == 0 or files[position - 1] != name]


def returns(files: list[str]) -> int:
    """Entries into a file entered before, other than the one just left."""
    return sum(name in files[:position] for position, name in enumerate(files))


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        os.environ["REPSIM_HOME"] = str(Path(folder) / "home")  # stores and outputs of its own
        from repsim.flows.cli import main as repsim

        config = tiny_config(Path(folder))
        path = CallPath()
        threading.setprofile(path)
        sys.setprofile(path)
        try:
            status = repsim(["train", str(config)])
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    print(f"repsim train exited with {status}; Trainer.fit reached: {path.done.is_set()}")
    print(f"function calls enter {len(set(path.files))} project files before Trainer.fit, "
          f"with {returns(path.files)} returns to a file entered before")
    print(f"the call stack at Trainer.fit passes {len(set(path.stack))} project files, with {returns(path.stack)} "
          f"returns: {' > '.join(path.stack)}")
    print("settings files read before Trainer.fit: " + ", ".join(f"{name} {count}x" for name, count in path.reads.items()))

if __name__ == "__main__":
    main()
