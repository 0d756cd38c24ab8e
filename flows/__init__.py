"""Prefect flows that chain repsim's stages. Shipped as ``repsim.flows``."""

import repsim.tasks  # noqa: F401  (sets the embedded defaults before Prefect reads its settings)
