# repsim: `make run` and `make test` set everything up on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
REPSIM := $(VENV)/bin/repsim
export REPSIM_HOME ?= $(CURDIR)/.repsim
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
EXPERIMENT ?= experiments/default.yaml

.PHONY: setup run test test-fast lint docs ui servers servers-stop serve clean

setup:
	@bash scripts/setup.sh

run: setup  ## the default experiment end to end on the embedded defaults: shard, precompute, train, evaluate
	$(REPSIM) run $(EXPERIMENT)

# pytest-xdist processes: most slow tests wait on servers and subprocesses
TEST_WORKERS ?= 2

test: setup  ## the whole test suite, slow tests included
	$(PY) -m pytest -n $(TEST_WORKERS)

test-fast: setup  ## the tests that take seconds
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS)

lint: setup  ## ruff's checks, configured in pyproject.toml
	$(VENV)/bin/ruff check .

docs: setup  ## the documentation site (mkdocs.yml, docs/), built strictly into .site/
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir .site

ui: setup  ## the MLflow UI (http://127.0.0.1:$MLFLOW_PORT, 5000) and the Prefect UI (:$PREFECT_PORT, 4200) over the embedded stores
	@bash scripts/servers.sh ui

servers: setup  ## a Prefect and an MLflow server on 127.0.0.1 (SQLite, or PostgreSQL at $REPSIM_DB_URL)
	@bash scripts/servers.sh start

servers-stop:  ## stop the servers `make servers` started
	@bash scripts/servers.sh stop

serve: setup  ## serve the deployments of experiments/deployments.yaml (source the env.sh `make servers` wrote first)
	$(REPSIM) serve experiments/deployments.yaml

clean:  ## remove every artifact, run record and cache under $REPSIM_HOME
	rm -rf $(REPSIM_HOME)
