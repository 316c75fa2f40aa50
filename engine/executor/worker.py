"""One tensor-parallel rank in its own process: load this rank's shard, then run every step.

    rank 0      engine pipe --recv--> broadcast to the others --> ModelRunner.execute --> pipe
    rank 1..N   broadcast from rank 0 ----------------------------> ModelRunner.execute

Every rank mirrors the scheduled requests from the wire's RequestDeltas (executor.py),
so each builds the same inputs; rank 0 alone samples, and answers. While the engine is idle
rank 0 broadcasts a heartbeat, so the other ranks' waits never reach the process group's timeout.

A worker dies with its parent: a thread watches the parent's sentinel (an EOF when the parent
process is gone, however it ended) and exits at once. faulthandler is on, so a native fault
leaves its stack in the log.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import wait

from engine.config import EngineConfig

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
_HEARTBEAT = pickle.dumps(("heartbeat", None))
# Test-only: PAGEDSERVE_WORKER_FAULT=segv_after_steps:N makes rank PAGEDSERVE_WORKER_FAULT_RANK
# (default 0) dereference NULL after N steps, the way a fault in a C++ kernel ends a process;
# segv_at_load does it once the rank has joined the rendezvous, before its weights load.
WORKER_FAULT_ENV = "PAGEDSERVE_WORKER_FAULT"


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig
    model_dir: str
    rank: int
    master_port: int


def worker_main(spec: WorkerSpec, conn) -> None:
    """The process's entry point (multiprocessing spawn)."""
    faulthandler.enable(all_threads=True)
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(message)s")
    try:
        worker = Worker(spec)
    except BaseException as e:  # noqa: BLE001 - the engine reports it and stops the others
        conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))
        os._exit(1)
    conn.send(("ready", worker.info()))
    try:
        worker.loop(conn)
    except BaseException as e:  # noqa: BLE001 - a collective that failed, a bad step
        logger.exception("worker rank %d failed", spec.rank)
        try:
            conn.send_bytes(pickle.dumps(("error", (spec.rank, f"{type(e).__name__}: {e}"))))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        # The engine process imports this module for WorkerSpec and worker_main; what runs the
        # model is imported here, in the worker process only (not to dodge a cycle).
        from transformers import AutoConfig

        from engine.distributed import init_distributed
        from engine.kv_offload.tp_worker import attach_worker_tier
        from engine.lora.workers import WorkerLoRAs
        from engine.runner.model_runner import ModelRunner, resolve_device

        cfg = spec.config
        self.rank = spec.rank
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(spec.rank % torch.cuda.device_count())
        init_distributed(
            spec.rank, cfg.tensor_parallel_size, cfg.master_addr, spec.master_port, device.type
        )
        self.fault_after = _fault_plan(spec.rank)
        if self.fault_after == -1:
            _segfault()
        hf_config = AutoConfig.from_pretrained(spec.model_dir)
        self.runner = ModelRunner(cfg, spec.model_dir, hf_config)
        self.kv_tier = attach_worker_tier(cfg, spec.model_dir, self.runner)  # this rank's shard
        self.mirrors: dict = {}
        self.loras = WorkerLoRAs(self.runner.lora)  # the executor's adapter ops
        self.grammars = None
        if spec.rank == 0:  # only rank 0 samples, so only it masks
            from transformers import AutoTokenizer

            from engine.sample.structured_output import GrammarCompiler

            tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
            self.grammars = GrammarCompiler(
                tokenizer, hf_config.get_text_config().vocab_size, cfg.grammar_compile_timeout
            )

    def info(self) -> dict:
        r = self.runner
        return dict(
            num_blocks=r.num_blocks, kv_windows=r.kv_cache_spec.windows, dtype=r.dtype,
            device=r.device, backend=r.backend.name, kv_cache_bytes=r.kv_cache_bytes,
            kv_tier=self.kv_tier and self.kv_tier.report(),  # a gather: every rank calls info
        )

    def loop(self, conn) -> None:
        from engine.distributed import barrier, broadcast_bytes, get_tp

        driver, world = self.rank == 0, get_tp().world_size
        num_steps = 0
        while True:
            if driver:
                payload = conn.recv_bytes() if conn.poll(HEARTBEAT_S) else _HEARTBEAT
                if world > 1:
                    broadcast_bytes(payload)
            else:
                payload = broadcast_bytes(None)
            kind, wire = pickle.loads(payload)
            if kind == "shutdown":
                if self.kv_tier is not None:  # the queued writes land before the exit
                    self.kv_tier.close()
                barrier()
                return
            if kind == "lora":
                error = self.loras.apply(*wire)
                if driver:
                    conn.send_bytes(pickle.dumps(("lora", error)))
                continue
            if kind == "step":
                if num_steps == self.fault_after:
                    _segfault()
                self.step(conn if driver else None, wire)
                num_steps += 1

    def step(self, conn, wire) -> None:
        """One step; the driver (the one with `conn`) sends the output back."""
        from engine.distributed import collective_timer

        collective_timer.take()
        start = time.perf_counter()
        output = self.runner.execute(self.mirror(wire))
        if self.kv_tier is not None:  # a gather every rank joins
            output.kv_tier_reports = self.kv_tier.report()
        if conn is not None:
            result = (output, collective_timer.take(), time.perf_counter() - start)
            conn.send_bytes(pickle.dumps(("output", result), protocol=pickle.HIGHEST_PROTOCOL))

    def mirror(self, message):
        """The SchedulerOutput with this process's Request mirrors in place of the deltas."""
        from engine.core.request import Request

        wire, first, ids, appended = message
        mirrors = self.mirrors
        for request_id in wire.finished_req_ids:
            mirrors.pop(request_id, None)
        for d in first:
            prompt = d.new_token_ids[: d.num_prompt_tokens]
            req = Request(d.request_id, prompt, d.params, d.eos_token_id, 0.0, d.eos_token_ids)
            req.all_token_ids.extend(d.new_token_ids[d.num_prompt_tokens :])
            req.lora_request = self.loras.canonical(d.lora_request)
            req.mm_inputs = d.mm_inputs or []  # the vision tower runs, replicated, on each rank
            spec = d.params.structured_outputs
            if spec is not None and self.grammars is not None:
                req.grammar = self.grammars.compile(spec).new_matcher()
            mirrors[d.request_id] = req
        requests = [mirrors[rid] for rid in ids]
        for req, tokens in zip(requests, appended):
            if tokens:
                req.all_token_ids.extend(tokens)
        return replace(wire, requests=requests)


def _fault_plan(rank: int) -> int | None:
    """The step after which to fault (-1: at load), None: no fault."""
    name, _, num = os.environ.get(WORKER_FAULT_ENV, "").partition(":")
    if rank != int(os.environ.get(WORKER_FAULT_ENV + "_RANK", "0")):
        return None
    if name == "segv_at_load":
        return -1
    return int(num) if name == "segv_after_steps" and num.isdigit() else None


def _segfault() -> None:
    import ctypes

    logger.error("injected fault (%s): dereferencing NULL", WORKER_FAULT_ENV)
    ctypes.string_at(0)
