# A repsim worker: the wheel of this repository (library, flows, configs, experiments and data specs
# as package data) with the GPU build of FAISS, every package at the version constraints.txt pins
# (the tested set, as `make setup` installs it), run as an unprivileged user. It serves the
# shipped experiment deployments (`repsim serve deployments`). WordNet and Fashion-MNIST come from Debian.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY repsim ./repsim
COPY tasks ./tasks
COPY flows ./flows
COPY configs ./configs
COPY experiments ./experiments
COPY data_specs ./data_specs
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      wordnet-base wordnet-sense-index dataset-fashion-mnist \
 && rm -rf /var/lib/apt/lists/*
COPY constraints.txt /tmp/constraints.txt
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir -c /tmp/constraints.txt "$(ls /tmp/wheels/repsim-*.whl)[gpu]" \
 && pip install --no-cache-dir -c /tmp/constraints.txt --no-deps animal-mnist \
 && rm -rf /tmp/wheels /tmp/constraints.txt
RUN useradd --create-home --uid 1000 repsim \
 && mkdir -p /data/repsim \
 && chown repsim:repsim /data/repsim
USER repsim
WORKDIR /home/repsim
ENV REPSIM_HOME=/data/repsim PREFECT_SERVER_ANALYTICS_ENABLED=false
CMD ["repsim", "serve", "deployments"]
