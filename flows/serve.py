"""Serve deployments of the experiment flow: cron schedules from YAML, and runs triggered from the
Prefect UI or ``prefect deployment run`` with parameter overrides."""

from __future__ import annotations

from pathlib import Path

from prefect import serve
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron

from repsim.errors import SpecError
from repsim.experiment import DeploymentSpec, Experiment, load_deployments
from repsim.flows.experiment import experiment_flow


def deployment_of(spec: DeploymentSpec, experiment: Experiment) -> RunnerDeployment:
    """The experiment flow deployed with ``experiment`` as the default of its ``experiment`` parameter
    (a form in the Prefect UI), the overrides already applied, and ``spec``'s schedule."""
    try:
        schedules = [Cron(spec.cron, timezone=spec.timezone)] if spec.cron else None
    except ValueError as err:
        raise SpecError(f"deployment {spec.name}: {err}", "write five cron fields, e.g. '0 2 * * *'") from None
    return experiment_flow.to_deployment(
        name=spec.name, parameters={"experiment": experiment.model_dump(mode="json")}, schedules=schedules,
        description=spec.description, tags=spec.tags)


def serve_deployments(path: str | Path) -> None:
    """Serve every deployment in the YAML file at ``path`` until interrupted."""
    deployments = [deployment_of(spec, experiment) for spec, experiment in zip(*load_deployments(path))]
    serve(*deployments, print_starting_message=True)
