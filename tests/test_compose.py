"""docker-compose.yml: valid for the compose client where one is installed, and at the schema level
everywhere: every service it needs, secrets from .env only, ports on loopback, a GPU worker that
serves the experiment deployments from an image that holds what they read."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"


def compose_clients() -> list[list[str]]:
    clients = []
    if shutil.which("docker-compose"):
        clients.append(["docker-compose"])
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        clients.append(["docker", "compose"])
    return clients


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.mark.parametrize("client", compose_clients() or [pytest.param(None, marks=pytest.mark.skip(
    reason="neither docker-compose nor docker compose is installed; the schema-level tests still run"))])
def test_compose_client_accepts_the_file_with_the_example_env(client, tmp_path):
    command = [*client, "--project-directory", str(REPO), "-f", str(COMPOSE), "--env-file", str(ENV_EXAMPLE)]
    valid = subprocess.run([*command, "config", "-q"], capture_output=True, text=True, timeout=60)
    assert valid.returncode == 0, valid.stderr
    rendered = subprocess.run([*command, "config"], capture_output=True, text=True, timeout=60).stdout
    assert "change-me" in rendered  # the password comes from the env file
    without_env = subprocess.run([*client, "-f", str(COMPOSE), "--project-directory", str(tmp_path), "config", "-q"],
                                 capture_output=True, text=True, timeout=60)
    assert without_env.returncode != 0 and "REPSIM_DB_PASSWORD" in without_env.stderr


def test_every_service_is_there_and_starts_after_what_it_needs(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "prefect-server", "mlflow-server", "gpu-worker"}
    for name in ("prefect-server", "mlflow-server"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert "healthcheck" in services[name]
    assert {need: rule["condition"] for need, rule in services["gpu-worker"]["depends_on"].items()} == {
        "prefect-server": "service_healthy", "mlflow-server": "service_healthy"}


def test_stores_are_postgresql_and_artifacts_a_volume(compose):
    services = compose["services"]
    prefect_db = services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    mlflow = services["mlflow-server"]["command"]
    assert prefect_db.startswith("postgresql+asyncpg://") and prefect_db.endswith("@postgres:5432/prefect")
    assert "--backend-store-uri postgresql://" in mlflow and "@postgres:5432/mlflow" in mlflow
    assert "--artifacts-destination /mlartifacts" in mlflow
    assert "mlartifacts:/mlartifacts" in services["mlflow-server"]["volumes"]
    assert "mlflow-server:5000" in mlflow  # the worker's Host header passes MLflow's DNS-rebinding check
    assert set(compose["volumes"]) == {"postgres", "mlartifacts", "repsim-data"}


def test_no_secret_is_written_in_the_file(compose):
    text = COMPOSE.read_text()
    assert compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${REPSIM_DB_PASSWORD:?")
    credentials = re.findall(r"://(\$\{[^}]+\}|[^:@/\s]+):([^@\s]+)@", text)  # (user, password) of each URL
    assert len(credentials) == 2 and {password for _, password in credentials} == {"${REPSIM_DB_PASSWORD}"}
    example = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                   if line and not line.startswith("#"))
    assert set(re.findall(r"\$\{(REPSIM_[A-Z_]+)", text)) == set(example)


def test_ports_are_bound_to_loopback(compose):
    ports = [port for service in compose["services"].values() for port in service.get("ports", [])]
    assert ports and all(port.startswith("127.0.0.1:") for port in ports)


def test_worker_serves_the_deployments_on_reserved_gpus(compose):
    worker = compose["services"]["gpu-worker"]
    assert worker["command"].split()[:2] == ["repsim", "serve"]
    deployments = worker["command"].split()[2]
    assert (REPO / deployments).is_file()
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert worker["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow-server:5000"


def test_worker_image_holds_every_folder_the_deployments_read(compose):
    dockerfile = (REPO / compose["services"]["gpu-worker"]["build"]["dockerfile"]).read_text()
    copied = set(re.findall(r"^COPY (\S+) \./", dockerfile, flags=re.MULTILINE))
    assert {"repsim", "tasks", "flows", "configs", "data_specs", "experiments"} <= copied
    assert 'pip install --no-cache-dir -e ".[gpu]"' in dockerfile  # configs/ stays beside the package
