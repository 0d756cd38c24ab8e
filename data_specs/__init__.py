"""The shipped data specs, installed as ``repsim.data_specs``; found by name with :mod:`repsim.shipped`."""
