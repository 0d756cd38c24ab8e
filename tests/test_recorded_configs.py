"""Every shipped config and experiment resolves as recorded in ``recorded_configs.json``: the digest of its
``model_dump`` and of what each stage key holds of each member's train and align configs. A refactoring of the
settings (layers, merging, sections) must leave them all unchanged, so cached outputs stay cached. After a change
meant to alter them, record anew: ``python tests/test_recorded_configs.py > tests/recorded_configs.json``."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).with_name("recorded_configs.json")


def digest(values: object) -> str:
    """A digest of JSON ``values`` with the checkout's own path left out (so it holds on any machine)."""
    text = json.dumps(values, sort_keys=True, default=str).replace(str(REPO), "<repo>")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def resolved() -> dict[str, str]:
    """``{what: digest}`` for each shipped config and experiment, and each member's train and align configs."""
    from repsim.align.config import load_align_config
    from repsim.experiment import expand, load_experiment
    from repsim.layering import keyed_values
    from repsim.methods.config import load_config

    found = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        schema = {} if path.stem not in ("gera", "align_contrastive") else {"schema": _align_schema()}
        config = load_config(path.stem, **schema)
        found[f"config {path.stem}"] = digest(config.model_dump(mode="json"))
        found[f"config {path.stem} keyed"] = digest(keyed_values(config))
    for path in sorted((REPO / "experiments").glob("*.yaml")):
        if path.stem == "deployments":
            continue
        experiment = load_experiment(path.stem)
        found[f"experiment {path.stem}"] = digest(experiment.model_dump(mode="json"))
        for member in expand(experiment):
            name = f"experiment {path.stem} [{member.label}]"
            train, align = member.experiment.section("train"), member.experiment.section("align")
            for run in train.methods if train is not None else ():
                config = load_config(run.config, train.overrides(run, member.experiment.data))
                found[f"{name} train {run.label}"] = digest(keyed_values(config))
            if align is not None:
                config = load_align_config(align.config, align.overrides("encoder", member.experiment.data))
                found[f"{name} align"] = digest(keyed_values(config))
    return found


def _align_schema() -> type:
    from repsim.align.config import AlignConfig

    return AlignConfig


def test_every_shipped_config_and_experiment_resolves_as_recorded():
    recorded = json.loads(RECORD.read_text())
    now = resolved()
    changed = sorted(name for name in recorded.keys() & now.keys() if recorded[name] != now[name])
    assert not changed, f"{len(changed)} resolve differently, e.g. {changed[:5]}"
    assert now.keys() == recorded.keys(), f"new: {sorted(now.keys() - recorded.keys())[:5]}, " \
                                          f"gone: {sorted(recorded.keys() - now.keys())[:5]}"


if __name__ == "__main__":
    json.dump(resolved(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
