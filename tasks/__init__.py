"""Prefect tasks that call the repsim library, cache by stage key and log to MLflow (``repsim.tasks``).
Importing it sets the embedded defaults (``repsim.tasks.settings``) before Prefect or MLflow read their
configuration; values already set in the environment win."""

from repsim.tasks.settings import use_embedded_defaults

use_embedded_defaults()
