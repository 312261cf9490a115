"""Recompute an lm-eval ``--log_samples`` file's loglikelihoods with Hugging Face transformers (an independent
reference for the server's echo log-probabilities) and compare.

Usage::

    python examples/lm_eval/check_with_transformers.py SAMPLES.jsonl --model /path/to/hf_checkpoint

For each request, the context and continuation are tokenized as lm-eval's ``local-completions`` does
(``tokenizer(context + continuation)``, the continuation being the ids past ``tokenizer(context)``), run
through ``AutoModelForCausalLM`` in float32 (a document's choices in one batch) and summed with
``torch.log_softmax``. Prints the largest
absolute difference to lm-eval's recorded loglikelihood and both accuracies.
"""
import argparse
import json

import torch


def loglikelihoods(model, tokenizer, pairs: list[tuple[str, str]]) -> list[float]:
    """Per ``(context, continuation)``: the sum of ``log p(continuation token | everything before)`` under
    ``model`` (one batched float32 forward, right-padded: causal attention keeps each row's positions exact)."""
    wholes = [tokenizer(c + x)["input_ids"] for c, x in pairs]
    starts = [len(tokenizer(c)["input_ids"]) for c, _ in pairs]
    width = max(len(w) for w in wholes)
    ids = torch.tensor([w + [0] * (width - len(w)) for w in wholes])
    mask = torch.tensor([[1] * len(w) + [0] * (width - len(w)) for w in wholes])
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), dim=-1)
    return [float(sum(logp[r, i - 1, w[i]] for i in range(s, len(w)))) for r, (w, s) in enumerate(zip(wholes, starts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("samples", help="lm-eval's samples_<task>_<time>.jsonl (--log_samples)")
    parser.add_argument("--model", required=True, help="the Hugging Face checkpoint folder the server ran")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    worst, right_server, right_ref, docs = 0.0, 0, 0, 0
    for line in open(args.samples):
        sample = json.loads(line)
        requests = [sample["arguments"][key] for key in sorted(sample["arguments"], key=lambda k: int(k.split("_")[-1]))]
        served = [float(r[0][0]) for r in sample["resps"]]
        ref = loglikelihoods(model, tokenizer, [(r["arg_0"], r["arg_1"]) for r in requests])
        worst = max(worst, max(abs(a - b) for a, b in zip(served, ref)))
        target = int(sample["target"])
        right_server += served.index(max(served)) == target
        right_ref += ref.index(max(ref)) == target
        docs += 1
    print(f"{docs} docs: max |server - transformers| loglikelihood = {worst:.2e}; "
          f"acc server {right_server / docs:.3f}, transformers {right_ref / docs:.3f}")


if __name__ == "__main__":
    main()
