"""Prefect tasks that call the repsim library, cache by stage key and log to MLflow (``repsim.tasks``).
Importing it sets nothing: the command line, the flows and a stage task on a cluster's worker call
:func:`repsim.tasks.settings.use_embedded_defaults` first, and so should a program that imports Prefect
or MLflow through repsim (before it does, since Prefect reads its settings when imported)."""
