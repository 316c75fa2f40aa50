"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's runtime adapter updates.

Only with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or true), vLLM's opt-in; the
API key guards them as every /v1 route. Loading reads and checks the folder off the event loop
while steps go on; requests already running keep the weights they started with.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from engine.async_engine import AsyncEngine
from engine.lora.registry import LoRANotFoundError
from engine.lora.request import LoRAError, LoRAFolderNotFoundError
from server.openai.errors import APIError

ENV_FLAG = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def runtime_updates_allowed() -> bool:
    return os.environ.get(ENV_FLAG, "0").strip().lower() in ("1", "true")


def install_lora_routes(app: FastAPI, engine: AsyncEngine) -> bool:
    """Adds the two routes where allowed; whether it did."""
    if not (getattr(engine, "lora_enabled", False) and runtime_updates_allowed()):
        return False

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        try:
            await asyncio.to_thread(engine.load_lora, name, body.lora_path, body.load_inplace)
        except LoRAFolderNotFoundError as e:  # vLLM: 404 NotFoundError
            raise APIError(404, str(e), "NotFoundError", "lora_path") from e
        except LoRAError as e:
            param = "lora_name" if str(e).startswith("The lora adapter") else "lora_path"
            raise APIError(400, str(e), param=param) from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        try:
            await asyncio.to_thread(engine.unload_lora, name)  # mp: waits for a step to end
        except LoRANotFoundError as e:
            raise APIError(404, str(e), "NotFoundError", "lora_name") from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return True
