"""The shipped method configs, installed as ``repsim.configs``; found by name with :mod:`repsim.shipped`."""
