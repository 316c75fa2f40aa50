"""LoRA adapters on the mp executor's worker processes (tensor parallelism or one rank).

    engine  registry.load -> MultiprocExecutor.add_lora --("lora", (op, LoRARequest))--> rank 0
    rank 0  broadcasts it with the steps' messages; every rank loads (or drops) its share
    ranks   agree with one MIN all-reduce on the cpu group; rank 0 answers (None or the error)

The LoRARequest comes from the engine with its content hash already computed (the prefix
cache's identity is computed once, in the engine); a worker never hashes the folder again.
A worker keeps one canonical LoRARequest per adapter and its mirrored requests point at it, so
the runner's manager keeps an unloaded adapter's weights while a running request still holds
them (engine/lora/manager.py), exactly as in one process.
"""

from __future__ import annotations

import logging

from engine.lora.request import LoRAError, LoRAFolderNotFoundError

logger = logging.getLogger(__name__)

OTHER_RANK_FAILED = "the adapter could not be loaded on another tensor-parallel rank (see its log)"


class WorkerLoRAs:
    """A worker's adapter ops; manager: its runner's LoRAManager (None without --enable-lora)."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.canon: dict = {}  # LoRARequest -> the one equal object this worker's mirrors hold

    def canonical(self, request):
        """The worker's own object for an adapter a mirrored request names (None: the base)."""
        return None if request is None else self.canon.get(request, request)

    def apply(self, op: str, request) -> tuple[str, str] | None:
        """Adds or removes an adapter on this rank, every rank taking part; None, or the error
        (type name, message) that the engine raises."""
        from engine.distributed import min_across_ranks

        error = None
        try:
            if self.manager is None:
                raise LoRAError("LoRA adapters need --enable-lora")
            if op == "add":
                self.manager.add(self.canon.setdefault(request, request))
            else:
                self.manager.remove(self.canon.pop(request, request))
        except Exception as e:  # noqa: BLE001 - reported to the engine, the worker keeps serving
            logger.warning("LoRA %s of %s failed: %s", op, request.name, e)
            error = (type(e).__name__, str(e))
        if min_across_ranks(0 if error else 1) == 0 and error is None:
            error = ("LoRAError", OTHER_RANK_FAILED)
            if op == "add":  # every rank ends without it, as the engine's registry does
                self.manager.remove(self.canon.pop(request, request))
        return error


def raise_lora_error(error: tuple[str, str] | None) -> None:
    """The engine's side: a worker's refusal as the exception the one-process path raises."""
    if error is None:
        return
    kind, message = error
    if kind == "LoRAFolderNotFoundError":
        raise LoRAFolderNotFoundError(message)
    if kind in ("LoRAError", "LoRANotFoundError", "ValueError"):
        raise LoRAError(message)
    raise RuntimeError(f"LoRA adapter op failed in a worker: {kind}: {message}")
