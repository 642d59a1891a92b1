"""llama-router from the official OpenAI Python SDK: chat, streaming, embeddings and tools.

    pip install openai
    make run                                   # in another terminal: the demo models
    python examples/openai_chat.py
    python examples/openai_chat.py --chat qwen2.5-7b-instruct --embed nomic-embed-text-v1.5

The defaults fit ``make run`` (presets/demo.ini). Its tiny random-weight models answer with
gibberish, and a tool call from them is whatever the model happened to produce: this example
shows the shape of each request and prints what comes back; it does not judge the answers.
With a real model and an API key::

    LLAMA_ROUTER_API_KEY=... python examples/openai_chat.py --base-url http://gpu-box:8080/v1 \\
        --chat chat --embed embed
"""

from __future__ import annotations

import argparse
import json
import os

from openai import OpenAI


def chat(client: OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model,  # a model id or alias from GET /v1/models
        messages=[
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three uses of a paperclip."},
        ],
        max_tokens=64,
        temperature=0.7,
    )
    choice = response.choices[0]
    print(f"[chat] {response.model}: {choice.message.content!r}")
    print(f"[chat] finish_reason={choice.finish_reason} usage={response.usage}")


def stream(client: OpenAI, model: str) -> None:
    # Server-sent events, relayed by the router as llama-server writes them.
    events = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=48,
        stream=True,
    )
    print("[stream] ", end="", flush=True)
    for event in events:
        if event.choices and event.choices[0].delta.content:
            print(event.choices[0].delta.content, end="", flush=True)
    print()


def embeddings(client: OpenAI, model: str) -> None:
    # Needs a model whose preset sets `embeddings = true` (and usually `pooling`).
    response = client.embeddings.create(model=model, input=["hello world", "goodbye world"])
    for item in response.data:
        head = ", ".join(f"{x:.4f}" for x in item.embedding[:4])
        print(f"[embeddings] input {item.index}: {len(item.embedding)} dims [{head}, ...]")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


def tools(client: OpenAI, model: str) -> None:
    # llama-server turns `tools` into the model's chat template (`jinja`, on by default) and
    # parses tool calls out of the output. A model trained for tool use answers with a
    # get_weather call; you would run it and send the result back as a "tool" message.
    messages: list[dict[str, object]] = [
        {"role": "user", "content": "What is the weather in Paris?"}]
    response = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL],
        tool_choice="auto", max_tokens=64)
    message = response.choices[0].message
    if not message.tool_calls:
        print(f"[tools] no tool call; the model said {message.content!r}")
        return
    for call in message.tool_calls:
        if call.type == "function":
            print(f"[tools] call {call.id}: {call.function.name}({call.function.arguments})")
    # The round trip: the assistant turn with its calls, then one result per call.
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"city": "Paris", "temperature_c": 18})})
    final = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL],
        max_tokens=64)
    print(f"[tools] after the result: {final.choices[0].message.content!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get(
        "LLAMA_ROUTER_URL", "http://127.0.0.1:8080/v1"))
    parser.add_argument("--chat", default="tiny-chat", help="chat model id or alias")
    parser.add_argument("--embed", default="tiny-embed", help="embedding model id or alias")
    args = parser.parse_args()
    # The router checks keys only when it has some (--api-key / LLAMA_ROUTER_API_KEY*); the SDK
    # insists on one, so any placeholder works otherwise.
    client = OpenAI(base_url=args.base_url,
                    api_key=os.environ.get("LLAMA_ROUTER_API_KEY", "unused"),
                    timeout=300)  # the first request to a model waits for it to load
    print("models:", ", ".join(m.id for m in client.models.list()))
    chat(client, args.chat)
    stream(client, args.chat)
    embeddings(client, args.embed)
    tools(client, args.chat)


if __name__ == "__main__":
    main()
