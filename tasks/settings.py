"""Embedded defaults, so nothing needs a server: Prefect's temporary local API under ``$REPSIM_HOME/prefect``
(120 s to start, not 20) and MLflow in ``sqlite:///$REPSIM_HOME/mlflow.db``, artifacts in
``$REPSIM_HOME/mlartifacts``. Server mode: set ``PREFECT_API_URL`` and ``MLFLOW_TRACKING_URI``.
"""

import contextlib
import os
import warnings
from pathlib import Path

from filelock import FileLock

from repsim.stage import repsim_home

STORES_LOCK = ".stores.lock"  # under $REPSIM_HOME


def use_embedded_defaults() -> None:
    """Set every embedded default that the environment does not already define."""
    home = repsim_home()
    defaults = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # a line per stage on a server; repsim says where to look
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    # Prefect makes its home when imported, which would write under $REPSIM_HOME before a command's checks
    # (or before any run: a plan); start_embedded_stores makes it
    warnings.filterwarnings("ignore", "Failed to create the Prefect home directory", UserWarning)


def start_embedded_stores() -> None:
    """Start Prefect's temporary local API and open the MLflow SQLite store (those of them in use), under a
    lock: two processes creating their tables at once fail. Call it before a flow starts."""
    from mlflow.tracking import MlflowClient  # imported here, after this module has set their defaults
    from prefect.settings import PREFECT_API_URL

    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # repsim_home() with it, by default
    repsim_home().mkdir(parents=True, exist_ok=True)
    with FileLock(repsim_home() / STORES_LOCK):
        if not PREFECT_API_URL.value():  # the timeout passed on: Prefect read its setting when first imported
            from prefect.server.api.server import SubprocessASGIServer  # seconds to import: a server's alone

            SubprocessASGIServer().start(timeout=int(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
        if os.environ["MLFLOW_TRACKING_URI"].startswith("sqlite:"):
            MlflowClient()  # opening the store creates or upgrades its tables


def api_for_workers() -> contextlib.AbstractContextManager:
    """For the block, the Prefect API that tasks on other processes (a Dask cluster's workers) report to: the
    configured server, or this process's temporary one, named in the settings they receive with each task."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        return contextlib.nullcontext()
    return temporary_settings(updates={PREFECT_API_URL: SubprocessASGIServer().api_url})


def mlflow_artifact_location() -> str | None:
    """Where a new experiment keeps artifacts: beside the SQLite store, or the server's choice."""
    if os.environ["MLFLOW_TRACKING_URI"].startswith("sqlite:"):
        return (repsim_home() / "mlartifacts").as_uri()
    return None
