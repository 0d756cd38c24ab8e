"""The YAML files shipped with repsim, found by name: configs, experiments and data specs.

The top-level ``configs/``, ``experiments/`` and ``data_specs/`` install as ``repsim.configs``,
``repsim.experiments`` and ``repsim.data_specs``, so the relative paths between them hold when
installed. Every loader passes its file argument through :func:`locate`.
"""

from __future__ import annotations

import stat
from importlib.resources import files
from pathlib import Path

from repsim.errors import SpecError

FOLDERS = {"config": "configs", "experiment": "experiments", "deployments file": "experiments",
           "data spec": "data_specs"}  # kind of file -> its package folder
SUFFIX = ".yaml"


def folder(kind: str) -> Path:
    """The installed folder of the shipped files of ``kind`` (a key of FOLDERS)."""
    return Path(str(files(f"repsim.{FOLDERS[kind]}")))  # installed as files: editable, or an unpacked wheel


def shipped(kind: str) -> dict[str, Path]:
    return {path.stem: path for path in sorted(folder(kind).glob(f"*{SUFFIX}"), key=lambda path: path.stem)}


def packaged(kind: str, name: str) -> Path:
    """The shipped ``kind`` file ``name``; SpecError naming the file when the installation lacks it."""
    path = folder(kind) / f"{name}{SUFFIX}"
    if not path.is_file():
        raise SpecError(f"the packaged {kind} {path} is missing",
                        "reinstall repsim (make setup, or pip install the wheel again)")
    return path


def locate(path: str | Path, kind: str) -> Path:
    """``path`` if it is a file; else the shipped ``kind`` file of a bare name (``xclr`` or ``xclr.yaml``); else
    ``path`` if anything is there (the reader says what); else SpecError listing the shipped names, or in one
    line when the system refuses to look (a name too long, a loop of links, a NUL byte)."""
    given = Path(path)
    try:
        found = given.stat()
    except (FileNotFoundError, NotADirectoryError):
        found = None
    except (OSError, ValueError) as err:
        reason = getattr(err, "strerror", None) or err
        raise SpecError(f"{kind} {path!r} cannot be looked up ({reason})", "check the path") from None
    if found is not None and stat.S_ISREG(found.st_mode):
        return given
    choices = shipped(kind)
    name = str(path).removesuffix(SUFFIX)
    if Path(name).name == name and name in choices:
        return choices[name]
    if found is not None:
        return given
    raise SpecError(f"{kind} {path} does not exist",
                    f"check the path, or name a shipped {kind}: {', '.join(choices)}")
