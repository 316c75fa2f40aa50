"""The tool-call parsers by their `--tool-call-parser` names (vLLM's), one module each."""

from __future__ import annotations

from server.tools.base import PrefixToolParser
from server.tools.generic import GenericToolParser
from server.tools.hermes import HermesToolParser
from server.tools.llama3_json import Llama3JsonToolParser
from server.tools.mistral import MistralToolParser
from server.tools.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[HermesToolParser] | type[PrefixToolParser]] = {
    "generic": GenericToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str) -> HermesToolParser | PrefixToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
