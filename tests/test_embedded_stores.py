"""Two first runs on a fresh ``$REPSIM_HOME``, started together, both succeed: the embedded Prefect
and MLflow stores are created under a lock (unlocked, they fail with "table already exists")."""

import subprocess
import sys

import pytest
from e2e import flow_runs, isolated_env

pytestmark = [pytest.mark.slow, pytest.mark.orchestration]

PAIRS = 2  # unlocked, a pair fails 3 times in 5: two pairs catch it 84 % of the time
FIRST_RUN = """
import sys
from repsim.tasks.settings import start_embedded_stores, use_embedded_defaults
use_embedded_defaults()  # what every command does first, before Prefect is imported
from repsim.experiment import single_section
from repsim.flows.experiment import experiment_flow

start_embedded_stores()  # and before its flow
experiment_flow(single_section("pets", sys.argv[1], {"kind": "shard"}))
"""  # a tiny spec's shards: the smallest run that uses both stores


@pytest.mark.timeout(1800)
def test_first_runs_started_together_both_succeed(make_image_folder, write_spec, tmp_path):
    root = make_image_folder({"cat": 2, "dog": 2})
    spec = write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})
    for pair in range(PAIRS):
        home = tmp_path / f"home-{pair}"
        runs = [subprocess.Popen([sys.executable, "-c", FIRST_RUN, str(spec)], env=isolated_env(home),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for run in runs:
            _, err = run.communicate(timeout=600)
            assert run.returncode == 0, err[-3000:]
        assert len(flow_runs(home, "experiment")) == 2
