"""repsim: learn visual representations from relations between samples.

The library is pure Python and torch; it never imports Prefect or MLflow. Orchestration lives in
``repsim.tasks`` and ``repsim.flows`` (the repository's top-level ``tasks/`` and ``flows/``).
"""

from repsim.errors import RepsimError

__version__ = "0.1.0"
__all__ = ["RepsimError", "__version__"]
