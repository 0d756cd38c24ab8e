#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels that the lent GPU machine (Python 3.12, x86_64 Linux,
# torch 2.11.0+cu130, no registry) lacks for repsim, into a git-ignored folder that travels with the
# run as a carry path, and check that the folder fits the carry budget.
#
#   bash scripts/gpu_wheels.sh                 # -> .gpu-wheels/, faiss-gpu-cu12 with its CUDA 12 glue
#   FAISS=cpu bash scripts/gpu_wheels.sh       # faiss-cpu instead (no GPU index)
#
# What is carried: pydantic, webdataset, braceexpand, nltk, kornia and FAISS, plus each dependency
# that the GPU machine does not already have (its package list is MACHINE_PACKAGES below). The
# closure is resolved one wheel at a time with `pip download --no-deps`, reading each wheel's
# Requires-Dist for Python $PY_VERSION on linux/x86_64, so torch, numpy and the nvidia-* CUDA wheels
# are never fetched: the machine's torch brings CUDA 13 (cuda-toolkit 13.0.2: libcudart.so.13,
# libcublas.so.13).
#
# FAISS on the GPU. faiss-gpu-cu12 (the only GPU build on PyPI) links libcudart.so.12,
# libcublas.so.12 and libcublasLt.so.12 with versioned symbols (cudaMalloc@libcudart.so.12, ...),
# which torch's CUDA 13 libraries do not provide, and its requirement nvidia-cublas-cu12 is a
# ~580 MB wheel, far beyond the carry budget. FAISS=gpu (the default) therefore carries, in
# $DEST/cuda12/: the CUDA 12 runtime library alone (libcudart.so.12, 0.7 MB, from
# nvidia-cuda-runtime-cu12; the 580-series driver runs CUDA 12 programs), a small libcublas.so.12
# that forwards the eight cuBLAS calls FAISS makes to the machine's libcublas.so.13, and an empty
# libcublasLt.so.12 (FAISS needs none of its symbols). scripts/gpu_checks.sh copies them next to
# FAISS's own libraries (found there through _swigfaiss.so's RPATH), sets
# _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1 (else `import faiss` looks for the nvidia-*-cu12 packages), and
# checks a GPU search against an exact one before anything relies on it.
#
# Outputs in $DEST: the wheels (one version of each), install.txt (pinned requirements installed
# with dependencies resolved against the folder and the installed packages), nodeps.txt (installed
# with --no-deps: faiss-gpu-cu12, whose CUDA 12 requirements the glue replaces), MANIFEST.txt (each
# file, its size and why it is there). Fails if $DEST exceeds $MAX_MIB MiB, or if $DEST plus the
# working tree that travels exceeds the 64 MiB transfer limit.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${DEST:-.gpu-wheels}
FAISS=${FAISS:-gpu}                 # gpu: faiss-gpu-cu12 + CUDA 12 glue; cpu: faiss-cpu
PY_VERSION=${PY_VERSION:-3.12}      # the GPU machine's Python
MAX_MIB=${MAX_MIB:-62}              # of the 64 MiB that may travel, the rest is the working tree
TRANSFER_MIB=64
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
CC=${CC:-cc}

case $FAISS in
  gpu) FAISS_REQ="faiss-gpu-cu12>=1.8" ;;
  cpu) FAISS_REQ="faiss-cpu>=1.8" ;;
  *) echo "gpu_wheels: FAISS must be gpu or cpu, not '$FAISS'" >&2; exit 2 ;;
esac
mkdir -p "$DEST"

"$PYTHON" - "$DEST" "$PY_VERSION" "$FAISS_REQ" <<'PY'
"""Resolve and download the carried closure: one `pip download --no-deps` per package."""
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

dest, py_version, faiss_req = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
WANTED = ["pydantic>=2.5", "webdataset>=0.2.90", "braceexpand>=0.1.7", "nltk>=3.8", "kornia>=0.9", "animal-mnist",
          faiss_req]
# Installed on the GPU machine (its image's package list); versions where known.
MACHINE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
MACHINE_VERSIONS = {"torch": "2.11.0", "numpy": "2.5.2", "triton": "3.6.0", "torchvision": "0.26.0"}
PRESENT = {canonicalize_name(name) for name in MACHINE_PACKAGES}
CARRY_ANYWAY = {"typing-extensions"}  # pydantic needs a recent one; installed only if the machine's is older
REPLACED = {"nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12"}  # faiss-gpu-cu12's: see $DEST/cuda12
NO_DEPS = {"faiss-gpu-cu12", "animal-mnist"}  # animal-mnist: data only, without its tensorflow requirement
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64"]
ENV = default_environment() | {
    "python_version": py_version, "python_full_version": f"{py_version}.0", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def download(name: str, spec: SpecifierSet) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--python-version", py_version, "--implementation", "cp",
               *(f"--platform={p}" for p in PLATFORMS), "-d", str(dest), f"{name}{spec}"]
    done = subprocess.run(command, capture_output=True, text=True)
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", done.stdout)
    if done.returncode or not found:
        sys.exit(f"gpu_wheels: no cp{py_version.replace('.', '')} manylinux x86_64 wheel for {name}{spec}:\n"
                 f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return Path(found[-1])


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = Parser().parsestr(archive.read(meta).decode())
    wanted = [Requirement(line) for line in message.get_all("Requires-Dist") or []]
    return [r for r in wanted if r.marker is None or r.marker.evaluate(ENV)]


specs: dict[str, SpecifierSet] = {}
chosen: dict[str, tuple[Path, str]] = {}  # name -> (wheel, version)
reasons: dict[str, set[str]] = {}
skipped: dict[str, list[tuple[str, SpecifierSet]]] = {}
queue = [(Requirement(r), "wanted") for r in WANTED]
while queue:
    requirement, parent = queue.pop(0)
    name = canonicalize_name(requirement.name)
    if name in REPLACED or (name in PRESENT and name not in CARRY_ANYWAY):
        skipped.setdefault(name, []).append((parent, requirement.specifier))
        continue
    reasons.setdefault(name, set()).add(parent)
    specs[name] = specs.get(name, SpecifierSet()) & requirement.specifier
    if name in chosen and specs[name].contains(chosen[name][1], prereleases=True):
        continue
    wheel = download(name, specs[name])
    version = str(parse_wheel_filename(wheel.name)[1])
    chosen[name] = (wheel, version)
    print(f"  {name}=={version}  ({parent})")
    queue += [] if name in NO_DEPS else [(r, name) for r in requirements(wheel)]

for name, needs in sorted(skipped.items()):
    for parent, spec in needs:
        if name in MACHINE_VERSIONS and not spec.contains(MACHINE_VERSIONS[name], prereleases=True):
            sys.exit(f"gpu_wheels: {parent} needs {name}{spec}, the GPU machine has {MACHINE_VERSIONS[name]}")
print("  left to the GPU machine:", ", ".join(sorted(skipped)))

keep = {wheel.name for wheel, _ in chosen.values()}
for stale in dest.glob("*.whl"):
    if stale.name not in keep:
        print(f"  removing {stale.name} (not needed now)")
        stale.unlink()
top = {canonicalize_name(Requirement(r).name) for r in WANTED}
(dest / "install.txt").write_text("".join(f"{n}=={chosen[n][1]}\n" for n in sorted(top - NO_DEPS)))
(dest / "nodeps.txt").write_text("".join(f"{n}=={chosen[n][1]}\n" for n in sorted(top & NO_DEPS)))
(dest / "MANIFEST.txt").write_text("".join(
    f"{chosen[n][0].name}\t{chosen[n][0].stat().st_size / 2**20:.2f} MiB\tfor {', '.join(sorted(reasons[n]))}\n"
    for n in sorted(chosen)))
PY

rm -rf "$DEST/cuda12"
if [ "$FAISS" = gpu ]; then
  echo "gpu_wheels: CUDA 12 runtime and cuBLAS glue for faiss-gpu-cu12 -> $DEST/cuda12"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$DEST/cuda12"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" \
    "nvidia-cuda-runtime-cu12>=12.1.105,<13"
  (cd "$tmp" && unzip -q -o nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12')
  cp "$tmp/nvidia/cuda_runtime/lib/libcudart.so.12" "$DEST/cuda12/"
  basename "$tmp"/nvidia_cuda_runtime_cu12-*.whl >"$DEST/cuda12/libcudart.so.12.source"

  cat >"$DEST/cuda12/cublas12_shim.c" <<'C'
/* libcublas.so.12 for faiss-gpu-cu12 on a CUDA 13 machine: the eight cuBLAS entry points FAISS
 * imports, exported under the version node libcublas.so.12 and forwarded to libcublas.so.13 (same
 * signatures and enum values). libcublas.so.13 is found as already loaded (torch loads it), else at
 * $FAISS_CUBLAS_LIB, else through this library's RUNPATH (site-packages/nvidia/cu13/lib). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

/* bind the oldest dlopen/dlsym so that the library loads on any glibc */
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver dlerror,dlerror@GLIBC_2.2.5");

#define NOT_INITIALIZED 1 /* CUBLAS_STATUS_NOT_INITIALIZED */
typedef void *H;
typedef long long ll;

static void *target(const char *name) {
  static void *volatile library;
  void *lib = library;
  if (!lib) {
    const char *path = getenv("FAISS_CUBLAS_LIB");
    lib = path && *path ? dlopen(path, RTLD_NOW | RTLD_GLOBAL) : NULL;
    if (!lib) lib = dlopen("libcublas.so.13", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      fprintf(stderr, "libcublas.so.12 (forwarding): cannot load libcublas.so.13: %s; "
                      "import torch first or set FAISS_CUBLAS_LIB\n", dlerror());
      return NULL;
    }
    library = lib;
  }
  void *fn = dlsym(lib, name);
  if (!fn) fprintf(stderr, "libcublas.so.12 (forwarding): libcublas.so.13 lacks %s\n", name);
  return fn;
}

#define FORWARD(name, params, args)                   \
  int name params {                                   \
    static int (*volatile fn) params;                 \
    if (!fn) fn = (int (*) params)target(#name);      \
    return fn ? fn args : NOT_INITIALIZED;            \
  }

FORWARD(cublasCreate_v2, (H *handle), (handle))
FORWARD(cublasDestroy_v2, (H handle), (handle))
FORWARD(cublasSetStream_v2, (H handle, H stream), (handle, stream))
FORWARD(cublasGetMathMode, (H handle, int *mode), (handle, mode))
FORWARD(cublasSetMathMode, (H handle, int mode), (handle, mode))
FORWARD(cublasSgemmEx,
        (H h, int ta, int tb, int m, int n, int k, const float *alpha, const void *A, int Atype, int lda,
         const void *B, int Btype, int ldb, const float *beta, void *C, int Ctype, int ldc),
        (h, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc))
FORWARD(cublasGemmEx,
        (H h, int ta, int tb, int m, int n, int k, const void *alpha, const void *A, int Atype, int lda,
         const void *B, int Btype, int ldb, const void *beta, void *C, int Ctype, int ldc, int compute, int algo),
        (h, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo))
FORWARD(cublasGemmStridedBatchedEx,
        (H h, int ta, int tb, int m, int n, int k, const void *alpha, const void *A, int Atype, int lda, ll sA,
         const void *B, int Btype, int ldb, ll sB, const void *beta, void *C, int Ctype, int ldc, ll sC,
         int batch, int compute, int algo),
        (h, ta, tb, m, n, k, alpha, A, Atype, lda, sA, B, Btype, ldb, sB, beta, C, Ctype, ldc, sC, batch, compute,
         algo))
C
  cat >"$DEST/cuda12/cublas12.map" <<'MAP'
libcublas.so.12 {
  global: cublasCreate_v2; cublasDestroy_v2; cublasSetStream_v2; cublasGetMathMode; cublasSetMathMode;
          cublasSgemmEx; cublasGemmEx; cublasGemmStridedBatchedEx;
  local: *;
};
MAP
  # shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader
  "$CC" -shared -fPIC -O2 -o "$DEST/cuda12/libcublas.so.12" "$DEST/cuda12/cublas12_shim.c" \
    -Wl,-soname,libcublas.so.12 -Wl,--version-script="$DEST/cuda12/cublas12.map" \
    -Wl,--enable-new-dtags,-rpath,'$ORIGIN/../nvidia/cu13/lib:$ORIGIN/../nvidia/cublas/lib' -Wl,--no-as-needed -l:libdl.so.2
  echo 'void cublasLt12_placeholder(void) {}' >"$tmp/empty.c"
  "$CC" -shared -fPIC -o "$DEST/cuda12/libcublasLt.so.12" "$tmp/empty.c" -Wl,-soname,libcublasLt.so.12
  if objdump -T "$DEST/cuda12/libcublas.so.12" | grep -E 'GLIBC_2\.([3-9][0-9]|[4-9])' ; then
    echo "gpu_wheels: the cuBLAS glue needs a newer glibc than 2.2.5 (above); it may not load everywhere" >&2
  fi
fi

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
carried=$(find "$DEST" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
echo "gpu_wheels: $DEST holds $(find "$DEST" -name '*.whl' | wc -l) wheels, $(mib "$carried") MiB in all" \
  "(limit $MAX_MIB MiB); with the working tree ($(mib "$tree") MiB): $(mib $((carried + tree))) of $TRANSFER_MIB MiB"
column -t -s $'\t' "$DEST/MANIFEST.txt" 2>/dev/null || cat "$DEST/MANIFEST.txt"
[ -d "$DEST/cuda12" ] && ls -l "$DEST/cuda12" | awk 'NR > 1 { printf "  cuda12/%s %s bytes\n", $9, $5 }'
if [ "$carried" -gt $((MAX_MIB * 1048576)) ] || [ $((carried + tree)) -gt $((TRANSFER_MIB * 1048576)) ]; then
  echo "gpu_wheels: ERROR: $DEST is too large to carry ($(mib "$carried") MiB; at most $MAX_MIB MiB, and" \
    "$TRANSFER_MIB MiB with the working tree). Try FAISS=cpu, or drop a package." >&2
  exit 1
fi
if [ "$DEST" = .gpu-wheels ]; then
  echo "gpu_wheels: carry [\"$DEST\"] and run: OUT=\$OUT bash scripts/gpu_checks.sh"
else
  echo "gpu_wheels: carry [\"$DEST\"] and run: WHEELS=$DEST OUT=\$OUT bash scripts/gpu_checks.sh"
fi
