#!/usr/bin/env bash
# Every GPU check and benchmark in one call, for a machine lent with a GPU for a few minutes: the
# missing Python packages installed from carried wheels, exact all-pairs neighbours with a FAISS GPU
# flat index (benchmarks/faiss_gpu.py: 1M × 768, k = 800, extrapolated to 6M), X-CLR training on
# ResNet-50 at 224 px with batched augmentation on the GPU against a bare loop, with the share of
# time waiting for data (benchmarks/train_step.py), repsim's kNN
# evaluation on the GPU, repsim's neighbor lists (neighbors.knn) on FAISS's GPU index against its CPU one, the CUDA tests, training throughput and MFU (benchmarks/gpu_train.py), the
# X-CLR loss overhead and SOP's step cost on the GPU. Each step has its own time limit and log; a
# failing step does not stop the others; all steps together stay within $BUDGET_S seconds (a step
# gets what is left when that is less than its own limit, and is skipped when under 15 s are left),
# so the whole call ends within 9 minutes. Results and logs go to $OUT (default
# benchmarks/results/gpu); summary.txt lists the exit status and time of every step. When $OUT
# would hold more than 8 files, everything but summary.txt and the *.md tables is packed into
# logs.tar.gz; the tables and the summary are printed at the end.
#
# How to use it:
#   1. here, on a machine with PyPI:   bash scripts/gpu_wheels.sh
#      (fills the git-ignored .gpu-wheels/ with the wheels the GPU machine lacks: pydantic,
#      webdataset, braceexpand, nltk, kornia, faiss-gpu-cu12 and their missing dependencies, plus
#      the CUDA 12 glue faiss-gpu-cu12 needs there; it checks the folder fits the 64 MiB transfer)
#   2. the device run, with carry [".gpu-wheels"] and the command
#        OUT=$OUT bash scripts/gpu_checks.sh
#      The first step installs the wheels with pip from .gpu-wheels alone (--no-index), into the
#      machine's Python, then repsim itself (pip install --no-deps --no-build-isolation -e .), and
#      compares a FAISS GPU search with numpy (install.log). Should FAISS's GPU path fail there, the
#      faiss_gpu table's torch row still times the same exact search on the GPU;
#      `FAISS=cpu bash scripts/gpu_wheels.sh` carries faiss-cpu instead.
# Elsewhere:
#   OUT=/tmp/gpu bash scripts/gpu_checks.sh
#   PYTHON=/tmp/py312/bin/python DEVICE=cpu STEPS="install environment faiss_gpu knn_eval" \
#     OUT=/tmp/gpu bash scripts/gpu_checks.sh        # a CPU rehearsal of the new steps, small sizes
set -u
OUT=${OUT:-benchmarks/results/gpu}
WHEELS=${WHEELS:-.gpu-wheels}     # from scripts/gpu_wheels.sh
PYTHON=${PYTHON:-python3}         # the Python that holds torch
DEVICE=${DEVICE:-cuda}            # for faiss_gpu and knn_eval; cpu shrinks them to a rehearsal
STEPS=${STEPS:-install environment faiss_gpu train_step knn_eval neighbors_gpu cuda_tests gpu_train loss_overhead sop_cost}
BUDGET_S=${BUDGET_S:-510}         # all steps together
SITE=${SITE:-/tmp/gpu-checks-site}  # only if pip cannot install into $PYTHON's environment
mkdir -p "$OUT"
: >"$OUT/summary.txt"
ENV_FILE=$(mktemp)
trap 'rm -f "$ENV_FILE" "$ENV_FILE.files"' EXIT
export PYTHONPATH="$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}" PREFECT_SERVER_ANALYTICS_ENABLED=false
export PYTHONUNBUFFERED=1 OUT WHEELS PYTHON DEVICE SITE ENV_FILE
# faiss-gpu-cu12 would preload its CUDA 12 libraries from the nvidia-*-cu12 packages, which are not
# installed: it finds them beside its own libraries instead (see install_wheels)
export _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1
START=$SECONDS

step() {  # NAME SECONDS COMMAND...: run COMMAND under a time limit, its output to $OUT/NAME.log
  local name=$1 limit=$2 left began rc
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  left=$((BUDGET_S - (SECONDS - START)))
  if [ "$left" -lt 15 ]; then
    echo "$name: skipped, ${left}s of the ${BUDGET_S}s budget left" | tee -a "$OUT/summary.txt"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  began=$SECONDS
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc in $((SECONDS - began))s, limit ${limit}s ($(date +%T))" | tee -a "$OUT/summary.txt"
  # shellcheck disable=SC1090
  [ -s "$ENV_FILE" ] && . "$ENV_FILE"
  return 0
}

install_wheels() {  # the carried wheels into $PYTHON's environment, then repsim; exports for later steps to $ENV_FILE
  set -o pipefail
  local pip=("$PYTHON" -m pip --disable-pip-version-check --no-input) target=() libs cublas
  if [ ! -f "$WHEELS/install.txt" ]; then
    echo "install: no $WHEELS/install.txt: run 'bash scripts/gpu_wheels.sh' where PyPI is reachable and carry $WHEELS"
    return 1
  fi
  "$PYTHON" -c 'import sys; print("python:", sys.executable, sys.version.split()[0])'
  echo "install: $(tr '\n' ' ' <"$WHEELS/install.txt")(dependencies from $WHEELS and the installed packages)"
  if "${pip[@]}" install --no-index --find-links "$WHEELS" -r "$WHEELS/install.txt"; then
    if [ -s "$WHEELS/nodeps.txt" ]; then
      echo "install: $(tr '\n' ' ' <"$WHEELS/nodeps.txt")(--no-deps)"
      "${pip[@]}" install --no-index --find-links "$WHEELS" --no-deps -r "$WHEELS/nodeps.txt" || return 1
    fi
  else
    echo "install: that failed; every wheel of $WHEELS with --no-deps into $SITE instead"
    target=(--target "$SITE")
    "${pip[@]}" install --no-index --no-deps --upgrade "${target[@]}" "$WHEELS"/*.whl || return 1
    export PYTHONPATH="$SITE:$PYTHONPATH"
    echo "export PYTHONPATH=\"$SITE:\$PYTHONPATH\"" >>"$ENV_FILE"
  fi
  if [ -d "$WHEELS/cuda12" ]; then  # faiss-gpu-cu12's CUDA 12 runtime and cuBLAS forwarding, beside its libraries
    libs=$("$PYTHON" -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("faiss").origin).parents[1] / "faiss_gpu_cu12.libs")')
    cp "$WHEELS"/cuda12/*.so.12 "$libs"/ || return 1
    cublas=$("$PYTHON" -c '
import glob, os, sys
found = [hit for root in sys.path if root.endswith("-packages")
         for hit in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcublas.so.13")))]
print((found + sorted(glob.glob("/usr/local/cuda*/lib64/libcublas.so.13")) + [""])[0])')
    echo "install: CUDA 12 runtime and cuBLAS forwarding copied to $libs; libcublas.so.13: ${cublas:-not found}"
    if [ -n "$cublas" ]; then
      export FAISS_CUBLAS_LIB=$cublas
      echo "export FAISS_CUBLAS_LIB=$cublas" >>"$ENV_FILE"
    fi
  fi
  if [ ${#target[@]} -gt 0 ] || ! "${pip[@]}" install --no-deps --no-build-isolation -e .; then
    echo "install: repsim not installed; it is imported from PYTHONPATH ($PWD)"
  fi
  "$PYTHON" - <<'PY'
import importlib
import sys

failed = []
for name in ("pydantic", "webdataset", "braceexpand", "nltk", "faiss", "kornia", "repsim"):
    try:
        module = importlib.import_module(name)
        print(f"import {name}: {getattr(module, '__version__', '?')} from {module.__file__}")
    except Exception as error:
        failed.append(name)
        print(f"import {name}: FAILED: {type(error).__name__}: {error}")
if "faiss" not in failed:
    import faiss
    import numpy as np

    gpus = faiss.get_num_gpus()
    print(f"faiss GPUs: {gpus}")
    if gpus:
        x = np.random.default_rng(0).standard_normal((20000, 64), dtype=np.float32)
        exact = np.argsort(-(x[:256] @ x.T), axis=1, kind="stable")[:, :10]
        for float16 in (False, True):
            options = faiss.GpuMultipleClonerOptions()
            options.useFloat16 = float16
            index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(64), options)
            index.add(x)
            _, ids = index.search(x[:256], 10)
            agreement = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, exact)]))
            print(f"faiss GPU flat IP ({'float16' if float16 else 'float32'}) vs numpy, recall@10: {agreement:.4f}")
            if agreement < (0.9 if float16 else 0.99):
                failed.append(f"faiss GPU {'float16' if float16 else 'float32'}")
sys.exit(f"install: FAILED: {', '.join(failed)}" if failed else 0)
PY
}
export -f install_wheels

KNN_EVAL='
import os, time
from pathlib import Path
import torch
from repsim.eval.knn import knn_accuracy

device = torch.device(os.environ["DEVICE"])
n_train, n_test, dim, classes = (1_000_000, 50_000, 768, 1000) if device.type == "cuda" else (20_000, 2_000, 64, 10)
ks = (20, 200)
generator = torch.Generator(device=device).manual_seed(0)
centres = torch.randn(classes, dim, device=device, generator=generator)
def sample(n):
    labels = torch.randint(classes, (n,), device=device, generator=generator)
    return centres[labels] + 2.0 * torch.randn(n, dim, device=device, generator=generator), labels
train_x, train_y = sample(n_train)
test_x, test_y = sample(n_test)
knn_accuracy(train_x[:50_000], train_y[:50_000], test_x[:1024], test_y[:1024], k=ks, device=device)  # warm-up
if device.type == "cuda":
    torch.cuda.synchronize()
started = time.perf_counter()
accuracy = knn_accuracy(train_x, train_y, test_x, test_y, k=ks, device=device)
if device.type == "cuda":
    torch.cuda.synchronize()
spent = time.perf_counter() - started
name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
text = (f"# repsim.eval.knn.knn_accuracy on {name}\n\n"
        f"Random class-clustered features: {n_train:,} train × {dim}, {n_test:,} test, {classes} classes, "
        f"k = {ks}, float32, torch {torch.__version__}.\n\n"
        "| seconds | test rows / s | " + " | ".join(accuracy) + " |\n"
        "| --- | --- | " + " | ".join("---" for _ in accuracy) + " |\n"
        f"| {spent:.2f} | {n_test / spent:,.0f} | " + " | ".join(f"{v:.4f}" for v in accuracy.values()) + " |\n")
Path(os.environ["OUT"], "knn_eval.md").write_text(text)
print(text)
'
NEIGHBORS_GPU='
import os, time
from pathlib import Path
import numpy as np
from repsim.similarity.neighbors import gpu_available, knn, recall_at_k

on_gpu = os.environ["DEVICE"] == "cuda"
n, dim, k = (200_000, 384, 100) if on_gpu else (20_000, 64, 20)
base = np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32).astype(np.float16)
name = {False: "CPU", True: "GPU"}
rows = []
for use_gpu in sorted({False, on_gpu}):
    started = time.perf_counter()
    ids, _ = knn(base, k, index="flat", use_gpu=use_gpu)
    rows.append((name[use_gpu], time.perf_counter() - started, recall_at_k(ids, rows[0][3] if rows else ids), ids))
text = (f"# repsim.similarity.neighbors.knn on FAISS flat indexes\n\n{n:,} float16 points × {dim}, "
        f"each point its {k} nearest others (cosine); gpu_available() = {gpu_available()}.\n\n"
        f"| index | seconds | recall@{k} vs the CPU index |\n| --- | --- | --- |\n"
        + "".join(f"| {index} flat | {spent:.2f} | {recall:.4f} |\n" for index, spent, recall, _ in rows))
Path(os.environ["OUT"], "neighbors_gpu.md").write_text(text)
print(text)
'
if [ "$DEVICE" = cuda ]; then
  FAISS_ARGS=${FAISS_ARGS:-"--n 1000000 --dim 768 --k 800 --max-seconds 30"}
else
  FAISS_ARGS=${FAISS_ARGS:-"--n 20000 --dim 64 --k 50 --max-seconds 20"}
fi

step install 90 bash -c install_wheels
step environment 30 "$PYTHON" -c "
import importlib.util, torch
print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')
print({name: importlib.util.find_spec(name) is not None for name in
       ('pytest', 'pydantic', 'torchvision', 'webdataset', 'braceexpand', 'faiss', 'kornia', 'sentence_transformers',
        'nltk', 'repsim')})"
# shellcheck disable=SC2086  # FAISS_ARGS is a list of options
step faiss_gpu 150 "$PYTHON" benchmarks/faiss_gpu.py --device "$DEVICE" --backends torch faiss $FAISS_ARGS \
    --out "$OUT/faiss_gpu.md"
step train_step 150 env REPSIM_HOME=/tmp/repsim-gpu-checks "$PYTHON" benchmarks/train_step.py --rounds 2 --held 4 \
    --set method.similarity.type=labels --set model.backbone=resnet50 --set data.image_size=224 \
    --set optim.precision=bf16 --set optim.channels_last=true --set optim.compile=true --out "$OUT/train_step.md"
step knn_eval 60 "$PYTHON" -c "$KNN_EVAL"
step neighbors_gpu 90 "$PYTHON" -c "$NEIGHBORS_GPU"
step cuda_tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_models.py \
    tests/test_trainer.py tests/test_methods.py tests/test_eval_knn.py tests/test_eval_linear.py \
    tests/test_eval_retrieval.py tests/test_eval_diagnostics.py
step gpu_train 240 "$PYTHON" benchmarks/gpu_train.py --compile --out "$OUT"
step loss_overhead 60 "$PYTHON" benchmarks/loss_overhead.py --device cuda --batch-sizes 256 1024 4096 16384 \
    --out "$OUT/loss_overhead.md"
step sop_cost 60 "$PYTHON" benchmarks/sop_cost.py --device cuda --batch-size 256 --depth 12 --anchors 4096 \
    --cls-memory 65536 --out "$OUT/sop_cost.md"

if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then  # only 8 files come back from the device machine
  (cd "$OUT" && find . -type f ! -name summary.txt ! -name '*.md' ! -name logs.tar.gz >"$ENV_FILE.files" &&
    tar czf logs.tar.gz -T "$ENV_FILE.files" --remove-files)
fi
for table in "$OUT"/*.md; do
  [ -f "$table" ] && { echo; cat "$table"; }
done
echo
echo "total $((SECONDS - START))s of ${BUDGET_S}s"
cat "$OUT/summary.txt"
