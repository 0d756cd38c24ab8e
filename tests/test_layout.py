"""docs/layout.md is held to the tree both ways: every module and package of repsim, tasks/ and flows/ is
named under its folder, every top-level entry of the repository has a line, and every module the page
names exists where it says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULE = re.compile(r"(?<![/\w])([A-Za-z_]\w*\.py)\b")  # a module of the section's own folder, not a/b.py


def layout_block() -> list[str]:
    """The lines of the page's tree (its first fenced block)."""
    text = (REPO / "docs" / "layout.md").read_text()
    return text.split("```\n", 2)[1].splitlines()


def sections(lines: list[str]) -> dict[str, str]:
    """Each folder entry (``repsim/``, ``repsim/data/``) with the text of its section: its line and every
    line after it indented deeper than its name, nested folders included."""
    found: dict[str, str] = {}
    open_folders: list[tuple[int, str]] = []  # (column, path) of the folders around the current line
    for line in lines:
        column = len(line) - len(line.lstrip())
        entry = line.split()[0] if line.strip() else ""
        while open_folders and column <= open_folders[-1][0]:
            open_folders.pop()
        if entry.endswith("/") and column < 15:  # an entry, not a description's continuation
            path = "".join(name for _, name in open_folders) + entry
            open_folders.append((column, path))
            found[path] = ""
        for _, path in open_folders:
            found[path] += line + "\n"
    return found


def top_entries(lines: list[str]) -> set[str]:
    """The names the page gives a line of their own at the top level."""
    return {line.split()[0].rstrip(",") for line in lines if line and not line[0].isspace()}


def test_every_module_is_named_under_its_folder():
    named = sections(layout_block())
    for folder in ("repsim", "tasks", "flows"):
        for path in sorted((REPO / folder).rglob("*.py")):
            package = path.parent.relative_to(REPO).as_posix() + "/"
            if path.name == "__init__.py":
                assert package in named, f"docs/layout.md has no line for the package {package}"
            else:
                assert path.name in MODULE.findall(named.get(package, "")), (
                    f"docs/layout.md does not name {path.relative_to(REPO)} under {package}")


def test_every_module_the_page_names_exists_in_its_folder():
    for folder, text in sections(layout_block()).items():
        if (REPO / folder).is_dir() and folder.split("/")[0] in ("repsim", "tasks", "flows"):
            for name in MODULE.findall(text):
                assert list((REPO / folder).rglob(name)), f"docs/layout.md names {name} under {folder}, which has none"


def test_every_top_level_entry_of_the_repository_has_a_line():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    top = {name.split("/")[0] + ("/" if "/" in name else "") for name in tracked.splitlines()}
    entries = top_entries(layout_block())
    hidden = {name for name in top if name.startswith(".") and name != ".ci/"}  # .gitignore and the like
    missing = sorted(name for name in top - hidden - {".ci/", ".env.example"} if name not in entries)
    assert not missing, f"docs/layout.md has no line for {missing}"
    assert ".ci/run" in entries and not {entry for entry in entries if not (REPO / entry).exists()}


def test_sections_nest_folders_under_their_parent():
    named = sections(["repsim/  the library", "  data/  spec.py", "               loader.py", "  stage.py  x",
                      "tasks/  t.py"])
    assert named["repsim/data/"] == "  data/  spec.py\n               loader.py\n"
    assert "stage.py" in named["repsim/"] and "stage.py" not in named["repsim/data/"]
    assert named["tasks/"] == "tasks/  t.py\n"
