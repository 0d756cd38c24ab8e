"""repsim: learn visual representations from relations between samples. Pure Python and torch, it never
imports Prefect or MLflow; orchestration, the command line (``repsim.flows.cli``) included, lives in
``repsim.tasks`` and ``repsim.flows`` (``tasks/``, ``flows/``)."""

from repsim.errors import RepsimError

__version__ = "0.1.0"
__all__ = ["RepsimError", "__version__"]
