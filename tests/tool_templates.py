"""Chat templates in each tool-call style, small but written the way the real ones write calls
(Qwen/Hermes, Llama 3.1 JSON, Mistral v11, Llama 3.2/4 pythonic, and one with no tools)."""

from __future__ import annotations

_TURNS = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n{CALLS}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TOOLS = (
    "{% if tools %}<|im_start|>system\n{HEAD}{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
)


def _template(head: str, calls: str) -> str:
    return _TOOLS.replace("{HEAD}", head) + _TURNS.replace("{CALLS}", calls)


HERMES = _template(
    'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n',
    "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>\n{% endfor %}",
)
LLAMA3_JSON = _template(
    'Respond with a JSON {"name": function name, "parameters": dictionary of arguments}.\n',
    "{% for c in m['tool_calls'] %}{{ '{\"name\": \"' + c['function']['name'] + '\", ' }}"
    "{{ '\"parameters\": ' }}{{ c['function']['arguments'] | tojson }}{{ '}' }}{% endfor %}",
)
MISTRAL = _template(
    "[AVAILABLE_TOOLS]",
    "{% for c in m['tool_calls'] %}[TOOL_CALLS]{{ c['function']['name'] }}[ARGS]"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}",
)
PYTHONIC = _template(
    "Answer with [func_name1(params_name1=params_value1, params_name2=params_value2...)]\n",
    "[{% for c in m['tool_calls'] %}{{ c['function']['name'] }}("
    "{% for k, v in c['function']['arguments'].items() %}{{ k }}={{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}"
    "{% endfor %}]",
)
NO_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# style -> (template, the parser detection must pick)
TEMPLATES = {
    "hermes": (HERMES, "hermes"),
    "llama3_json": (LLAMA3_JSON, "llama3_json"),
    "mistral": (MISTRAL, "mistral"),
    "pythonic": (PYTHONIC, "pythonic"),
    "none": (NO_TOOLS, "generic"),
}
