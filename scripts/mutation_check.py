#!/usr/bin/env python3
"""Mutation check of the reference path: plant small bugs, see which fast test catches each.

Each mutation is a textual replacement in one module (policy, quantization,
reference cache, page manager). The script snapshots the repository into a
throwaway directory under /tmp (never touching the checkout, which others edit
live), checks that the chosen fast tests pass there unmutated, then for each
mutation restores the pristine file, applies the replacement and runs the
mutation's test files with ``pytest -x -q -p no:cacheprovider -m "not slow and
not gpu"`` under a timeout. A mutation is *caught* when a test fails; the first
failing test is reported. A replacement whose text is not found (the module
changed) is reported ``STALE``: update its snippet.

Usage (repository root; one core is enough)::

    OMP_NUM_THREADS=1 python3 scripts/mutation_check.py            # all mutations
    OMP_NUM_THREADS=1 python3 scripts/mutation_check.py -k policy  # ids containing "policy"
    python3 scripts/mutation_check.py --list

Options: ``--tests FILE...`` runs those files for every mutation instead of
its own list (to see whether one test file alone catches them all);
``--source head`` (default) takes the modules from ``git archive HEAD``
and ``tests/`` from the working tree; ``--source worktree`` copies the whole
working tree. ``--json PATH`` writes the results; ``--markdown`` prints the
table for docs/TESTING.md. Exit status 1 when a mutation survives or is stale.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POLICY = "trtllm_diffkv/policy.py"
CACHE = "trtllm_diffkv/cache/reference.py"
QUANT = "trtllm_diffkv/quant.py"
PAGES = "trtllm_diffkv/memory/page_manager.py"

# Fast (not slow-marked) tests, cheapest and most specific first: -x stops at the first failure.
REFERENCE_TESTS = ["tests/oracle/test_oracle_rules.py", "tests/core/test_policy.py", "tests/oracle/test_oracle_cache.py", "tests/core/test_cache.py"]
CACHE_TESTS = ["tests/oracle/test_oracle_cache.py", "tests/core/test_cache.py", "tests/core/test_policy.py"]
QUANT_TESTS = ["tests/core/test_quant.py", "tests/core/test_quant_pages.py", "tests/oracle/test_oracle_cache.py"]
PAGE_TESTS = ["tests/oracle/test_oracle_page_manager.py", "tests/memory/test_page_manager.py"]


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``replacements`` (old, new) applied to ``path``; ``tests`` run in order."""

    id: str
    path: str
    description: str
    replacements: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


def m(id, path, description, replacements, tests):
    return Mutation(id, path, description, tuple(replacements), tuple(tests))


MUTATIONS = [
    # ------------------------------------------------------------------ policy
    m("policy-gqa-merge-order", POLICY, "prompt GQA merge: max per query first, then the sum",
      [("return merge_query_heads(last_query_probs.float().sum(1), num_kv_heads)",
        "return merge_query_heads(last_query_probs.float(), num_kv_heads).sum(1)")], REFERENCE_TESTS),
    m("policy-candidate-never-low", POLICY, "decode: a candidate is never sent to the low tier (kept high)",
      [("    cand = classify(imp_c, alpha_high, alpha_low, float(seq_len))\n",
        "    cand = classify(imp_c, alpha_high, alpha_low, float(seq_len))\n"
        "    cand = torch.where(cand == TIER_LOW, torch.full_like(cand, TIER_HIGH), cand)\n")], REFERENCE_TESTS),
    m("policy-victim-never-retiered", POLICY, "decode: the victim keeps its tier whatever its importance",
      [("victim_tier = torch.where(heads, new, victim_tier)",
        "victim_tier = torch.where(heads, torch.full_like(new, joined), victim_tier)")], REFERENCE_TESTS),
    m("policy-victim-excludes-candidate", POLICY, "decode: the victim search skips the candidate",
      [("masked = torch.where(after == joined, importance,", "masked = torch.where(tiers == joined, importance,")],
      REFERENCE_TESTS),
    m("policy-victim-most-important", POLICY, "decode: the most important token is re-checked, not the least",
      [("        pos = masked.argmin(-1)\n",
        "        pos = torch.where(masked.isinf(), -masked, masked).argmax(-1)\n")], REFERENCE_TESTS),
    m("policy-prompt-window-off-by-one", POLICY, "prompt: recent window one token short",
      [("tier[:, max(prompt_len - recent_window_tokens, 0):] = TIER_HIGH",
        "tier[:, max(prompt_len - recent_window_tokens + 1, 0):] = TIER_HIGH")], REFERENCE_TESTS),
    m("policy-decode-window-off-by-one", POLICY, "decode: the candidate is one position too old",
      [("return pos - max(recent_window_tokens, 1)", "return pos - max(recent_window_tokens, 1) - 1")],
      REFERENCE_TESTS),
    m("policy-counts-unclamped", POLICY, "query counts: prompt tokens counted by every later prompt query (S ignored)",
      [("(prompt_len - p).clamp(max=prompt_score_window_tokens)", "(prompt_len - p)")], REFERENCE_TESTS),
    m("policy-prompt-threshold-position", POLICY, "prompt: alpha/(p+1) used under the prompt_len base",
      [("        length = float(prompt_len)\n", "        length = (positions + 1).float()\n")], REFERENCE_TESTS),
    m("policy-high-threshold-inclusive", POLICY, "classify: high tier for importance >= alpha_high/N (not >)",
      [("high = importance > alpha_high / length", "high = importance >= alpha_high / length")], REFERENCE_TESTS),
    m("policy-low-threshold-strict", POLICY, "classify: low tier needs importance > alpha_low/N (not >=)",
      [("low = importance >= alpha_low / length", "low = importance > alpha_low / length")], REFERENCE_TESTS),
    # --------------------------------------------------------- reference cache
    m("cache-prefill-no-causal-mask", CACHE, "prefill attention without the causal mask",
      [("vh.repeat_interleave(group, 0), is_causal=True)", "vh.repeat_interleave(group, 0), is_causal=False)")],
      CACHE_TESTS),
    m("cache-prefill-wrong-kv-head", CACHE, "prefill: query heads of a group mapped to the wrong KV head",
      [("qh, kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0), is_causal=True)",
        "qh, kh.repeat(group, 1, 1), vh.repeat(group, 1, 1), is_causal=True)")], CACHE_TESTS),
    m("cache-decode-wrong-kv-head", CACHE, "decode attention: query heads of a group mapped to the wrong KV head",
      [("qg = q.float().reshape(keys.shape[0], group, head_dim)",
        "qg = q.float().reshape(group, keys.shape[0], head_dim).transpose(0, 1)")], CACHE_TESTS),
    m("cache-scores-wrong-kv-head", CACHE, "prompt scoring: query heads mapped to the wrong KV head",
      [("logits = q @ k.repeat_interleave(group, 0).transpose(1, 2)", "logits = q @ k.repeat(group, 1, 1).transpose(1, 2)")],
      CACHE_TESTS),
    m("cache-n-pos-plus-one", CACHE, "decode: thresholds alpha/N with N = pos + 1",
      [("decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, pos,",
        "decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, pos + 1,")], CACHE_TESTS),
    m("cache-n-prompt-len", CACHE, "decode: thresholds alpha/N with N = prompt_len",
      [("decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, pos,",
        "decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, self.prompt_len,")],
      CACHE_TESTS),
    m("cache-counts-include-current-step", CACHE, "decode: query counts include the step's own query",
      [("counts = policy.query_counts(positions, self.prompt_len, pos, cfg.prompt_score_window_tokens)",
        "counts = policy.query_counts(positions, self.prompt_len, pos + 1, cfg.prompt_score_window_tokens)")],
      CACHE_TESTS),
    m("cache-values-with-key-format", CACHE, "values quantized with the keys' bits and groups",
      [("return fake_quantize(v, tier.value_bits, tier.value_groups,", "return fake_quantize(v, tier.key_bits, tier.key_groups,")],
      CACHE_TESTS),
    m("cache-scores-not-accumulated", CACHE, "decode: probabilities never added to the scores",
      [("self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)",
        "self.scores[layer_idx, :, :seq_len] += 0 * policy.merge_query_heads(probs, self.num_kv_heads)")], CACHE_TESTS),
    m("cache-scores-overwritten", CACHE, "decode: scores overwritten by the step's probabilities",
      [("self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)",
        "self.scores[layer_idx, :, :seq_len] = policy.merge_query_heads(probs, self.num_kv_heads)")], CACHE_TESTS),
    m("cache-candidate-never-low", CACHE, "decode: a candidate classified low is left high",
      [("        for tier in (TIER_LOW, TIER_PRUNED):\n            sel = decision.candidate_tier == tier\n",
        "        for tier in (TIER_PRUNED,):\n            sel = decision.candidate_tier == tier\n")], CACHE_TESTS),
    m("cache-victim-never-retiered", CACHE, "decode: the victim's decision is never applied",
      [("has_victim = decision.victim_pos >= 0", "has_victim = decision.victim_pos < -1")], CACHE_TESTS),
    m("cache-demotion-at-high-format", CACHE, "a demoted token is re-quantized at the high tier's format",
      [("fmt = self.config.high if tier == TIER_HIGH else self.config.low", "fmt = self.config.high")], CACHE_TESTS),
    m("cache-decide-after-attention", CACHE, "decode in the old order: attend, accumulate, then decide (N = pos + 1)",
      [("            self._compact(layer_idx, pos)  # decide from the scores through the previous step\n", ""),
       ("            self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)\n",
        "            self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)\n"
        "            self._compact(layer_idx, seq_len)\n")], CACHE_TESTS),
    m("cache-key-offset-not-restored", CACHE, "centred keys: the channel offset is not added back",
      [("        return q + offset\n", "        return q\n")], CACHE_TESTS),
    m("cache-prompt-score-window-ignored", CACHE, "prompt: every query scores (S ignored)",
      [("num_scoring = min(cfg.prompt_score_window_tokens, n)", "num_scoring = n")], CACHE_TESTS),
    m("cache-pruned-attended", CACHE, "decode: pruned tokens still attended",
      [("kept = self.tiers[layer_idx, :, :seq_len] != TIER_PRUNED", "kept = self.tiers[layer_idx, :, :seq_len] >= 0")],
      CACHE_TESTS),
    m("cache-stats-low-at-high-bytes", CACHE, "memory accounting: low tokens counted at the high format's bytes",
      [('low * self.config.token_bytes("low", self.head_dim)', 'low * self.config.token_bytes("high", self.head_dim)')],
      CACHE_TESTS),
    m("cache-stats-fp16-counts-query-heads", CACHE, "memory accounting: FP16 bytes counted per query head",
      [("fp16_bytes = tiers.numel() * 2 * self.head_dim * 2",
        "fp16_bytes = tiers.numel() * (self.num_heads // self.num_kv_heads) * 2 * self.head_dim * 2")], CACHE_TESTS),
    # -------------------------------------------------------------------- quant
    m("quant-round-to-floor", QUANT, "rounding replaced by flooring",
      [("codes = torch.round(", "codes = torch.floor(")], QUANT_TESTS),
    m("quant-2bit-field-order-swapped", QUANT, "2-bit fields in reverse order in both pack and unpack",
      [("    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits\n",
        "    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits\n"
        "    shifts = shifts.flip(0) if bits == 2 else shifts\n"),
       ("    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits\n",
        "    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits\n"
        "    shifts = shifts.flip(0) if bits == 2 else shifts\n")], QUANT_TESTS),
    m("quant-4bit-nibbles-swapped", QUANT, "4-bit nibbles in reverse order in both pack and unpack",
      [("    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits\n",
        "    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits\n"
        "    shifts = shifts.flip(0) if bits == 4 else shifts\n"),
       ("    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits\n",
        "    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits\n"
        "    shifts = shifts.flip(0) if bits == 4 else shifts\n")], QUANT_TESTS),
    m("quant-zero-not-fp16", QUANT, "codes computed against the fp32 minimum, not the stored fp16 zero",
      [("codes = torch.round((xg - zero.float().unsqueeze(-1))", "codes = torch.round((xg - lo.unsqueeze(-1))")],
      QUANT_TESTS),
    m("quant-no-scale-epsilon", QUANT, "constant rows get scale 0 (no epsilon clamp)",
      [(".clamp_min(SCALE_EPSILON).to(torch.float16)", ".to(torch.float16)")], QUANT_TESTS),
    m("quant-no-saturation", QUANT, "codes not clamped to [0, 2**bits - 1]",
      [(".clamp_(0, qmax)", "")], QUANT_TESTS),
    m("quant-scale-one-level-short", QUANT, "scale divides the range by 2**bits instead of 2**bits - 1",
      [("scale = ((hi - lo) / qmax)", "scale = ((hi - lo) / (qmax + 1))")], QUANT_TESTS),
    # ------------------------------------------------------------- page manager
    m("pages-take-wraps-early", PAGES, "ring: allocation wraps one slot early",
      [("idx = (self.ring_start + torch.arange(count)) % self.num_pages",
        "idx = (self.ring_start + torch.arange(count)) % max(self.num_pages - 1, 1)")], PAGE_TESTS),
    m("pages-give-off-by-one", PAGES, "ring: reclaimed ids written one slot past the end",
      [("idx = (self.ring_end + torch.arange(ids.numel())) % self.num_pages",
        "idx = (self.ring_end + 1 + torch.arange(ids.numel())) % self.num_pages")], PAGE_TESTS),
    m("pages-release-drops-low", PAGES, "release returns only the high pages",
      [("self._give(torch.gather(tile, 1, order)[pos < nh + nl])", "self._give(torch.gather(tile, 1, order)[pos < nh])")],
      PAGE_TESTS),
    m("pages-decode-ignores-low-delta", PAGES, "append_decode ignores the low-tier delta",
      [("new_tokens = tokens + torch.stack([dh.flatten(), dl.flatten()], 1)",
        "new_tokens = tokens + torch.stack([dh.flatten(), 0 * dl.flatten()], 1)")], PAGE_TESTS),
    m("pages-commit-keeps-surplus", PAGES, "commit_prompt never returns the surplus reservation",
      [("self._give(tile[(pos >= kh[:, None]) & (pos < (reserved - kl)[:, None])])",
        "self._give(tile[(pos >= kh[:, None]) & (pos < (reserved - kl)[:, None]) & (pos < 0)])")], PAGE_TESTS),
    m("pages-decode-low-slot-off-by-one", PAGES, "a new low page is written one column too far left",
      [("self.page_table[rows[lo], self.max_pages_per_row - 1 - pages[lo, 1]]",
        "self.page_table[rows[lo], self.max_pages_per_row - 2 - pages[lo, 1]]")],
      PAGE_TESTS),
    m("pages-low-capacity-as-high", PAGES, "decode sizes low pages with the high tier's tokens per page",
      [("capacity = pages * torch.tensor([self.high_tokens_per_page, self.low_tokens_per_page])\n        need",
        "capacity = pages * torch.tensor([self.high_tokens_per_page, self.high_tokens_per_page])\n        need")],
      PAGE_TESTS),
]


def snapshot(source: str) -> str:
    """A throwaway copy of the repository under /tmp; returns its path."""
    dest = tempfile.mkdtemp(prefix="diffkv-mutation-")
    repo = os.path.join(dest, "repo")
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info", "build", "dist")
    if source == "worktree":
        shutil.copytree(ROOT, repo, ignore=ignore)
        return repo
    os.makedirs(repo)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", repo], input=archive, check=True)
    shutil.rmtree(os.path.join(repo, "tests"))
    shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(repo, "tests"), ignore=ignore)
    return repo


def run_tests(repo: str, tests, timeout_s: int) -> tuple[str, str, float]:
    """Run ``tests`` in ``repo``: ``("pass" | "fail" | "timeout" | "error", first failing test or note, seconds)``."""
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONDONTWRITEBYTECODE="1", DIFFKV_PAGE_FUZZ_OPS=os.environ.get("DIFFKV_PAGE_FUZZ_OPS", "3000"))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
           "-o", "addopts=", *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result in {timeout_s} s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "pass", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if failed:
        return "fail", failed[0], seconds
    return "error", (out.strip().splitlines() or ["?"])[-1][:200], seconds


def check_imports_copy(repo: str) -> None:
    """Make sure the copy's package, not the editable install of the checkout, is what the tests import."""
    env = dict(os.environ, PYTHONPATH=repo)
    path = subprocess.run([sys.executable, "-c", "import trtllm_diffkv; print(trtllm_diffkv.__file__)"],
                          cwd=repo, env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not path.startswith(repo):
        raise SystemExit(f"the copy imports {path}, not its own package under {repo}")


def apply(repo: str, mutation: Mutation, pristine: dict[str, str]) -> bool:
    """Write the mutated file; False when a replacement's text is not found exactly once."""
    text = pristine[mutation.path]
    for old, new in mutation.replacements:
        if text.count(old) != 1:
            return False
        text = text.replace(old, new)
    with open(os.path.join(repo, mutation.path), "w") as f:
        f.write(text)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="run only mutations whose id contains this")
    parser.add_argument("--source", choices=["head", "worktree"], default="head")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mutation")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--keep", action="store_true", help="keep the /tmp copy")
    parser.add_argument("--tests", nargs="+", help="run these test files for every mutation instead of its own list")
    args = parser.parse_args()
    chosen = [mu for mu in MUTATIONS if args.k in mu.id]
    if args.tests:
        chosen = [Mutation(mu.id, mu.path, mu.description, mu.replacements, tuple(args.tests)) for mu in chosen]
    if args.list:
        for mu in chosen:
            print(f"{mu.id:40s} {mu.path:38s} {mu.description}")
        return 0
    repo = snapshot(args.source)
    check_imports_copy(repo)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"copy: {repo} (source {args.source}, HEAD {commit})", flush=True)
    paths = sorted({mu.path for mu in chosen})
    pristine = {p: open(os.path.join(repo, p)).read() for p in paths}
    all_tests = sorted({t for mu in chosen for t in mu.tests})
    status, note, seconds = run_tests(repo, all_tests, args.timeout * 3)
    print(f"baseline ({' '.join(all_tests)}): {status} {note} in {seconds:.0f} s", flush=True)
    if status != "pass":
        print("the unmutated copy must pass its tests first", file=sys.stderr)
        return 2
    results = []
    for mu in chosen:
        if not apply(repo, mu, pristine):
            result = dict(id=mu.id, path=mu.path, description=mu.description, outcome="STALE", test="", seconds=0.0)
        else:
            status, note, seconds = run_tests(repo, mu.tests, args.timeout)
            outcome = {"fail": "caught", "pass": "SURVIVED"}.get(status, status)
            result = dict(id=mu.id, path=mu.path, description=mu.description, outcome=outcome, test=note,
                          seconds=round(seconds, 1))
        with open(os.path.join(repo, mu.path), "w") as f:
            f.write(pristine[mu.path])
        results.append(result)
        print(f"{result['outcome']:8s} {mu.id:40s} {result['test']} ({result['seconds']} s)", flush=True)
    summary = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                   source=args.source, results=results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.markdown:
        print("\n| mutation | file | planted bug | outcome | first failing test | s |\n|---|---|---|---|---|---|")
        for r in results:
            print(f"| `{r['id']}` | `{r['path'].split('/')[-1]}` | {r['description']} | {r['outcome']} | "
                  f"`{r['test']}` | {r['seconds']} |")
    if not args.keep:
        shutil.rmtree(os.path.dirname(repo), ignore_errors=True)
    bad = [r for r in results if r["outcome"] != "caught"]
    print(f"\n{len(results) - len(bad)} of {len(results)} mutations caught", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
