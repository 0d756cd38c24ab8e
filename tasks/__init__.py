"""Prefect tasks: thin wrappers that call the repsim library, key Prefect's cache by the stage key
and log each stage to MLflow. Shipped as ``repsim.tasks``.

Importing this package fills in the embedded defaults (see ``repsim.tasks.settings``) before
Prefect or MLflow read their configuration; values already set in the environment win.
"""

from repsim.tasks.settings import use_embedded_defaults

use_embedded_defaults()
