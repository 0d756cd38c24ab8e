"""Fuzzing the file arguments: whatever bytes, text or YAML mapping a spec, config, experiment or
deployments file holds, every command that reads it answers with one line and exit 2, before any
orchestration starts."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from repsim.flows.cli import main

COMMANDS = [["shard"], ["precompute", "all"], ["eval"], ["train"], ["align"], ["run", "--plan"], ["serve"]]
FIELDS = ["name", "source", "type", "root", "path", "urls", "classes", "captions", "templates", "split",
          "fractions", "shard_size", "method", "data", "spec", "optim", "epochs", "lr", "model", "similarity",
          "image", "text", "geometry", "train", "methods", "evaluate", "align", "config", "settings",
          "overrides", "sweep", "seeds", "deployments", "experiment", "schedule"]  # the schemas' field names
WORDS = ["image_folder", "manifest", "fashion_mnist", "random", "source", "xclr", "simclr", "gera", "encoder",
         "pixels", "matrix", "graph", "captions", "wordnet", ".", "..", "/", "~", "default"]

FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
           | st.sampled_from(WORDS + FIELDS))
keys = st.sampled_from(FIELDS) | st.text(max_size=12) | st.integers()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=12)
mappings = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=12), values, max_size=6)


def answers_in_one_line(command: list[str], content: bytes, tmp_path, capsys, repsim_home) -> None:
    """``repsim <command> FILE`` with ``content`` in FILE exits 2 with one line, starting no Prefect."""
    path = tmp_path / "fuzzed.yaml"
    path.write_bytes(content)
    code = main([*command, str(path)])
    err = capsys.readouterr().err
    assert (code, err.count("\n"), err[:7]) == (2, 1, "error: "), err
    assert not (repsim_home / "prefect").exists()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@FUZZ
@given(content=st.binary(max_size=200))
def test_random_bytes_as_file_are_one_line(command, content, tmp_path, capsys, repsim_home):
    answers_in_one_line(command, content, tmp_path, capsys, repsim_home)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@FUZZ
@given(text=st.text(max_size=200))
def test_random_text_as_file_is_one_line(command, text, tmp_path, capsys, repsim_home):
    answers_in_one_line(command, text.encode(), tmp_path, capsys, repsim_home)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@FUZZ
@given(mapping=mappings)
def test_random_yaml_mappings_as_file_are_one_line(command, mapping, tmp_path, capsys, repsim_home):
    answers_in_one_line(command, yaml.safe_dump(mapping).encode(), tmp_path, capsys, repsim_home)
