"""The ChatML chat template kvmesh writes into the model folders it makes, with tool rendering.

ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), as SmolLM2 and our own pycode models speak
it. With ``tools`` (as transformers passes them), a system turn lists them as JSON inside
<tools></tools> and asks for calls in the Hermes/Qwen format the gateway parses
(services/gateway/tool_calls/hermes.py); the first system message's text (else the model's
default system prompt, if it has one) leads that turn. Assistant calls are replayed in the
same format, and tool results go back in a user turn as <tool_response> blocks (consecutive
results share one turn). Without tools, ordinary messages render exactly as the model's own
ChatML template does.
"""

from __future__ import annotations

import json

_TOOLS_SYSTEM_TURN = (
    "{{ '# Tools\n\nYou may call these functions:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nTo call one, write a block per call:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n\' }}'
)

_MESSAGES = (
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ arguments if arguments is string else (arguments | tojson) }}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml_template(default_system: str | None = None) -> str:
    """The template; ``default_system`` is the system prompt a conversation without one gets
    (SmolLM2's own template adds one), None for none."""
    if default_system is None:
        return (
            "{% if tools %}"
            "{{ '<|im_start|>system\n' }}"
            "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
            + _TOOLS_SYSTEM_TURN
            + "{% endif %}"
            + _MESSAGES
        )
    default = json.dumps(default_system, ensure_ascii=False)
    return (
        "{% set has_system = messages and messages[0]['role'] == 'system' %}"
        "{% if tools %}"
        "{{ '<|im_start|>system\n' }}"
        "{{ (messages[0]['content'] if has_system else "
        + default
        + ") + '\n\n' }}"
        + _TOOLS_SYSTEM_TURN
        + "{% elif not has_system %}"
        "{{ '<|im_start|>system\n' + " + default + " + '<|im_end|>\n' }}"
        "{% endif %}" + _MESSAGES
    )


# Our own models' template (models/pycode-*): plain ChatML, no default system prompt.
CHAT_TEMPLATE = chatml_template()
