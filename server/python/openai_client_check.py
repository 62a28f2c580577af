"""Drives running `sparsekit serve`s with the official `openai` Python client.

Usage: python3 openai_client_check.py URL TOOLS_URL API_KEY

URL serves the model; TOOLS_URL serves it with a scripted reply (`--scripted-reply`, a
test injection: the reply is a DSML call of `get_weather` with city "Hangzhou" and days
3, as a model with random weights never writes one). Both require API_KEY.

Checks, streaming and not: the API key (a client without it gets AuthenticationError),
models.list and models.retrieve, completions, chat completions (with usage in the
stream), that a stream and a non-stream greedy request give the same text, tools (the
reply's DSML as `tool_calls`, whole and streamed as deltas), and that bad requests raise
the client's typed errors (NotFoundError, BadRequestError). Exits non-zero with a message
on the first failure; prints one summary line on success.
"""

import json

import sys

import openai
from openai import OpenAI


def check(cond, msg):
    if not cond:
        print(f"FAIL: {msg}", file=sys.stderr)
        sys.exit(1)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city for the next days",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
WANT_ARGS = {"city": "Hangzhou", "days": 3}


def check_tools(base, key):
    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Weather in Hangzhou for 3 days?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=400)
    choice = r.choices[0]
    check(choice.finish_reason == "tool_calls", f"tools finish {choice.finish_reason}")
    calls = choice.message.tool_calls or []
    check(len(calls) == 1, f"tool calls {calls}")
    check(calls[0].type == "function" and calls[0].id.startswith("call_"), f"call {calls[0]}")
    check(calls[0].function.name == "get_weather", f"call name {calls[0].function.name}")
    args = json.loads(calls[0].function.arguments)
    check(args == WANT_ARGS, f"call arguments {args}")

    stream = client.chat.completions.create(
        model="tiny", messages=msgs, tools=TOOLS, tool_choice="auto", max_tokens=400, stream=True,
    )
    names, arguments, finish = {}, {}, None
    for ch in stream:
        for choice in ch.choices:
            for d in choice.delta.tool_calls or []:
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                if d.function and d.function.arguments:
                    arguments[d.index] = arguments.get(d.index, "") + d.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    check(names == {0: "get_weather"}, f"streamed call names {names}")
    check(json.loads(arguments.get(0, "null")) == WANT_ARGS, f"streamed arguments {arguments}")
    check(finish == "tool_calls", f"streamed tools finish {finish}")

    # The whole conversation goes back as history (the call rendered as DSML).
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 24C"},
    ]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=400)
    check(r.choices[0].message.tool_calls, "history with a tool result")


def main():
    base, tools_base, key = sys.argv[1].rstrip("/"), sys.argv[2].rstrip("/"), sys.argv[3]

    try:
        OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=60).models.list()
        check(False, "a wrong API key was accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, f"wrong key status {e.status_code}")

    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    models = client.models.list()
    ids = [m.id for m in models.data]
    check(ids == ["tiny"], f"models.list: {ids}")
    m = client.models.retrieve("tiny")
    check(m.id == "tiny" and m.object == "model", f"models.retrieve: {m}")
    try:
        client.models.retrieve("no-such-model")
        check(False, "retrieving an unknown model worked")
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"unknown model status {e.status_code}")

    c = client.completions.create(
        model="tiny", prompt="The lightning indexer", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )
    check(c.object == "text_completion", f"completion object {c.object}")
    check(c.usage.completion_tokens == 8, f"usage {c.usage}")
    check(c.choices[0].finish_reason == "length", f"finish {c.choices[0].finish_reason}")
    text = c.choices[0].text

    stream = client.completions.create(
        model="tiny", prompt="The lightning indexer", max_tokens=8, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )
    streamed = "".join(ch.choices[0].text for ch in stream if ch.choices)
    check(streamed == text, f"streamed completion {streamed!r} != {text!r}")

    msgs = [
        {"role": "system", "content": "You are a coding agent with tools."},
        {"role": "user", "content": "List the files."},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, seed=3,
        extra_body={"ignore_eos": True},
    )
    check(r.object == "chat.completion", f"chat object {r.object}")
    check(r.choices[0].message.role == "assistant", "assistant role")
    content = r.choices[0].message.content
    check(r.usage.completion_tokens == 10, f"chat usage {r.usage}")

    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, seed=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    parts, usage, finish = [], None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    check("".join(parts) == content, f"streamed chat {''.join(parts)!r} != {content!r}")
    check(finish == "length", f"stream finish {finish}")
    check(usage is not None and usage.completion_tokens == 10, f"stream usage {usage}")

    # Sampled requests with a seed are reproducible.
    a = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.9, seed=11)
    b = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.9, seed=11)
    check(a.choices[0].message.content == b.choices[0].message.content, "seeded sampling differs")

    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        check(False, "unknown model accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"unknown model status {e.status_code}")
    try:
        client.completions.create(model="tiny", prompt="x" * 9000, max_tokens=2)
        check(False, "over-long prompt accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"context status {e.status_code}")
        check("context" in str(e), f"context message {e}")

    check_tools(tools_base, key)

    print(f"openai {openai.__version__}: all checks passed")


if __name__ == "__main__":
    main()
