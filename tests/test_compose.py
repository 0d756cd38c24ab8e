"""docker-compose.yml and its images: valid for the compose client where one is installed, and at the
schema level everywhere: every service it needs, secrets from .env only and never in a URL or on a
command line, the database owner from the env, ports on loopback, the Prefect server at the
installed version, and a GPU worker with a health check that serves the shipped deployments from
the wheel, installed at the tested versions by an unprivileged user, from a build context that
holds nothing private."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from repsim.shipped import shipped

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"


def load_mlflow_server():
    spec = importlib.util.spec_from_file_location("mlflow_server", REPO / "docker" / "mlflow_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mlflow_server = load_mlflow_server()


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
    prefect_db = services["prefect-server"]["environment"]
    assert {name: prefect_db[f"PREFECT_SERVER_DATABASE_{name}"] for name in ("DRIVER", "HOST", "PORT", "NAME")} == {
        "DRIVER": "postgresql+asyncpg", "HOST": "postgres", "PORT": "5432", "NAME": "prefect"}
    mlflow = services["mlflow-server"]["command"]
    assert "--artifacts-destination /mlartifacts" in mlflow
    assert "mlartifacts:/mlartifacts" in services["mlflow-server"]["volumes"]
    assert "mlflow-server:5000" in mlflow  # the worker's Host header passes MLflow's DNS-rebinding check
    assert set(compose["volumes"]) == {"postgres", "mlartifacts", "repsim-data"}


def test_no_secret_is_written_in_the_file_or_put_on_a_command_line(compose):
    text = COMPOSE.read_text()
    services = compose["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${REPSIM_DB_PASSWORD:?")
    assert not re.search(r"://[^/\s]*:[^@\s]*@", text)  # no URL carries credentials
    assert all("PASSWORD" not in str(service.get("command", "")) for service in services.values())
    passwords = {name: value for service in services.values()
                 for name, value in service.get("environment", {}).items() if "PASSWORD" in name}
    assert set(passwords) == {"POSTGRES_PASSWORD", "PREFECT_SERVER_DATABASE_PASSWORD", "REPSIM_DB_PASSWORD"}
    assert all(value.startswith("${REPSIM_DB_PASSWORD") for value in passwords.values())
    assert "REPSIM_DB_PASSWORD" not in services["gpu-worker"]["environment"]
    example = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                   if line and not line.startswith("#"))
    assert set(re.findall(r"\$\{(REPSIM_[A-Z_]+)", text)) == set(example)


TRICKY = {"REPSIM_DB_USER": "ann@lab", "REPSIM_DB_PASSWORD": "p@ss:w/rd %#?&="}


def test_mlflow_gets_its_store_with_the_password_url_encoded_in_its_environment():
    from sqlalchemy.engine import make_url

    environment = mlflow_server.server_environment({"PATH": "/bin", **TRICKY})
    url = make_url(environment["MLFLOW_BACKEND_STORE_URI"])
    assert (url.username, url.password, url.host, url.port, url.database) == (
        "ann@lab", "p@ss:w/rd %#?&=", "postgres", 5432, "mlflow")
    assert "REPSIM_DB_PASSWORD" not in environment and environment["PATH"] == "/bin"
    with pytest.raises(SystemExit, match="set REPSIM_DB_PASSWORD"):
        mlflow_server.backend_store_uri({"REPSIM_DB_USER": "ann"})


def test_mlflow_image_starts_the_server_through_its_entrypoint(compose):
    dockerfile = (REPO / compose["services"]["mlflow-server"]["build"]["dockerfile"]).read_text()
    assert 'ENTRYPOINT ["python", "/usr/local/bin/mlflow-server"]' in dockerfile
    assert "COPY docker/mlflow_server.py /usr/local/bin/mlflow-server" in dockerfile
    assert compose["services"]["mlflow-server"]["command"].split()[0] == "--host"  # arguments of `mlflow server`
    assert re.search(r"^USER (?!root)\w+", dockerfile, flags=re.MULTILINE)


def test_prefect_builds_its_store_url_from_the_parts_with_the_password_encoded(compose, monkeypatch):
    from prefect.settings.models.root import Settings
    from sqlalchemy.engine import make_url

    for name, value in compose["services"]["prefect-server"]["environment"].items():
        monkeypatch.setenv(name, re.sub(r"\$\{(\w+)(:-[^}]*)?\}", lambda m: TRICKY[m[1]], value))
    url = make_url(Settings().server.database.connection_url.get_secret_value())
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "postgresql+asyncpg", "ann@lab", "p@ss:w/rd %#?&=", "postgres", 5432, "prefect")


def test_the_mlflow_database_is_owned_by_the_configured_user(compose, tmp_path):
    mount = next(volume for volume in compose["services"]["postgres"]["volumes"] if "initdb" in volume)
    script = REPO / mount.split(":")[0]
    psql = tmp_path / "psql"  # records what PostgreSQL's entrypoint would run
    psql.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncat > {tmp_path}/sql\n')
    psql.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "POSTGRES_USER": "ann"}
    subprocess.run(["sh", str(script)], env=env, check=True, timeout=30)
    assert "--set owner=ann" in (tmp_path / "args").read_text()
    assert (tmp_path / "sql").read_text().strip() == 'CREATE DATABASE mlflow OWNER :"owner";'


def test_ports_are_bound_to_loopback(compose):
    ports = [port for service in compose["services"].values() for port in service.get("ports", [])]
    assert ports and all(port.startswith("127.0.0.1:") for port in ports)


def test_the_prefect_server_image_is_the_installed_prefect(compose):
    image = compose["services"]["prefect-server"]["image"]
    assert image == f"prefecthq/prefect:{pinned('prefect')}-python3.11"


def test_worker_serves_the_shipped_deployments_on_reserved_gpus_with_a_health_check(compose):
    worker = compose["services"]["gpu-worker"]
    assert worker["command"].split() == ["repsim", "serve", "deployments"]
    assert "deployments" in shipped("deployments file")
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert worker["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow-server:5000"
    assert worker["environment"]["PREFECT_RUNNER_SERVER_ENABLE"] == "true"
    assert "http://localhost:8080/health" in " ".join(worker["healthcheck"]["test"])
    assert worker["stop_grace_period"] == "30s"  # more than repsim.stopping.GRACE_S: a training checkpoints first


# ---------------------------------------------------------------------------------------------
# The worker image

@pytest.fixture(scope="module")
def worker_dockerfile(compose) -> str:
    return (REPO / compose["services"]["gpu-worker"]["build"]["dockerfile"]).read_text()


def test_worker_image_installs_the_wheel_with_gpu_faiss_at_the_tested_versions(worker_dockerfile):
    assert "pip wheel --no-cache-dir --no-deps -w /wheels ." in worker_dockerfile
    assert 'pip install --no-cache-dir -c /tmp/constraints.txt "$(ls /tmp/wheels/repsim-*.whl)[gpu]"' in worker_dockerfile
    assert "COPY constraints.txt /tmp/constraints.txt" in worker_dockerfile
    assert " -e " not in worker_dockerfile  # not editable: the configs come from the package
    assert "--set" not in worker_dockerfile and "torch==" not in worker_dockerfile  # torch only from constraints.txt


def test_worker_image_runs_as_an_unprivileged_user_that_owns_repsim_home(worker_dockerfile):
    users = re.findall(r"^USER (\S+)", worker_dockerfile, flags=re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    assert f"chown {users[-1]}:{users[-1]} /data/repsim" in worker_dockerfile
    assert "ENV REPSIM_HOME=/data/repsim" in worker_dockerfile


def test_the_build_context_holds_what_the_images_copy_and_nothing_private(compose):
    patterns = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    copied = {source for service in compose["services"].values() if "build" in service
              for source in re.findall(r"^COPY (?!--from)(\S+) ", (REPO / service["build"]["dockerfile"]).read_text(),
                                       flags=re.MULTILINE)}
    assert {"repsim", "tasks", "flows", "configs", "data_specs", "experiments", "constraints.txt"} <= copied
    assert all(in_context(source, patterns) for source in copied)
    assert all(in_context(f"{folder}/__init__.py", patterns) for folder in ("repsim", "tasks", "configs"))
    for private in (".venv/bin/python", ".repsim/mlflow.db", ".env", ".git/config", ".gpu-wheels/x.whl",
                    "repsim/__pycache__/cli.cpython-311.pyc", "benchmarks/results/loader.md"):
        assert not in_context(private, patterns), private


def in_context(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore of ``patterns`` keeps ``path`` in the build context, as Docker reads
    it: the last pattern that matches the path or one of its parent folders decides, ``!`` keeping
    it; ``*`` stays within a folder, ``**/`` spans any number of them."""
    prefixes = ["/".join(path.split("/")[:n]) for n in range(1, path.count("/") + 2)]
    kept = True
    for pattern in patterns:
        if any(glob_regex(pattern.removeprefix("!")).match(prefix) for prefix in prefixes):
            kept = pattern.startswith("!")
    return kept


def glob_regex(glob: str) -> re.Pattern:
    parts = re.split(r"(\*\*/|\*|\?)", glob)
    wildcards = {"**/": "(?:.*/)?", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(wildcards.get(part, re.escape(part)) for part in parts) + r"\Z")


def pinned(distribution: str) -> str:
    """The version constraints.txt pins ``distribution`` to."""
    [version] = re.findall(rf"^{re.escape(distribution)}==(\S+)$", (REPO / "constraints.txt").read_text(),
                           flags=re.MULTILINE)
    return version
