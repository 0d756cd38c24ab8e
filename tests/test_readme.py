"""The README's Python example runs as written, on a tiny image folder in place of Animal-MNIST."""

import re

from e2e import REPO

import repsim.data
import repsim.methods.config

TINY = ["data.image_size=16", "optim.batch_size=8", "optim.num_workers=0", "optim.warmup_epochs=0",
        "model.small_images=false", "model.projection_dim=8", "model.projection_hidden_dim=16",
        "monitor.knn=false", "method.similarity={type: labels}"]


def readme_python_example() -> str:
    """The README's one ```python block under "The same chain from Python"."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("The same chain from Python"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_example_trains_and_evaluates(make_image_folder, write_spec, monkeypatch, capsys):
    root = make_image_folder({"cat": 24, "dog": 24}, size=16)
    spec = write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})
    load_spec, load_config = repsim.data.load_spec, repsim.methods.config.load_config
    monkeypatch.setattr(repsim.data, "load_spec", lambda name: load_spec(spec if name == "animal-mnist" else name))
    monkeypatch.setattr(repsim.methods.config, "load_config",
                        lambda name, overrides=(): load_config(name, [*overrides, f"data.spec={spec}", *TINY]))
    exec(compile(readme_python_example(), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "'knn_top1_k20'" in printed and "'linear_top1'" in printed

