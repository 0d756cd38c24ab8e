"""Prefect flows that chain repsim's stages. Shipped as ``repsim.flows``; call
:func:`repsim.tasks.settings.use_embedded_defaults` before importing them (the command line does)."""
