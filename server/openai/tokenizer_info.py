"""GET /tokenizer_info in vLLM's shape: the tokenizer's config as tokenizer_config.json has it.

lm-eval's `tokenizer_backend=remote` reads `eos_token`, `bos_token`, `pad_token` and
`chat_template` from here and tokenizes through /tokenize and /detokenize, so an evaluation
needs no tokenizer files (and no model hub) on the client's side.
"""

from __future__ import annotations

from typing import Any

# Paths on the server's disk: meaningless to a client.
_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
_SPECIAL_TOKENS = ("eos_token", "bos_token", "pad_token")


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else str(value)


def tokenizer_info(tokenizer) -> dict:
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in _FILE_KEYS:
        config.pop(key, None)
    config = _jsonable(config)
    for key in _SPECIAL_TOKENS:  # set on the tokenizer after loading, not always in init_kwargs
        config[key] = _jsonable(getattr(tokenizer, key, None))
    config["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config
