"""The engine's one door to the model: execute(SchedulerOutput) -> ModelRunnerOutput.

    uni  UniProcExecutor    the ModelRunner in the engine's own thread (the default at N=1)
    mp   MultiprocExecutor  every rank a worker process (engine/executor/worker.py), rank 0 in:
                            a native fault or an OOM kill takes a worker, never the HTTP process

`--distributed-executor-backend` picks one (vLLM's flag); `mp` is the only choice above one rank.

MultiprocExecutor, per step:

    engine --pickle once--> pipe --> rank 0 --gloo broadcast (cpu group)--> ranks 1..N-1
    engine <--ModelRunnerOutput-- pipe <-- rank 0              (all ranks run the forward)

The scheduler's Request objects stay in the engine process; the wire carries a RequestDelta per
scheduled request: its prompt and params on first sight, afterwards only the tokens the workers
have not seen (one per decode step), so a step's message does not grow with the context.
A worker that exits, crashes or reports an error makes the executor dead (EngineDeadError); the
engine loop then fails every pending request, and the server exits 1 (server/lifecycle.py).
A watcher thread waits on the workers' sentinels, so a death is noticed at once even while no
step runs (an idle server): it sets `dead`, which /health and the lifecycle read.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from multiprocessing.connection import wait

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.outputs import ModelRunnerOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # loading a large checkpoint on a slow disk
SHUTDOWN_GRACE_S = 5.0
WATCH_EXIT_STATUS_S = 5.0  # how long the watcher waits for a dead worker's exit status


class EngineDeadError(RuntimeError):
    """The engine loop or a model worker died; nothing more will be generated."""


@dataclass
class ExecutorStats:
    """Sums since start: steps, seconds the engine waited on execute, seconds the workers spent
    inside collectives (rank 0's), and seconds rank 0 spent in the model runner."""

    num_steps: int = 0
    execute_s: float = 0.0
    collective_s: float = 0.0
    runner_s: float = 0.0


class Executor(ABC):
    num_blocks: int
    kv_windows: tuple[int, ...]  # attention window of each KV cache group (0: full attention)
    dtype: object
    device: object
    backend_name: str
    dead: str | None = None  # why the executor can run no more steps (a worker died)

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; the sampled tokens come from rank 0."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a finished request (its rows, sampler state, wire mirror)."""

    @abstractmethod
    def check_health(self) -> None:
        """EngineDeadError when a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops every worker this process started; idempotent."""

    def add_lora(self, lora_request) -> None:
        """Loads and checks a LoRA adapter where the model runs (engine/lora/)."""
        raise ValueError("LoRA adapters need the uni executor")

    def remove_lora(self, lora_request) -> None:
        raise ValueError("LoRA adapters need the uni executor")

    def admit_lora(self, lora_request, holder) -> None:
        """A request (`holder`) admitted under the adapter: its weights in memory while it lives
        (engine/lora/manager.py's admit); LoRAError if they cannot be read back."""
        self.add_lora(lora_request)


def create_executor(config: EngineConfig, model_dir, hf_config) -> Executor:
    if config.distributed_executor_backend == "uni":
        return UniProcExecutor(config, model_dir, hf_config)
    return MultiprocExecutor(config, model_dir, hf_config)


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir, hf_config) -> None:
        # Imported here, not for a cycle: an engine on worker processes never loads the model
        # runner (torch, the model code) in its own process.
        from engine.runner.model_runner import ModelRunner
        from engine.runner.pooling_hook import PoolingModelRunner  # a causal embedder's

        runner_cls = PoolingModelRunner if config.runner == "pooling" else ModelRunner
        self.runner = runner_cls(config, model_dir, hf_config)
        self.num_blocks = self.runner.num_blocks
        self.kv_cache_bytes = self.runner.kv_cache_bytes
        self.kv_windows = self.runner.kv_cache_spec.windows
        self.dtype, self.device = self.runner.dtype, self.runner.device
        self.backend_name = self.runner.backend.name
        self.stats = ExecutorStats()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def add_lora(self, lora_request) -> None:
        self.runner.lora.add(lora_request)

    def remove_lora(self, lora_request) -> None:
        self.runner.lora.remove(lora_request)

    def admit_lora(self, lora_request, holder) -> None:
        self.runner.lora.admit(lora_request, holder)


# ---- the wire ------------------------------------------------------------------------------
@dataclass
class RequestDelta:
    """What a worker needs of a scheduled request beyond what it already mirrors."""

    request_id: str
    new_token_ids: list[int]  # appended to the mirror's all_token_ids
    params: SamplingParams | None = None  # first sight only, with the fields below
    num_prompt_tokens: int = 0
    eos_token_id: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    lora_request: object = None  # engine/lora LoRARequest (its content hash computed once)
    mm_inputs: list | None = None  # engine/multimodal ImageInputs (pixels): every rank encodes


class WireEncoder:
    """Engine side: SchedulerOutput -> the pickled message, tracking what the workers hold.

    The message is ("step", SchedulerOutput without its Request objects, RequestDeltas of the
    requests seen for the first time, every scheduled request's id in batch order, the tokens
    to append to each one's mirror): plain lists, so pickling stays cheap per request.
    """

    def __init__(self) -> None:
        self.num_sent: dict[str, int] = {}  # request id -> tokens the workers' mirror holds

    def encode(self, out: SchedulerOutput) -> bytes:
        num_sent = self.num_sent
        for request_id in out.finished_req_ids:
            num_sent.pop(request_id, None)
        first: list[RequestDelta] = []
        ids: list[str] = []
        appended: list[list[int]] = []
        for req in out.requests:
            rid, tokens = req.request_id, req.all_token_ids
            sent = num_sent.get(rid)
            num_sent[rid] = len(tokens)
            ids.append(rid)
            if sent is None:
                first.append(self._first_sight(req))
                appended.append([])
            else:
                appended.append(tokens[sent:])
        wire = replace(out, requests=[], preempted=[])
        message = ("step", (wire, first, ids, appended))
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def _first_sight(req: Request) -> RequestDelta:
        return RequestDelta(
            req.request_id,
            list(req.all_token_ids),
            req.sampling_params,
            req.num_prompt_tokens,
            req.eos_token_id,
            req.eos_token_ids,
            req.lora_request,
            req.mm_inputs or None,
        )


# ---- the multiprocess executor ----------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_ranks(config: EngineConfig) -> range:
    per_node = config.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


class WorkerGroup:
    """This host's worker processes: start, wait until loaded, watch, stop (no orphans)."""

    def __init__(self, config: EngineConfig, model_dir, master_port: int) -> None:
        from engine.executor.worker import WorkerSpec, worker_main  # with UniProc, never loaded

        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads
        self.processes: list = []
        self.conns: list = []
        self.ranks = list(local_ranks(config))
        try:
            for rank in self.ranks:
                spec = WorkerSpec(config, str(model_dir), rank, master_port)
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main,
                    args=(spec, child_conn),
                    name=f"pagedserve-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self.processes.append(proc)
                self.conns.append(parent_conn)
            self.infos = self._wait_all_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_all_ready(self) -> list[dict]:
        """Every local worker's info once all loaded; the first failure or death raises (a rank
        that died leaves the others waiting at the rendezvous, so all are watched at once)."""
        infos: dict[int, dict] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(infos) < len(self.ranks):
            pending = [i for i in range(len(self.ranks)) if i not in infos]
            watched = [self.conns[i] for i in pending]
            watched += [self.processes[i].sentinel for i in pending]
            ready = wait(watched, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"workers not loaded within {STARTUP_TIMEOUT_S:g} s")
            for i in pending:
                if self.conns[i] in ready:
                    infos[i] = self._read_ready(i)
                elif self.processes[i].sentinel in ready:
                    self._read_ready(i)  # its last word, if it sent one, else how it died
        return [infos[i] for i in range(len(self.ranks))]

    def _read_ready(self, i: int) -> dict:
        conn, proc, rank = self.conns[i], self.processes[i], self.ranks[i]
        try:
            kind, payload = conn.recv() if conn.poll() else ("died", None)
        except EOFError:
            kind, payload = "died", None
        if kind == "ready":
            return payload
        if kind == "error" and payload[0] == "ValueError":
            raise ValueError(payload[1])  # a config or checkpoint problem: one line
        if kind == "error":
            raise RuntimeError(f"worker rank {rank} failed to start:\n{payload[2]}")
        proc.join(1.0)
        how = describe_exit(proc.exitcode)
        raise RuntimeError(f"worker rank {rank} died while loading ({how})")

    def dead_worker(self) -> str | None:
        for rank, proc in zip(self.ranks, self.processes):
            if not proc.is_alive():
                return f"worker rank {rank} died ({describe_exit(proc.exitcode)})"
        return None

    def stop(self, graceful: bool = True) -> None:
        """Asks once (graceful), then terminates, then kills: nothing outlives this call."""
        for conn in self.conns if graceful else []:
            try:
                conn.send_bytes(pickle.dumps(("shutdown", None)))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (SHUTDOWN_GRACE_S if graceful else 0.0)
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self.conns:
            conn.close()
        self.conns = []


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir, hf_config) -> None:
        port = config.master_port or free_port()
        self.workers = WorkerGroup(config, model_dir, port)
        info = self.workers.infos[0]
        self.num_blocks = info["num_blocks"]
        self.kv_cache_bytes = info.get("kv_cache_bytes")  # rank 0's share
        self.kv_windows = tuple(info["kv_windows"])
        self.dtype, self.device = info["dtype"], info["device"]
        self.backend_name = info["backend"]
        self.encoder = WireEncoder()
        self.on_kv_tier_reports = lambda reports: None  # set by engine/kv_offload/tp_index.py
        self.stats = ExecutorStats()
        self.dead: str | None = None
        self._pipe_lock = threading.Lock()  # a step and an adapter op share rank 0's pipe
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()  # shutdown wakes the watcher through it
        self._watcher = threading.Thread(target=self._watch, name="worker-watch", daemon=True)
        self._watcher.start()
        logger.info(
            "executor: mp, %d worker process(es) on this host (ranks %s), master port %d",
            len(self.workers.ranks),
            self.workers.ranks,
            port,
        )

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with self._pipe_lock:
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        start = time.perf_counter()
        payload = self.encoder.encode(out)
        try:
            self.workers.conns[0].send_bytes(payload)
        except (OSError, ValueError):
            self._die(self.workers.dead_worker() or "worker rank 0 closed its pipe")
        kind, result = self._wait_result()
        if kind != "output":  # a peer's death often surfaces first as a failed collective
            self._die(self._dead_within(1.0) or f"worker rank {result[0]} failed: {result[1]}")
        output, collective_s, runner_s = result
        if output.kv_tier_reports is not None:  # the KV tier's ranks (kv_offload/tp_index.py)
            self.on_kv_tier_reports(output.kv_tier_reports)
        stats = self.stats
        stats.num_steps += 1
        stats.execute_s += time.perf_counter() - start
        stats.collective_s += collective_s
        stats.runner_s += runner_s
        return output

    def _wait_result(self):
        """Rank 0's answer; any other local worker only ever speaks to report an error."""
        conns, procs = self.workers.conns, self.workers.processes
        while True:
            ready = wait(conns + [p.sentinel for p in procs])
            for conn in conns:
                if conn in ready:
                    try:
                        return pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):  # closed or reset by a dying worker
                        pass  # its sentinel says how it ended
            dead = self._dead_within(1.0)  # the pipe closes a moment before the exit status
            if dead:
                self._die(dead)

    def _dead_within(self, seconds: float) -> str | None:
        deadline = time.monotonic() + seconds
        while True:
            dead = self.workers.dead_worker()
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def _die(self, reason: str):
        self.dead = reason
        logger.error("executor dead: %s; stopping every worker", reason)
        self.workers.stop(graceful=False)
        raise EngineDeadError(reason)

    def add_lora(self, lora_request) -> None:
        self._lora_op("add", lora_request)

    def remove_lora(self, lora_request) -> None:
        self._lora_op("remove", lora_request)

    def _lora_op(self, op: str, lora_request) -> None:
        """Every rank loads (or drops) its share of the adapter between two steps
        (engine/lora/workers.py); a refusal raises LoRAError as in one process."""
        from engine.lora.workers import raise_lora_error

        with self._pipe_lock:
            self.check_health()
            try:
                self.workers.conns[0].send_bytes(pickle.dumps(("lora", (op, lora_request))))
            except (OSError, ValueError):
                self._die(self.workers.dead_worker() or "worker rank 0 closed its pipe")
            kind, result = self._wait_result()
        if kind != "lora":
            self._die(self._dead_within(1.0) or f"worker rank {result[0]} failed: {result[1]}")
        raise_lora_error(result)

    def release(self, request_id: str) -> None:
        self.encoder.num_sent.pop(request_id, None)  # workers drop theirs on finished_req_ids

    def check_health(self) -> None:
        if self.dead is None:
            dead = self.workers.dead_worker()
            if dead:
                self._die(dead)
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def _watch(self) -> None:
        """Blocks on every worker's sentinel: the first to end makes the executor dead (the
        engine's step, if one runs, reports the same death through _wait_result)."""
        procs = self.workers.processes
        ready = wait([p.sentinel for p in procs] + [self._wake_r])
        if self._stopping or self.dead is not None:
            return
        # The first sentinel to fire names the rank; its exit status comes a moment later, and
        # a blocking join waits for it however loaded the host (polling once gave up too soon).
        first = next((i for i, p in enumerate(procs) if p.sentinel in ready), None)
        if first is None:
            reason = "a worker process ended"
        else:
            procs[first].join(WATCH_EXIT_STATUS_S)
            how = describe_exit(procs[first].exitcode)
            reason = f"worker rank {self.workers.ranks[first]} died ({how})"
        if self.dead is None:
            self.dead = reason
            logger.error("executor dead: %s (noticed by the watcher)", reason)

    def shutdown(self) -> None:
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self.workers.stop()
        self._watcher.join(1.0)
        if not self._watcher.is_alive() and self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
