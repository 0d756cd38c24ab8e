# A repsim worker: the library, its flows, configs and experiments, on a CUDA-capable torch; it serves
# the experiment deployments (`repsim serve`). WordNet and Fashion-MNIST come from Debian.
FROM python:3.11-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      wordnet-base wordnet-sense-index dataset-fashion-mnist \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/repsim
COPY pyproject.toml README.md ./
COPY repsim ./repsim
COPY tasks ./tasks
COPY flows ./flows
COPY configs ./configs
COPY data_specs ./data_specs
COPY experiments ./experiments
# Editable, so configs/ stays beside the package (configs/defaults.yaml is found from it).
RUN pip install --no-cache-dir torch torchvision \
 && pip install --no-cache-dir -e ".[gpu]" \
 && pip install --no-cache-dir --no-deps animal-mnist
ENV REPSIM_HOME=/data/repsim PREFECT_SERVER_ANALYTICS_ENABLED=false
