"""Drives a running actorllm server with the official `openai` Python client, unchanged.

Usage: python tests/openai_client.py BASE_URL MODEL
Runs every check below, prints one line per check, then "openai client: N of M checks
passed"; exits non-zero when any failed. Checks raise on their own (no bare `assert`,
which `python -O` removes).
"""
import json
import sys
import traceback

import openai
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{base}/v1", api_key="unused")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHECKS = []


class CheckFailed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise CheckFailed(what)


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def models_lists_the_served_name():
    ids = [m.id for m in client.models.list().data]
    expect(model in ids, f"{model} not in {ids}")


def chat_once():
    return client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)


@check
def chat_completion_has_the_openai_shape():
    chat = chat_once()
    expect(chat.object == "chat.completion", chat.object)
    expect(chat.choices[0].message.role == "assistant", chat.choices[0].message.role)
    expect(bool(chat.choices[0].message.content), f"empty answer: {chat}")
    expect(chat.choices[0].finish_reason in ("stop", "length"), chat.choices[0].finish_reason)
    expect(chat.usage.completion_tokens > 0, chat.usage)


@check
def streamed_chat_equals_the_plain_answer():
    chat = chat_once()
    pieces, usage, finish = [], None, None
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    expect("".join(pieces) == chat.choices[0].message.content, ("".join(pieces), chat.choices[0].message.content))
    expect(finish == chat.choices[0].finish_reason, (finish, chat.choices[0].finish_reason))
    expect(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage)


@check
def completion_logprobs_cover_every_token():
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2)
    expect(comp.object == "text_completion", comp.object)
    expect(bool(comp.choices[0].text), comp)
    lp = comp.choices[0].logprobs
    expect(len(lp.tokens) == comp.usage.completion_tokens, (len(lp.tokens), comp.usage))
    expect(all(len(t) == 2 for t in lp.top_logprobs), lp.top_logprobs)
    expect("".join(lp.tokens) == comp.choices[0].text, (lp.tokens, comp.choices[0].text))


@check
def streamed_completion_equals_the_plain_one():
    plain = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    expect(streamed == plain.choices[0].text, (streamed, plain.choices[0].text))


@check
def an_unknown_model_is_a_404():
    try:
        client.completions.create(model="no-such-model", prompt="x")
    except openai.NotFoundError as e:
        expect(e.status_code == 404, e)
        return
    raise CheckFailed("unknown model accepted")


@check
def a_bad_field_is_a_400_naming_it():
    try:
        client.completions.create(model=model, prompt="x", temperature=-1)
    except openai.BadRequestError as e:
        expect("temperature" in str(e), e)
        return
    raise CheckFailed("temperature -1 accepted")


@check
def n_choices_and_a_seed_repeat():
    a = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, n=2, temperature=1, seed=7)
    b = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, n=2, temperature=1, seed=7)
    expect([c.index for c in a.choices] == [0, 1], a.choices)
    expect([c.text for c in a.choices] == [c.text for c in b.choices], (a.choices, b.choices))


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_weather_arguments(arguments):
    args = json.loads(arguments)
    return set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")


@check
def required_tool_choice_returns_tool_calls():
    chat = client.chat.completions.create(
        model=model, messages=WEATHER, max_tokens=80, temperature=0, tools=TOOLS, tool_choice="required")
    calls = chat.choices[0].message.tool_calls
    expect(calls and calls[0].type == "function" and calls[0].function.name == "get_weather", chat)
    expect(valid_weather_arguments(calls[0].function.arguments), calls[0].function.arguments)
    expect(chat.choices[0].finish_reason == "tool_calls", chat.choices[0].finish_reason)
    # The call and its result go back into the conversation.
    follow = client.chat.completions.create(model=model, max_tokens=8, temperature=0, tools=TOOLS, tool_choice="none",
        messages=WEATHER + [chat.choices[0].message,
            {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees"}])
    expect(follow.choices[0].message.content is not None, follow)


@check
def streamed_named_tool_call_arrives_as_argument_deltas():
    stream = client.chat.completions.create(
        model=model, messages=WEATHER, max_tokens=80, temperature=0, tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    name, arguments, deltas, ids = None, "", 0, set()
    for chunk in stream:
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                if call.id:
                    ids.add(call.id)
                if call.function.name:
                    name = call.function.name
                if call.function.arguments:
                    arguments += call.function.arguments
                    deltas += 1
    expect(name == "get_weather" and len(ids) == 1, (name, ids))
    expect(deltas > 1, deltas)
    expect(valid_weather_arguments(arguments), arguments)


@check
def json_schema_response_format_gives_valid_json():
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    value = json.loads(chat.choices[0].message.content)
    expect(set(value) == {"answer"} and isinstance(value["answer"], str), value)


passed = 0
for fn in CHECKS:
    try:
        fn()
        passed += 1
        print(f"ok      {fn.__name__}")
    except Exception:
        print(f"FAILED  {fn.__name__}\n{traceback.format_exc()}")
print(f"openai client: {passed} of {len(CHECKS)} checks passed")
sys.exit(0 if passed == len(CHECKS) else 1)
