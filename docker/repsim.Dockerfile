# A repsim worker: the library, its flows and a Prefect worker, on a CUDA-capable torch.
FROM python:3.11-slim
WORKDIR /opt/repsim
COPY pyproject.toml README.md ./
COPY repsim ./repsim
COPY tasks ./tasks
COPY flows ./flows
COPY data_specs ./data_specs
RUN pip install --no-cache-dir torch torchvision && pip install --no-cache-dir ".[gpu]"
ENV REPSIM_HOME=/data/repsim
