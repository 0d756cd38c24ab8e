"""Config layering: overrides and flattening invert each other, later layers win key by key, relative
paths start at the folder of the file that names them, and a mistake is refused in one line."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from repsim.errors import SpecError
from repsim.experiment import load_experiment
from repsim.layering import (TAG_FIELDS, Layer, flatten, inline, merge, merge_layers, origin, override_layers,
                             parse_override, read_layer, read_once, resolve_path, resolve_paths, set_dotted)
from repsim.methods.config import load_config

REPO = Path(__file__).resolve().parents[1]

keys = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(lambda key: key not in TAG_FIELDS)
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
           | st.sampled_from(["yes", "null", "1e3", "~", "[a]", "{}", "a: b", "x=y", "#", ""]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
                      max_leaves=10)
trees = st.dictionaries(keys, values, max_size=4)


def applied(overrides: list[str]) -> dict:
    """The tree that ``overrides`` set, one after the other, starting from nothing."""
    return functools.reduce(lambda tree, override: set_dotted(tree, *parse_override(override, "a=1")), overrides, {})


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(tree=trees)
def test_a_mapping_overrides_as_the_strings_that_set_each_of_its_values(tree):
    strings = [f"{key}={inline(value)}" for key, value in flatten(tree).items()]
    assert applied(strings) == tree
    assert override_layers(tree, "a=1") == [layer for string in strings for layer in override_layers(string, "a=1")]
    assert merge_layers(override_layers(tree, "a=1")) == tree


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(dotted=st.lists(keys, min_size=1, max_size=4).map(".".join), value=scalars)
def test_one_override_flattens_back_to_its_key_and_value(dotted, value):
    assert flatten(applied([f"{dotted}={inline(value)}"])) == {dotted: value}


@pytest.mark.parametrize("text, value", [
    ("0.1", 0.1), ("1e-3", "1e-3"), ("1.0e-3", 1e-3), ("false", False), ("null", None), ("", None),
    ("[knn, linear]", ["knn", "linear"]), ("{a: 1}", {"a": 1}), ("'yes'", "yes"), ("a=b", "a=b"),
    (".inf", math.inf)])
def test_override_values_parse_as_yaml(text, value):
    assert parse_override(f"optim.lr={text}", "optim.lr=0.01") == (["optim", "lr"], value)


def test_setting_a_dotted_key_keeps_its_siblings_and_copies():
    tree = {"optim": {"lr": 1, "epochs": 2}, "seed": {"x": 1}}
    assert set_dotted(tree, ["optim", "lr"], 3) == {"optim": {"lr": 3, "epochs": 2}, "seed": {"x": 1}}
    assert set_dotted(tree, ["seed", "x", "y"], 4)["seed"] == {"x": {"y": 4}}  # a scalar on the way becomes a mapping
    assert tree == {"optim": {"lr": 1, "epochs": 2}, "seed": {"x": 1}}


def test_later_layers_win_key_by_key_and_a_changed_tag_replaces_the_mapping():
    defaults = Layer("defaults", {"optim": {"lr": 1, "epochs": 10}, "method": {"name": "xclr", "t": 0.1,
                                                                                  "similarity": {"type": "captions",
                                                                                                 "model": "m"}}})
    config = Layer("config", {"optim": {"lr": 2}, "method": {"similarity": {"type": "matrix", "path": "p"}}})
    override = Layer("override", {"optim": {"lr": 3}, "tags": [1]})
    assert merge_layers([defaults, config, override]) == {
        "optim": {"lr": 3, "epochs": 10}, "tags": [1],
        "method": {"name": "xclr", "t": 0.1, "similarity": {"type": "matrix", "path": "p"}}}
    assert merge({"method": {"name": "xclr", "t": 0.1}}, {"method": {"name": "sop"}}) == {"method": {"name": "sop"}}
    assert merge({"a": {"b": 1}}, {"a": 5}) == {"a": 5} and merge({"a": 5}, {"a": {"b": 1}}) == {"a": {"b": 1}}
    assert origin([defaults, config, override], ["optim", "lr"]) == "override"
    assert origin([defaults, config, override], ["optim", "epochs"]) == "defaults"
    assert origin([defaults, config, override], ["model"]) is None


def test_shipped_defaults_lie_under_a_config_and_overrides_over_it(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("method: {name: simclr}\noptim: {lr: 0.5, epochs: 3}\n")
    loaded = load_config(config, ["optim.lr=0.25"])
    defaults = load_config(REPO / "configs" / "simclr.yaml")
    assert (loaded.optim.lr, loaded.optim.epochs, loaded.optim.batch_size) == (0.25, 3, defaults.optim.batch_size)


def test_relative_paths_start_at_the_folder_of_their_file(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"spec": "../specs/s.yaml"}, "image": {"path": "/abs/e"},
                                    "method": {"similarity": {"path": "~/m.csv"}}, "other": "x.yaml"}))
    layer = read_layer(path, "config", "c.yaml", ["data.spec", "image.path", "method.similarity.path", "absent.path"])
    assert layer.values == {"data": {"spec": str(tmp_path / "specs" / "s.yaml")}, "image": {"path": "/abs/e"},
                            "method": {"similarity": {"path": os.path.expanduser("~/m.csv")}}, "other": "x.yaml"}
    monkeypatch.chdir(tmp_path)
    [overridden] = override_layers("data.spec=s.yaml", "a=1", ["data.spec"])
    assert overridden.values == {"data": {"spec": str(tmp_path / "s.yaml")}}  # the working directory


def test_the_bare_name_of_a_shipped_file_is_that_file_unless_one_lies_beside(tmp_path, monkeypatch):
    from repsim.shipped import shipped

    spec = shipped("data spec")["animal-mnist-2000"]
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"method": {"name": "simclr"}, "data": {"spec": "animal-mnist-2000"}}))
    monkeypatch.chdir(tmp_path)
    assert load_config(config).data.spec == spec
    assert load_config(config, ["data.spec=fashion-mnist-2000.yaml"]).data.spec == shipped("data spec")["fashion-mnist-2000"]
    (tmp_path / "animal-mnist-2000").write_text("name: mine\n")
    assert load_config(config).data.spec == tmp_path / "animal-mnist-2000"  # a file of that name beside wins
    assert resolve_path("nothing-shipped", Path("/base")) == "/base/nothing-shipped"


def test_a_star_steps_into_every_item_and_urls_stay():
    tree = {"stages": [{"methods": [{"config": "a.yaml"}, {"config": 3}]}, {"config": "b/./c.yaml"}, "text"]}
    resolved = resolve_paths(tree, ["stages.*.methods.*.config", "stages.*.config"], Path("/base"))
    assert resolved == {"stages": [{"methods": [{"config": "/base/a.yaml"}, {"config": 3}]},
                                   {"config": "/base/b/c.yaml"}, "text"]}
    assert tree["stages"][0]["methods"][0]["config"] == "a.yaml"  # a copy
    assert [resolve_path(url, Path("/base")) for url in ["https://h/x.tar", "s3://b/x", "pipe:curl x", "http/x"]] == [
        "https://h/x.tar", "s3://b/x", "pipe:curl x", "/base/http/x"]


def test_an_experiment_resolves_its_paths_like_a_config(tmp_path, monkeypatch):
    folder = tmp_path / "experiments"
    folder.mkdir()
    path = folder / "e.yaml"
    path.write_text(yaml.safe_dump({"name": "e", "data": "../spec.yaml",
                                    "stages": [{"kind": "train", "methods": [{"config": "../c/x.yaml"}]}]}))
    monkeypatch.chdir(REPO)
    experiment = load_experiment(path, ["train.methods=[{config: configs/simclr.yaml}]"])
    assert experiment.data == tmp_path / "spec.yaml"  # the file's folder
    assert experiment.section("train").methods[0].config == REPO / "configs" / "simclr.yaml"  # the cwd


@pytest.mark.parametrize("overrides, expected", [
    (["optim.lrr=1"], "override 'optim.lrr=1': unknown field 'optim.lrr'; did you mean 'lr'?"),
    (["optim.lr"], "override 'optim.lr' is not of the form key=value; write it like optim.lr=0.01"),
    (["optim..lr=1"], "override 'optim..lr=1' is not of the form key=value"),
    (["optim.lr=[1"], "override 'optim.lr=[1': the value is not valid YAML; quote it or fix its syntax"),
    (["optim.lr=-1", "optim.epochs=2"], "override 'optim.lr=-1': field 'optim.lr': Input should be greater"),
])
def test_a_bad_override_is_refused_in_one_line_naming_it(overrides, expected):
    with pytest.raises(SpecError) as refused:
        load_config("simclr", overrides)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_an_unknown_key_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("method: {name: simclr}\noptim: {lrr: 1}\n")
    with pytest.raises(SpecError) as refused:
        load_config(path, ["optim.epochs=2"])
    assert str(refused.value).startswith(f"{path}: unknown field 'optim.lrr'; did you mean 'lr'?")
    assert "\n" not in str(refused.value)


def test_inside_read_once_a_file_is_read_once_until_it_changes(tmp_path, monkeypatch):
    import repsim.layering as layering

    reads = []
    read = layering.read_yaml_mapping
    monkeypatch.setattr(layering, "read_yaml_mapping", lambda *args: reads.append(args[0]) or read(*args))
    config = tmp_path / "config.yaml"
    config.write_text("method: {name: simclr}\noptim: {lr: 0.1}\n")
    with read_once():
        first, again = load_config(config), load_config(config, ["optim.lr=0.2"])
        assert (first.optim.lr, again.optim.lr, len(reads)) == (0.1, 0.2, 1)  # one read, each override applied
        with read_once():  # nested: the same reads
            load_config(config)
        assert len(reads) == 1
        config.write_text("method: {name: simclr}\noptim: {lr: 0.05}\n")  # changed: read again
        assert load_config(config).optim.lr == 0.05 and len(reads) == 2
    load_config(config)
    load_config(config)
    assert len(reads) == 4  # outside the block every call reads the file


def test_keyed_values_leave_out_the_fields_marked_at_any_depth_and_when_set_ones_only_while_none():
    from pydantic import BaseModel, Field

    from repsim.layering import KEYED_WHEN_SET, NOT_KEYED, keyed_values

    class Inner(BaseModel):
        kept: int = 1
        path: str = Field("a.csv", json_schema_extra=NOT_KEYED)

    class Outer(BaseModel):
        inner: Inner = Inner()
        threads: int = Field(4, json_schema_extra=NOT_KEYED)
        workers: int | None = Field(None, json_schema_extra=KEYED_WHEN_SET)
        lr: float = 0.1

    assert keyed_values(Outer()) == {"inner": {"kept": 1}, "lr": 0.1}
    assert keyed_values(Outer(workers=2, threads=1, inner=Inner(path="b.csv"))) == {
        "inner": {"kept": 1}, "workers": 2, "lr": 0.1}
