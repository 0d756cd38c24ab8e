#!/usr/bin/env bash
# Every GPU check and benchmark in one call, for a machine lent with a GPU for a few minutes: the
# CUDA tests, training throughput and MFU (benchmarks/gpu_train.py), the X-CLR loss overhead and
# SOP's step cost on the GPU. Each step has its own time limit and log; a failing step does not stop
# the others. Results and logs go to $OUT (default benchmarks/results/gpu); summary.txt lists the
# exit status of every step.
#   OUT=/tmp/gpu bash scripts/gpu_checks.sh
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}" PREFECT_SERVER_ANALYTICS_ENABLED=false

step() {  # NAME SECONDS COMMAND...: run COMMAND under a time limit, its output to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(date +%T))" | tee -a "$OUT/summary.txt"
}

step environment 60 python -c "
import importlib.util, torch
print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')
print({name: importlib.util.find_spec(name) is not None for name in
       ('pytest', 'pydantic', 'torchvision', 'webdataset', 'faiss', 'sentence_transformers', 'nltk')})"
step cuda_tests 120 python -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_models.py \
    tests/test_trainer.py tests/test_methods.py tests/test_eval_knn.py tests/test_eval_linear.py \
    tests/test_eval_retrieval.py tests/test_eval_diagnostics.py
step gpu_train 240 python benchmarks/gpu_train.py --compile --out "$OUT"
step loss_overhead 60 python benchmarks/loss_overhead.py --device cuda --batch-sizes 256 1024 4096 16384 \
    --out "$OUT/loss_overhead.md"
step sop_cost 60 python benchmarks/sop_cost.py --device cuda --batch-size 256 --depth 12 --anchors 4096 \
    --cls-memory 65536 --out "$OUT/sop_cost.md"
