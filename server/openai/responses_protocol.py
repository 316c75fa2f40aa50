"""The Responses API's shapes: the request, read as a chat request, and the output.

input (string | items) + instructions --> chat messages (function_call items become an
assistant message's tool_calls, function_call_output items tool messages)
text.format --> response_format, tools {type, name, parameters} --> chat tools
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from engine.core.request import check_cache_salt
from engine.sampling_params import SamplingParamsError
from server.openai.protocol import ChatCompletionRequest


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: the prefix cache per tenant

    _check_cache_salt = field_validator("cache_salt", mode="before")(check_cache_salt)

    def to_chat_request(self, history: list[dict] | None = None) -> ChatCompletionRequest:
        """`history`: the items of the previous response's conversation, before the input."""
        return ChatCompletionRequest(
            model=self.model,
            messages=self.messages(history or []),
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=[_chat_tool(t) for t in self.tools or []] or None,
            tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=_response_format(self.text),
            cache_salt=self.cache_salt,
        )

    def input_items(self) -> list[dict]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            part = {"type": "input_text", "text": self.input}
            return [{"type": "message", "role": "user", "content": [part]}]
        return self.input

    def messages(self, history: list[dict]) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = self.input_items()
        if not items:
            raise SamplingParamsError("input", "input must not be empty")
        for i, item in enumerate([*history, *items]):
            if not isinstance(item, dict):
                raise SamplingParamsError("input", f"input[{i - len(history)}] must be an object")
            messages.extend(_item_messages(item, i - len(history), messages))
        return messages


def _item_messages(item: dict, i: int, history: list[dict]) -> list[dict]:
    kind = item.get("type", "message")
    if kind == "message":
        return [{"role": item.get("role", "user"), "content": _item_text(item, i)}]
    if kind == "function_call":
        call = {
            "id": item.get("call_id") or item.get("id") or new_item_id("call"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
        }
        last = history[-1] if history else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # consecutive calls belong to one assistant turn
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _parts_text(_as_list(output), i)
        return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": content}]
    raise SamplingParamsError("input", f"input[{i}]: item type {kind!r} is not supported")


def _item_text(item: dict, i: int) -> str:
    content = item.get("content", "")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SamplingParamsError("input", f"input[{i}].content must be a string or parts")
    if any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _parts_with_images(content, i)
    return _parts_text(content, i)


def _parts_with_images(parts: list, i: int) -> list[dict]:
    """Chat content parts: the texts, and each input_image as it came (server/openai/images.py
    reads its image_url, detail or file_id)."""
    return [
        p if p.get("type") == "input_image" else {"type": "text", "text": _parts_text([p], i)}
        for p in parts
    ]


def _parts_text(parts: list, i: int) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            msg = f"input[{i}]: content type {kind!r} is not supported"
            raise SamplingParamsError("input", msg)
        texts.append(part.get("text", ""))
    return "\n".join(texts)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value] if value is not None else []


def _chat_tool(tool: dict) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise SamplingParamsError("tools", f"tool type {tool.get('type')!r} is not supported")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    return fmt  # json_object, or a type the chat surface refuses by name


def response_object(
    body: ResponsesRequest,
    response_id: str,
    model: str,
    created_at: int | None = None,
    status: str = "in_progress",
    output: list[dict] | None = None,
    usage: dict | None = None,
    incomplete_reason: str | None = None,
    stored: bool = False,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at or int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output or [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": None,
        "store": stored,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": body.metadata or {},
        "user": body.user,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [output_text_part(text)] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def responses_usage(num_prompt: int, num_output: int, num_cached: int) -> dict:
    return {
        "input_tokens": num_prompt,
        "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt + num_output,
    }
