"""Query ``trtllm-diffkv serve`` with the ``openai`` package: a completion, a streamed chat, the metrics.

Start the server first (default model, port 8000)::

    trtllm-diffkv serve --port 8000

then ``python3 examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]``.
"""
import argparse

import httpx
import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    print(f"server {args.base_url}, model {model!r}", flush=True)
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                           temperature=0)
    print("completion:", repr(completion.choices[0].text), completion.usage, flush=True)
    print("chat (streamed): ", end="", flush=True)
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a planet."}],
                                                max_tokens=32, temperature=0, stream=True):
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print(flush=True)
    metrics = httpx.get(args.base_url.removesuffix("/v1") + "/metrics").text
    print("\n".join(line for line in metrics.splitlines() if line.startswith("trtllm_diffkv_kv")), flush=True)


if __name__ == "__main__":
    main()
