"""Data specs: the shipped specs validate; every malformed spec fails in one line naming file, field, fix."""

from pathlib import Path

import pytest
import yaml

from repsim.data.spec import DataSpec, load_spec
from repsim.errors import SpecError

SPECS = Path(__file__).parent.parent / "data_specs"


def write(tmp_path, spec: dict) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def animal(tmp_path):
    return yaml.safe_load((SPECS / "animal-mnist.yaml").read_text())


def test_shipped_specs_validate():
    fashion = load_spec(SPECS / "fashion-mnist.yaml")
    assert fashion.class_names[0] == "T-shirt/top" and fashion.classes["Sneaker"] == "gym_shoe.n.01"
    assert len(fashion.classes) == 10 and fashion.split.type == "source"
    animal = load_spec(SPECS / "animal-mnist.yaml")
    assert animal.class_names == ["bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse",
                                  "sheep", "zebra"]
    assert animal.split.fractions == {"train": 0.8, "test": 0.2}


@pytest.mark.parametrize("mutate, expected", [
    (lambda s: s.update(shard_sise=10), "unknown field 'shard_sise'; did you mean 'shard_size'?"),
    (lambda s: s["source"].update(rooot="x"), "unknown field 'source.rooot'; did you mean 'root'?"),
    (lambda s: s["source"].update(type="animal_mnsit"), "field 'source.type' is 'animal_mnsit', which is not known; use one of"),
    (lambda s: s["classes"].update(bear=None), "class 'bear' in field 'classes' has no valid WordNet synset"),
    (lambda s: s["classes"].update(bear="a bear"), "class 'bear' has synset 'a bear', not of the form lemma.n.01"),
    (lambda s: s.pop("name"), "field 'name' is required"),
    (lambda s: s["split"]["fractions"].update(train=0.9), "field 'split.fractions': fractions sum to 1.1, not 1"),
    (lambda s: s.pop("classes"), "is labelled and needs a classes list"),
    (lambda s: s["source"].update(root="no/such/folder"), "field 'source.root' points at"),
])
def test_malformed_spec_fails_in_one_line_naming_file_and_field(tmp_path, animal, mutate, expected):
    mutate(animal)
    path = write(tmp_path, animal)
    with pytest.raises(SpecError) as raised:
        load_spec(path)
    message = str(raised.value)
    assert "\n" not in message and str(path) in message and expected in message
    assert "; " in message  # what went wrong; how to fix it


def test_spec_errors_without_a_schema():
    with pytest.raises(SpecError, match="does not exist; check the path"):
        load_spec("no-such-spec.yaml")


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nsource: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML at line"):
        load_spec(path)


def test_relative_paths_resolve_against_the_spec_folder(tmp_path):
    (tmp_path / "images").mkdir()
    spec = load_spec(write(tmp_path, {"name": "mine", "source": {"type": "image_folder", "root": "images"},
                                      "classes": {"cat": "cat.n.01"}}))
    assert spec.source.root == tmp_path / "images"


def test_captions_rotate_through_templates_deterministically():
    spec = DataSpec.model_validate({
        "name": "x", "source": {"type": "animal_mnist"}, "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
        "captions": {"templates": ["a {name}.", "the {name}!"]}})
    assert [spec.caption_for(1, i) for i in range(3)] == ["a dog.", "the dog!", "a dog."]
    with pytest.raises(ValueError, match="may only use the field"):
        DataSpec.model_validate({**spec.model_dump(), "captions": {"templates": ["a {label}"]}})
