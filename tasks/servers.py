"""Server mode's health check: a server that ``PREFECT_API_URL`` or an HTTP ``MLFLOW_TRACKING_URI`` names
must answer within seconds, or the command stops with one line instead of hanging in retries."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from repsim.errors import RepsimError

HEALTH_TIMEOUT_S = 3.0


class ServerUnreachable(RepsimError):
    """A server that the environment names does not answer its health check."""


def health_urls() -> dict[str, str]:
    """The health endpoint of each configured server: ``{"PREFECT_API_URL": url, ...}``."""
    mlflow = os.environ.get("MLFLOW_TRACKING_URI", "")
    servers = {"PREFECT_API_URL": os.environ.get("PREFECT_API_URL", ""),
               "MLFLOW_TRACKING_URI": mlflow if mlflow.startswith(("http://", "https://")) else ""}
    return {variable: f"{url.rstrip('/')}/health" for variable, url in servers.items() if url}


def unreachable(url: str, timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """Why ``url`` does not answer within ``timeout``; None when it does."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            response.read()
    except (urllib.error.URLError, OSError, ValueError) as err:
        return str(getattr(err, "reason", err))
    return None


def server_fix(variable: str) -> str:
    return f"start the server (make servers), or unset {variable} to use the embedded default"


def check_servers(timeout: float = HEALTH_TIMEOUT_S) -> None:
    """ServerUnreachable unless every configured server answers its health check within ``timeout``."""
    for variable, url in health_urls().items():
        reason = unreachable(url, timeout)
        if reason is not None:
            raise ServerUnreachable(f"{variable}={os.environ[variable]} does not answer at {url} ({reason})",
                                    server_fix(variable))
