"""Importing repsim changes nothing outside it: no environment variable is set by an import; the explicit
call that the command line, the flows and a stage task make sets the embedded defaults. The library proper
(``repsim`` without its ``tasks`` and ``flows``) imports neither Prefect nor MLflow."""

import json
import os
import subprocess
import sys


def test_importing_the_orchestration_changes_no_environment_variable():
    """repsim.tasks and repsim.flows set nothing when imported; the command line, the flows and a stage task
    call use_embedded_defaults, which fills in only what the environment leaves unset."""
    script = ("import os, json; before = dict(os.environ)\n"
              "import repsim.tasks, repsim.flows.experiment, repsim.tasks.stage_tasks\n"
              "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
              "from repsim.tasks.settings import use_embedded_defaults\n"
              "use_embedded_defaults()\n"
              "print(json.dumps([changed, os.environ['MLFLOW_TRACKING_URI'], os.environ['PREFECT_HOME']]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_HOME"))}
    env |= {"REPSIM_HOME": "/elsewhere", "PREFECT_HOME": "/mine/prefect"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    changed, tracking, prefect_home = json.loads(out.splitlines()[-1])
    ours = [name for name in changed if name.startswith(("PREFECT_", "MLFLOW_TRACKING", "HF_", "TRANSFORMERS_"))]
    assert ours == [], changed  # (torch and MLflow set variables of their own when imported)
    assert tracking == "sqlite:////elsewhere/mlflow.db" and prefect_home == "/mine/prefect"  # the user's kept


LIBRARY_IMPORTS = """
import ast, importlib, json, os, pkgutil, sys
import repsim
names = [m.name for m in pkgutil.walk_packages(repsim.__path__, "repsim.")
         if not m.name.startswith(("repsim.tasks", "repsim.flows"))]
for name in names:  # the dependencies first: what they set when imported is theirs (torchvision sets a torch cache)
    tree = ast.parse(open(importlib.util.find_spec(name).origin).read())
    for node in ast.walk(tree):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \\
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for module in modules:
            if not module.startswith("repsim"):
                importlib.import_module(module)
before = dict(os.environ)
for name in names:
    importlib.import_module(name)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(json.dumps([len(names), changed, sorted({m.split(".")[0] for m in sys.modules} & {"prefect", "mlflow"})]))
"""


def test_every_library_module_imports_without_prefect_or_mlflow_and_sets_nothing():
    out = subprocess.run([sys.executable, "-c", LIBRARY_IMPORTS], capture_output=True, text=True, check=True).stdout
    count, changed, orchestration = json.loads(out.splitlines()[-1])
    assert count > 60  # every module of the library, its methods and stages included
    assert changed == [] and orchestration == []
