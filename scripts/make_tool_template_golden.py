"""Renders a hermes-style (Qwen2.5) chat template with tools, an assistant turn that calls
them and the tools' answers, as transformers' apply_chat_template does, into
tests/fixtures/tools/template_golden.json (the server must render the same text).

Usage: python scripts/make_tool_template_golden.py  (needs transformers)
"""
import json
import pathlib

from transformers.utils.chat_template_utils import render_jinja_template

root = pathlib.Path(__file__).resolve().parent.parent
fixtures = root / "tests" / "fixtures" / "tools"
template = (fixtures / "hermes_template.jinja").read_text()
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
# As an OpenAI client sends them: arguments are JSON text.
messages = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}},
        {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"Europe/Paris\"}"}},
    ]},
    {"role": "tool", "tool_call_id": "call-1", "content": "{\"temperature\": 18}"},
    {"role": "tool", "tool_call_id": "call-2", "content": "14:05"},
]
# What the template sees (as vLLM gives it): arguments parsed into objects, no content as "".
rendered_messages = json.loads(json.dumps(messages))
for m in rendered_messages:
    if m["content"] is None:
        m["content"] = ""
    for c in m.get("tool_calls", []):
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
rendered, _ = render_jinja_template(
    conversations=[rendered_messages], tools=tools, chat_template=template, add_generation_prompt=True
)
out = {"tools": tools, "messages": messages, "rendered": rendered[0]}
(fixtures / "template_golden.json").write_text(json.dumps(out, indent=1) + "\n")
print(rendered[0])
