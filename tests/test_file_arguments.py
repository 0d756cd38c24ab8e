"""Every file argument is checked before it is read: a directory, a FIFO, a binary file, text that is
not UTF-8, invalid YAML or a top level that is not a mapping of fields is refused by every command
in one line, exit 2, before any orchestration starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from repsim.flows.cli import main
from repsim.methods.config import load_config

COMMANDS = {  # the commands that read a file argument -> what they call it
    ("shard",): "data spec", ("precompute", "all"): "data spec", ("eval",): "data spec",
    ("train",): "config", ("align",): "config", ("run", "--plan"): "experiment", ("serve",): "deployments file"}
CONTENTS = {  # a bad file -> what the one line says about it, after the file's name
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", " is a binary file (it holds NUL bytes), not YAML text; "
                                                       "give the path of a YAML file"),
    "latin-1": ("name: café\n".encode("latin-1"), " is not UTF-8 text (byte 0xe9 at offset 9); save it as UTF-8"),
    "bad YAML": (b"name: x\nsource: [unclosed\n", ": not valid YAML at line 3; fix the YAML syntax"),
    "a list": (b"- name: x\n", ": the top level is a list, not a mapping of fields; start from "),
    "text": (b"just words\n", ": the top level is text, not a mapping of fields; start from "),
    "empty": (b"", ": the top level is empty, not a mapping of fields; start from "),
    "a number key": (b"1: x\n", ": the top-level key 1 is not a field name; start from "),
    "too deep": (b"[" * 5000, ": the YAML nests too deeply to read; start from "),
}


def one_line(argv: list[str], capsys, repsim_home) -> str:
    """The one line ``repsim <argv>`` prints, asserting exit 2 and that no Prefect started."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert not (repsim_home / "prefect").exists()
    return err.removeprefix("error: ").removesuffix("\n")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("case", CONTENTS)
def test_a_file_that_is_not_a_yaml_mapping_is_one_line(tmp_path, capsys, repsim_home, command, case):
    content, said = CONTENTS[case]
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    kind = COMMANDS[command]
    line = one_line([*command, str(path)], capsys, repsim_home)
    named = f"{kind} {path}" if said.startswith(" is") else str(path)
    assert line.startswith(named + said), line


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_directory_or_a_fifo_is_not_read(tmp_path, capsys, repsim_home, command):
    kind = COMMANDS[command]
    (tmp_path / "folder.yaml").mkdir()
    os.mkfifo(tmp_path / "pipe.yaml")  # reading it would wait for a writer forever
    for name, what in (("folder.yaml", "a directory"), ("pipe.yaml", "not a regular file")):
        line = one_line([*command, str(tmp_path / name)], capsys, repsim_home)
        assert line == f"{kind} {tmp_path / name} is {what}; give the path of a YAML file"


def test_a_name_the_system_refuses_is_one_line(capsys, repsim_home):
    line = one_line(["train", "x" * 5000], capsys, repsim_home)
    assert line.endswith("cannot be looked up (File name too long); check the path")


def test_a_shipped_name_wins_over_a_directory_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "xclr").mkdir()
    assert load_config("xclr").method.name == "xclr"


def test_a_byte_order_mark_is_read_as_utf8(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes("\ufeffmethod: {name: simclr}\n".encode())
    assert load_config(path).method.name == "simclr"


@pytest.mark.parametrize(("argv", "kind"), [
    (["train", "xclr", "--set", "data.spec={bad}"], "data spec"),
    (["align", "gera", "--set", "data.spec={bad}"], "data spec"),
    (["run", "default", "--plan", "--set", "data={bad}"], "data spec"),
    (["run", "default", "--plan", "--set", "train.methods=[{{config: {bad}}}]"], "config"),
])
def test_file_paths_inside_files_are_checked_the_same_way(tmp_path, capsys, repsim_home, argv, kind):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe")
    line = one_line([part.format(bad=bad) for part in argv], capsys, repsim_home)
    assert line == f"{kind} {bad} is not UTF-8 text (byte 0xff at offset 0); save it as UTF-8"


def test_a_deployment_naming_a_bad_experiment_is_one_line(tmp_path, capsys, repsim_home):
    (tmp_path / "folder").mkdir()
    deployments = tmp_path / "deployments.yaml"
    deployments.write_text("deployments:\n  - {name: nightly, experiment: folder}\n")
    line = one_line(["serve", str(deployments)], capsys, repsim_home)
    assert line == f"experiment {tmp_path / 'folder'} is a directory; give the path of a YAML file"


def no_encoder_inside(folder: Path) -> tuple[Path, str]:
    return folder, f"encoder {folder} does not exist (no encoder.pt inside)"


def not_written_by_torch(folder: Path) -> tuple[Path, str]:
    (folder / "encoder.pt").write_text("not a torch archive\n")
    return folder / "encoder.pt", f"encoder {folder / 'encoder.pt'} is not an archive that repsim.models.save_encoder wrote"


def record_not_utf8(folder: Path) -> tuple[Path, str]:
    import torch

    torch.save({}, folder / "encoder.pt")
    (folder / "stage.json").write_bytes(b'{"stage": "train\xff"}')
    return folder, f"{folder / 'stage.json'} is unreadable"


@pytest.mark.parametrize("bad_encoder", [no_encoder_inside, not_written_by_torch, record_not_utf8],
                         ids=lambda case: case.__name__)
def test_an_unusable_encoder_is_one_line(tmp_path, capsys, repsim_home, bad_encoder):
    argument, expected = bad_encoder(tmp_path)
    assert one_line(["eval", "animal-mnist", "--encoder", str(argument)], capsys, repsim_home).startswith(expected)


def test_shard_out_naming_a_file_is_refused_before_anything_is_written(tmp_path, capsys, repsim_home):
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me\n")
    line = one_line(["shard", "animal-mnist", "--out", str(mine)], capsys, repsim_home)
    assert line == f"--out {mine} is a file, not a directory; name a new or existing directory"
    assert mine.read_text() == "keep me\n"
