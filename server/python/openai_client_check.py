"""Drives a running `sparsekit serve` with the official `openai` Python client.

Usage: python3 openai_client_check.py http://127.0.0.1:PORT

Checks, streaming and not: models.list, completions, chat completions (with usage in the
stream), that a stream and a non-stream greedy request give the same text, and that bad
requests raise the client's typed errors (NotFoundError, BadRequestError). Exits non-zero
with a message on the first failure; prints one summary line on success.
"""

import sys

import openai
from openai import OpenAI


def check(cond, msg):
    if not cond:
        print(f"FAIL: {msg}", file=sys.stderr)
        sys.exit(1)


def main():
    base = sys.argv[1].rstrip("/")
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

    models = client.models.list()
    ids = [m.id for m in models.data]
    check(ids == ["tiny"], f"models.list: {ids}")

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

    print(f"openai {openai.__version__}: all checks passed")


if __name__ == "__main__":
    main()
