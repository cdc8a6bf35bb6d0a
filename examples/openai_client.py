"""Talk to exod with the official `openai` package: list models, ask, stream.

Start a daemon first (``make run``), then::

    python examples/openai_client.py [--url http://127.0.0.1:8420] [--model gguf/smollm2-135m-instruct-q4_1]

``make run`` serves SmolLM2-135M-Instruct, a real (small) instruct model: on a laptop's CPU, a few words a second.
"""

from __future__ import annotations

import argparse
import os
import sys

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8420")
    parser.add_argument("--model", default="gguf/smollm2-135m-instruct-q4_1")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=os.environ.get("EXOD_API_KEY", "unused"), max_retries=0)
    print("models:", [m.id for m in client.models.list().data])

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=args.model, messages=messages, max_tokens=16, temperature=0)
    print("reply:", repr(reply.choices[0].message.content), f"({reply.usage.completion_tokens} tokens)")

    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(repr(chunk.choices[0].delta.content), end=" ", flush=True)
    print()


if __name__ == "__main__":
    try:
        main()
    except openai.APIConnectionError:
        sys.exit("no exod daemon answers there: start one with `make run` (or pass --url)")
    except openai.APIStatusError as exc:
        sys.exit(f"exod answered {exc.status_code}: {exc.message}")
