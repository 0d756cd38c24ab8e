# repsim: `make run` and `make test` set everything up on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
REPSIM := $(VENV)/bin/repsim
export REPSIM_HOME ?= $(CURDIR)/.repsim
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: setup run test test-fast ui clean

setup:
	@bash scripts/setup.sh

run: setup  ## shard both datasets, precompute Animal-MNIST's similarities, evaluate its raw pixels
	$(REPSIM) shard data_specs/fashion-mnist.yaml data_specs/animal-mnist.yaml
	$(REPSIM) precompute data_specs/animal-mnist.yaml
	$(REPSIM) eval data_specs/animal-mnist.yaml --encoder pixels --suite knn --suite diagnostics --suite plots

test: setup  ## the whole test suite, slow tests included
	$(PY) -m pytest

test-fast: setup  ## the tests that take seconds
	$(PY) -m pytest -m "not slow"

ui: setup  ## MLflow UI on http://127.0.0.1:5000 over the embedded store
	$(VENV)/bin/mlflow ui --host 127.0.0.1 --port 5000 \
		--backend-store-uri sqlite:///$(REPSIM_HOME)/mlflow.db

clean:  ## remove every artifact, run record and cache under $REPSIM_HOME
	rm -rf $(REPSIM_HOME)
