"""The shipped experiments and deployments, installed as ``repsim.experiments``; found by name with
:mod:`repsim.shipped`."""
