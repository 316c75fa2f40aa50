"""Which tool-call parser a model's chat template writes, read from the template's text.

Auto tool choice is on by default (as llama.cpp's server does it): the parser is the one whose
call markup the template itself renders for assistant tool calls, in this order:

    template text contains                                   parser
    "[TOOL_CALLS]"                                           mistral
    "<tool_call>"                                            hermes (Qwen2.5/3, Hermes)
    "func_name1(" / "(params_name1=" (a pythonic example)    pythonic (Llama 3.2 pythonic, Llama 4)
    "<|python_tag|>" or '"parameters": ' (Llama 3.x JSON)    llama3_json
    "tools" (rendered, but in no known call format)          hermes (the format forced calls use)
    no "tools" at all (SmolLM2's)                            generic (tools in the system prompt)

`--tool-call-parser` overrides the choice; `--disable-auto-tool-choice` turns "auto" off (the
call format stays the detected one: "required" and named calls still use it).
"""

from __future__ import annotations

from dataclasses import dataclass

_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("pythonic", ("func_name1(", "(params_name1=")),
    ("llama3_json", ("<|python_tag|>", '"parameters": ')),
)
DEFAULT_PARSER = "hermes"
NO_TOOLS_PARSER = "generic"


@dataclass
class ToolParserChoice:
    parser: str | None  # None: tool_choice "auto" is refused
    reason: str  # for the start-up log line
    call_format: str | None = None  # the format read from the template, auto choice on or off

    def log_line(self) -> str:
        if self.parser is None:
            off = f"pagedserve: tool calling: auto tool choice off ({self.reason})"
            return f"{off}, forced calls in the {self.call_format} format"
        return f"pagedserve: tool calling: auto, parser {self.parser} ({self.reason})"


def detect_tool_parser(chat_template: str | None) -> tuple[str, str]:
    """(parser name, why) for a chat template's text."""
    text = chat_template or ""
    for name, markers in _RULES:
        found = next((m for m in markers if m in text), None)
        if found is not None:
            return name, f"the chat template writes {found!r}"
    if "tools" in text:
        return DEFAULT_PARSER, "the chat template renders tools in no known call format"
    return NO_TOOLS_PARSER, "the chat template has no tool support"


def choose_tool_parser(
    chat_template: str | None, override: str | None, disabled: bool
) -> ToolParserChoice:
    parser, reason = detect_tool_parser(chat_template)
    if override:
        parser, reason = override, "--tool-call-parser"
    if disabled:
        return ToolParserChoice(None, "--disable-auto-tool-choice", parser)
    return ToolParserChoice(parser, reason, parser)


def template_text(tokenizer) -> str | None:
    """The tokenizer's default chat template (a dict of named templates: the "default" one)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None
