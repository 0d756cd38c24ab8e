"""Start ``mlflow server`` on the PostgreSQL store named by the environment, the password URL-encoded
and passed in ``MLFLOW_BACKEND_STORE_URI`` (never on the command line, where ``ps`` shows it).

Environment: ``REPSIM_DB_USER``, ``REPSIM_DB_PASSWORD``, and optionally ``REPSIM_DB_HOST``
(default ``postgres``), ``REPSIM_DB_PORT`` (5432) and ``REPSIM_DB_NAME`` (``mlflow``). Arguments
are passed on to ``mlflow server``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from urllib.parse import quote


def backend_store_uri(env: Mapping[str, str]) -> str:
    """``postgresql://user:password@host:port/name`` with the user and password percent-encoded."""
    missing = [name for name in ("REPSIM_DB_USER", "REPSIM_DB_PASSWORD") if not env.get(name)]
    if missing:
        raise SystemExit(f"mlflow-server: set {' and '.join(missing)} (see .env.example)")
    user, password = quote(env["REPSIM_DB_USER"], safe=""), quote(env["REPSIM_DB_PASSWORD"], safe="")
    host = env.get("REPSIM_DB_HOST", "postgres")
    port = env.get("REPSIM_DB_PORT", "5432")
    return f"postgresql://{user}:{password}@{host}:{port}/{env.get('REPSIM_DB_NAME', 'mlflow')}"


def server_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the store's URL in ``MLFLOW_BACKEND_STORE_URI`` and the bare password removed."""
    return {**{k: v for k, v in env.items() if k != "REPSIM_DB_PASSWORD"},
            "MLFLOW_BACKEND_STORE_URI": backend_store_uri(env)}


if __name__ == "__main__":
    os.execvpe("mlflow", ["mlflow", "server", *sys.argv[1:]], server_environment(os.environ))
