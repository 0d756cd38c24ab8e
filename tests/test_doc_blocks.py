"""Every fenced ``bash``, ``python``, ``yaml`` and ``toml`` block of README.md and docs/*.md runs, page by page
and in the page's order, in a working directory of its own with its own ``$REPSIM_HOME``. There, tiny files
under the shipped names (``animal-mnist``, ``xclr``, ``default``, ``configs/xclr.yaml``, ...) win over the
shipped ones, as a file at the given path always does, so a page's commands run as written in seconds.

- ``bash``: the block, as one script under ``set -e``; ``<key>`` after ``artifacts/<stage>/`` is the newest
  output of that stage.
- ``python``: the block, as a script.
- ``yaml``: read by what reads it: a data spec, an experiment (checked and planned), a deployments file, or
  a fragment (``seeds``, ``sweep``) added to the page's last experiment.
- ``toml``: parsed; an entry-point table names the group repsim reads.

A block that cannot run here says why on the line above it: ``<!-- doc-test: skip -- why -->``, or
``<!-- doc-test: except "text" -- why -->`` to leave out the lines holding ``text``. An untyped block marked
``<!-- doc-test: output -->`` is what the block before it prints, compared with numbers and spaces
normalised. :func:`test_every_block_that_does_not_run_says_why` lists what is left out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from markdown_it import MarkdownIt
from PIL import Image

from e2e import REPO, TINY_ALIGN

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = ("bash", "python", "yaml", "toml")
IMAGES_PER_CLASS = 208  # half of them train: more than the 200 neighbours of the default kNN
MARKER = re.compile(r"<!-- doc-test: (?P<what>skip|except|output)(?P<args>.*?)-->\s*$")
EXCEPT = re.compile(r'"([^"]+)"\s*--\s*([^;]+)')
TINY_TRAIN = {"data": {"image_size": 16},
              "optim": {"epochs": 1, "batch_size": 32, "num_workers": 0, "warmup_epochs": 0},
              "model": {"small_images": False, "projection_dim": 8, "projection_hidden_dim": 16},
              "monitor": {"knn": False}}
TINY_SECTIONS = {"precompute": {"captions": True, "wordnet": ["wup"], "neighbors": 5},
                 "train": {"settings": TINY_TRAIN}, "evaluate": {"suites": ["knn"], "knn_k": [3]},
                 "align": {"settings": TINY_ALIGN}}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based, of the opening fence
    lang: str
    text: str
    marker: str = ""  # the doc-test marker on the line above, if any

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line} ({self.lang or 'untyped'})"

    @property
    def left_out(self) -> dict[str, str]:
        """What of the block does not run, and why: {"*": why} for the whole block, else {text: why}."""
        found = MARKER.search(self.marker)
        if found is None or found["what"] == "output":
            return {}
        if found["what"] == "skip":
            return {"*": found["args"].strip(" -")}
        return {text: why.strip() for text, why in EXCEPT.findall(found["args"])}


def page_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order, each with the marker on the line above it."""
    lines = page.read_text().splitlines()
    return [Block(page, token.map[0] + 1, token.info.split()[0] if token.info else "", token.content,
                  lines[token.map[0] - 1].strip() if token.map[0] else "")
            for token in MarkdownIt().parse(page.read_text()) if token.type == "fence"]


def test_every_block_that_does_not_run_says_why():
    unmarked, reasons = [], []
    for page in PAGES:
        for block in page_blocks(page):
            if MARKER.search(block.marker) is None and block.marker.startswith("<!-- doc-test"):
                unmarked.append(f"{block}: unreadable marker {block.marker!r}")
            for text, why in block.left_out.items():
                reasons.append(f"{block} {'' if text == '*' else repr(text) + ' '}— {why}")
                if not why:
                    unmarked.append(f"{block}: a marker without a reason")
            if block.lang not in RUN and block.lang and not block.left_out:
                unmarked.append(f"{block}: a block of {block.lang!r}, which the tests do not run")
    print("\n".join(["left out of the doc tests:", *reasons]))
    assert not unmarked, unmarked
    assert len(reasons) < 25  # most blocks run: what cannot is the exception


def test_markers_are_read():
    skip = Block(REPO, 1, "bash", "", "<!-- doc-test: skip -- needs a GPU -->")
    lines = Block(REPO, 1, "bash", "", '<!-- doc-test: except "s3://" -- a bucket; "repsim serve" -- serves -->')
    assert skip.left_out == {"*": "needs a GPU"}
    assert lines.left_out == {"s3://": "a bucket", "repsim serve": "serves"}


# ---------------------------------------------------------------------------------------------
# Running a page


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page in PAGES if any(block.lang in RUN for block in page_blocks(page))],
                         ids=lambda page: page.name)
def test_the_blocks_of_a_page_run_as_written(page, tmp_path):
    workdir = tiny_workdir(tmp_path)
    env = page_env(workdir)
    experiment: dict | None = None
    printed = ""
    for block in page_blocks(page):
        if "*" in block.left_out:
            continue
        if MARKER.search(block.marker) and MARKER.search(block.marker)["what"] == "output":
            assert normalised(block.text) in normalised(printed), f"{block}: the page shows\n{block.text}\nbut got\n{printed}"
        elif block.lang == "bash":
            printed = run(block, bash_script(block), ["bash", "-c"], workdir, env)
        elif block.lang == "python":
            printed = run(block, block.text, [sys.executable, "-c"], workdir, env)
        elif block.lang == "yaml":
            experiment = check_yaml(block, workdir, env, experiment)
        elif block.lang == "toml":
            check_toml(block)


def run(block: Block, script: str, command: list[str], workdir: Path, env: dict[str, str]) -> str:
    done = subprocess.run([*command, script], cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{block} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def bash_script(block: Block) -> str:
    """The block under ``set -ex``, its left-out lines dropped and each ``<key>`` of a stage's output folder the
    newest such output."""
    lines = [line for line in block.text.replace("\\\n", " ").splitlines()
             if not any(text in line for text in block.left_out)]
    script = "\n".join(re.sub(r"([\w${}:.\-/]*artifacts/(\w+))/<key>", r'\1/"$(ls -t \1 | head -n 1)"', line)
                       for line in lines)
    return f"PS4='+ [$SECONDS s] '\nset -ex\n{script}\n"


def check_yaml(block: Block, workdir: Path, env: dict[str, str], experiment: dict | None) -> dict | None:
    """Read the block as what it is (see the module's docstring); the page's experiment so far."""
    from repsim.data import load_spec
    from repsim.experiment import check_experiment, load_deployments, load_experiment

    values = yaml.safe_load(block.text)
    if "name" not in values and experiment is not None:  # a fragment: added to the page's example
        values = {**experiment, **values}
    folder = workdir if "source" in values else workdir / "experiments"  # where the page's relative paths start
    path = folder / f"{block.page.stem}-{block.line}.yaml"
    path.write_text(yaml.safe_dump(values))
    if "deployments" in values:
        load_deployments(path)
    elif "source" in values:
        load_spec(path)
    elif "stages" in values:
        check_experiment(load_experiment(path))
        run(block, f"repsim run {path} --plan", ["bash", "-c"], workdir, env)
        return values
    else:
        pytest.fail(f"{block}: not a data spec, an experiment or a deployments file, nor a fragment of one")
    return experiment


def check_toml(block: Block) -> None:
    from repsim.methods.config import METHODS
    from repsim.sections import SECTIONS

    tables = tomllib.loads(block.text)
    groups = tables.get("project", {}).get("entry-points", {})
    read = {METHODS.group, SECTIONS.group}
    assert groups and set(groups) <= read, f"{block}: entry points {sorted(groups)}, not among {sorted(read)}"


def normalised(text: str) -> str:
    return " ".join(re.sub(r"\d+(\.\d+)?", "N", text).split())


# ---------------------------------------------------------------------------------------------
# The tiny working directory


def tiny_workdir(tmp_path: Path) -> Path:
    """A working directory whose files under the shipped names describe 2 × 208 images of 16×16 pixels."""
    work = tmp_path / "work"
    for folder in ("data_specs", "configs", "experiments"):
        (work / folder).mkdir(parents=True)
    images = work / "images"
    rng = np.random.default_rng(0)
    for label, name in enumerate(("cat", "dog")):
        (images / name).mkdir(parents=True)
        for i in range(IMAGES_PER_CLASS):
            pixels = (rng.random((16, 16)) * 128 + 127 * label).astype(np.uint8)
            Image.fromarray(pixels, "L").save(images / name / f"{name}-{i}.png")
    spec = {"name": "pets", "source": {"type": "image_folder", "root": str(images)},
            "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
            "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}}
    for name in ("data_specs/animal-mnist.yaml", "animal-mnist", "fashion-mnist", "my-data.yaml"):
        write(work / name, spec)
    for path in (REPO / "configs").glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        tiny = TINY_ALIGN if "pairing" in config else TINY_TRAIN
        config = merged(config, tiny) | {"data": {**config.get("data", {}), **tiny.get("data", {}),
                                                   "spec": str(work / "animal-mnist")}}
        for name in (f"configs/{path.name}", path.stem, *(["my-method.yaml"] if path.stem == "xclr" else [])):
            write(work / name, config)
    for name in ("default", "my-experiment.yaml", "experiments/default.yaml", "default.yaml"):
        write(work / name, tiny_experiment(work))
    return work


def tiny_experiment(work: Path) -> dict:
    """The shipped default experiment, its sections shrunk (:data:`TINY_SECTIONS`) and on the tiny data."""
    experiment = yaml.safe_load((REPO / "experiments" / "default.yaml").read_text())
    stages = [merged(section, TINY_SECTIONS.get(section["kind"], {})) for section in experiment["stages"]]
    for section in stages:
        for method in section.get("methods", []):
            method["config"] = str(work / "configs" / Path(method["config"]).name)
        if "config" in section:
            section["config"] = str(work / "configs" / Path(section["config"]).name)
    return {**experiment, "data": str(work / "animal-mnist"), "stages": stages}


def merged(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s values, nested mappings merged."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write(path: Path, values: dict) -> None:
    path.write_text(yaml.safe_dump(values, sort_keys=False))


def page_env(workdir: Path) -> dict[str, str]:
    """This interpreter's environment with its own ``$REPSIM_HOME`` and stores, and ``repsim`` on the path."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "PREFECT_"))}
    return env | {"REPSIM_HOME": str(workdir / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                  "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
