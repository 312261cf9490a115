"""The LLM API in four calls: a batch, a stream, concurrent asyncio requests, an abort.

    python3 examples/llm_api.py                       # the default model (SmolLM2-135M-Instruct), CPU or GPU
    python3 examples/llm_api.py --model /path/to/hf_folder --kv-config fp16 --max-tokens 64

Mirrors TensorRT-LLM's examples/llm-api scripts (``from tensorrt_llm import LLM, SamplingParams``);
here the KV cache is DiffKV-compressed and in-flight batched.
"""
import argparse
import asyncio
import time

from trtllm_diffkv import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "Explain in one sentence why the sky is blue."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder, .gguf or engine dir (default: the default model)")
    parser.add_argument("--kv-config", default="default", help="DiffKV preset (default: default)")
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per request (default: 24)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    args = parser.parse_args()

    print(f"[setup] loading {args.model or 'the default model'} (preset {args.kv_config}) ...", flush=True)
    start = time.perf_counter()
    with LLM(args.model, args.kv_config, device=args.device) as llm:
        print(f"[setup] ready in {time.perf_counter() - start:.1f} s", flush=True)
        # 1. a batch, in-flight batched; outputs in the prompts' order
        print(f"[batch] {len(PROMPTS)} prompts, {args.max_tokens} new tokens each ...", flush=True)
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        for out in llm.generate(PROMPTS, greedy, chat_template=True):
            if out.error:  # a bad request fails alone: report it and go on
                print(f"[batch] {out.prompt!r} -> error: {out.error}", flush=True)
                continue
            print(f"[batch] {out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason}, "
                  f"KV {out.metrics['kv_memory_fraction']:.1%} of FP16)", flush=True)

        # 2. streaming: text_diff holds what is new; the diffs concatenate to the final text
        print("[stream] ", end="", flush=True)
        sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=0)
        for out in llm.generate_stream("Write a haiku about memory.", sampled, chat_template=True):
            print(out.outputs[0].text_diff, end="", flush=True)
        print()

        # 3. asyncio: many concurrent requests on one LLM (what an HTTP server does)
        async def ask(prompt: str) -> str:
            out = await llm.generate_async(prompt, greedy, chat_template=True)
            return out.outputs[0].text

        print(f"[async] {len(PROMPTS)} concurrent requests ...", flush=True)
        for prompt, text in zip(PROMPTS, asyncio.run(_gather(ask, PROMPTS))):
            print(f"[async] {prompt!r} -> {text!r}", flush=True)

        # 4. abort: the request ends with finish_reason "cancelled" and its pages go back to the pool
        request = llm.generate_async("Count from one to one thousand.", SamplingParams(max_tokens=1000),
                                     streaming=True, chat_template=True)
        next(request)
        request.abort()
        final = request.result()
        print(f"[abort] {final.outputs[0].finish_reason} after {final.outputs[0].length} tokens; "
              f"pool pages free: {llm.stats()['free_pages']} / {llm.stats()['pool_pages']}", flush=True)


async def _gather(ask, prompts):
    return await asyncio.gather(*(ask(p) for p in prompts))


if __name__ == "__main__":
    main()
