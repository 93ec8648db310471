"""Drives a running actorllm server with the official `openai` Python client, unchanged.

Usage: python tests/openai_client.py BASE_URL MODEL
Exits non-zero (with the assertion) if anything a client relies on is off.
"""
import sys

from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{base}/v1", api_key="unused")

models = [m.id for m in client.models.list().data]
assert model in models, models

chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=24,
    temperature=0,
)
assert chat.object == "chat.completion"
assert chat.choices[0].message.role == "assistant"
assert chat.choices[0].message.content, chat
assert chat.choices[0].finish_reason in ("stop", "length")
assert chat.usage.completion_tokens > 0

pieces = []
usage = None
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=24,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
finish = None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(pieces) == chat.choices[0].message.content, ("".join(pieces), chat.choices[0].message.content)
assert finish == chat.choices[0].finish_reason
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2)
assert comp.object == "text_completion"
assert comp.choices[0].text
assert len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens

streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    if c.choices
)
assert streamed == comp.choices[0].text, (streamed, comp.choices[0].text)

try:
    client.completions.create(model="no-such-model", prompt="x")
    raise AssertionError("unknown model accepted")
except Exception as e:  # openai.NotFoundError
    assert getattr(e, "status_code", None) == 404, e

print("openai client: 6 checks passed")
