from repsim.data.spec import DataSpec, load_spec
