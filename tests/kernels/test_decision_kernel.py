"""The Triton decision kernel equals ``paged.decisions.decide`` bit for bit; the padded decode plan equals the
unpadded one (Triton interpreter, tiny shapes; CI, no GPU).

1. Random tier states (random bytes everywhere, then rows of distinct positions with scores drawn from a
   few levels around the thresholds so that importances tie, plus NaN and inf scores, empty tiers, a
   candidate absent from the high tier, positions before the first candidate) for every compressing
   preset of ``config.PRESETS``; the kernel's five action tensors must equal the reference's exactly,
   with loop blocks of 128 and of 8 tokens (ties across loop iterations); with ``compress=False`` it equals
   ``decisions.append_only`` (the fp16 preset); with a sliding-window layer, ``decisions.slide_windows`` of
   either (both presets).
2. A full paged cache run on the kernel path (decisions in the kernel) in lockstep with the reference
   cache (``DiffKVReferenceCache``, the independent dense implementation): kept positions, tiers, counts,
   pages, K/V, scores and attention outputs every step, for a preset that prunes and one with a low tier.
3. The same requests planned with ``pad_to`` (a bucket larger than the batch) and without, fed the same
   q/k/v (the padded cache gets extra NaN rows): every layer's attention outputs of the real rows, the pool
   bytes and the page manager's state are identical every step, the padding rows give zeros and raise no
   error flag, while the batch changes (a request finishes, two prompts arrive). The padded cache has plan
   graphs switched on (as ``DecodeGraphRunner`` does on the GPU) with a CPU stand-in for the capture that
   replays ``decode.plan_device`` on the captured arguments: the first plan of each request count runs
   eagerly, the next ones replay.

4. Both kernels compile for sm_90 without a GPU (Triton's AOT compiler), and the decisions divide with
   IEEE rounding (``div.rn``), as the bit-exactness on the GPU needs.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so checks 1-3 run this file as a script
in a fresh interpreter process; check 4 compiles in a process without it.
"""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tie_score(alpha: float, n: int, position: int, prompt_len: int, pos: int, scoring_tokens: int) -> float | None:
    """A score whose importance (score / its query count, an fp32 division) is exactly the fp32 threshold
    ``alpha / n`` (divided in float64, rounded once: numpy here), or ``None`` when no such score exists for this
    count. The count is the rule of ``oracle/rules.py``: the prompt's last ``S`` queries, then every decode query."""
    import numpy as np

    count = (min(prompt_len - position, scoring_tokens) if position < prompt_len else 0) + \
        max(pos - max(position, prompt_len), 0)
    count = np.float32(max(count, 1))
    threshold = np.float32(alpha / n)
    score = np.float32(threshold * count)
    return float(score) if np.float32(score / count) == threshold else None


def random_state(cfg, seed, num_seqs=6, num_layers=2, num_kv_heads=3, head_dim=64, max_pos=40, num_pages=600,
                 ties=None):
    """A pool and page-manager state with random tiers: (pool, fmt, table, tokens, slots, pos, prompt_len_by_slot).

    ``ties``: a list: every finite score that can be puts its token's importance exactly on ``alpha_high / N`` or
    ``alpha_low / N`` (:func:`tie_score`), where a threshold divided in fp32 could fall one ulp off; each such
    ``(alpha, N)`` is appended to the list."""
    from trtllm_diffkv.memory import KVCachePool, PageFormat

    g = torch.Generator().manual_seed(seed)
    fmt = PageFormat.for_config(cfg, head_dim, high_tokens_per_page=4)
    pool = KVCachePool(fmt, num_pages, device="cpu")
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=g, dtype=torch.uint8))  # stale garbage
    G, max_slots = num_layers * num_kv_heads, num_seqs + 2
    R = -(-max_pos // fmt.min_tokens_per_page) + 1
    table = torch.full((max_slots * G, R), -1, dtype=torch.int32)
    tokens = torch.zeros(max_slots * G, 2, dtype=torch.int32)
    free = torch.randperm(num_pages, generator=g).tolist()
    slots = torch.randperm(max_slots, generator=g)[:num_seqs]
    pos = torch.randint(1, max_pos, (num_seqs,), generator=g)
    pos[0] = 1  # before any candidate for W >= 2
    prompt_len = torch.zeros(max_slots, dtype=torch.int64)
    W = max(cfg.recent_window_tokens, 1)
    for b in range(num_seqs):
        slot, p = int(slots[b]), int(pos[b])
        prompt_len[slot] = int(torch.randint(1, p + 1, (1,), generator=g))
        thr = max(cfg.alpha_high, cfg.alpha_low, 0.01) / p
        for r in range(slot * G, (slot + 1) * G):
            kind = int(torch.randint(0, 6, (1,), generator=g))
            perm = torch.randperm(p, generator=g)
            n_keep = int(torch.randint(0, p + 1, (1,), generator=g))
            kept = perm[:n_keep]
            cand = p - W
            if kind < 3 and cand >= 0 and cand not in kept.tolist() and n_keep < p:
                kept = torch.cat([kept, torch.tensor([cand])])  # the usual case: the candidate is in the high tier
            n_high = int(torch.randint(0, kept.numel() + 1, (1,), generator=g)) if kind != 4 else kept.numel()
            if kind < 3 and cand in kept.tolist():  # keep the candidate among the high tokens
                kept = torch.cat([kept[kept == cand], kept[kept != cand]])
                n_high = max(n_high, 1)
            high, low = kept[:n_high], kept[n_high:]
            if kind == 5:
                high, low = low, high  # the candidate (if any) lands in the low tier: absent from the high tier
            for t, (tier, toks) in enumerate((("high", high), ("low", low))):
                lay = fmt.tier(tier)
                for j, position in enumerate(toks.tolist()):
                    col = j // lay.tokens_per_page
                    col = col if tier == "high" else R - 1 - col
                    if table[r, col] < 0:
                        table[r, col] = free.pop()
                    page, s = int(table[r, col]), j % lay.tokens_per_page
                    level = [0.0, 0.25, 0.5, 1.0, 1.0, 1.0, 2.0, 4.0][int(torch.randint(0, 8, (1,), generator=g))]
                    count = 1 + int(torch.randint(0, 3, (1,), generator=g))
                    score = level * thr * count
                    u = float(torch.rand(1, generator=g))
                    if u < 0.03:
                        score = float("nan")
                    elif u < 0.05:
                        score = float("inf")
                    elif u < 0.3:
                        score = float(torch.rand(1, generator=g)) * 3 * thr
                    if ties is not None and score == score and score != float("inf"):
                        alpha = (cfg.alpha_high, cfg.alpha_low)[int(torch.randint(0, 2, (1,), generator=g))]
                        tied = tie_score(alpha, max(p, 1), position, int(prompt_len[slot]), p,
                                         cfg.prompt_score_window_tokens)
                        if tied is not None:
                            score = tied
                            ties.append((alpha, max(p, 1)))
                    pool.segment(tier, "position")[page, s] = position
                    pool.segment(tier, "score")[page, s] = score
                tokens[r, t] = toks.numel()
    return pool, fmt, table, tokens, slots.to(torch.int64), pos.to(torch.int64), prompt_len


def _decide_both(cfg, state, **kernel_kwargs):
    """(kernel actions, ``decisions.decide`` actions) of one random state, every row of its slots."""
    from trtllm_diffkv.kernels.decision_kernel import alpha_tensor, decide_rows
    from trtllm_diffkv.paged import decisions

    pool, fmt, table, tokens, slots, pos, prompt_len = state
    G = 6
    rows = (slots[:, None] * G + torch.arange(G)).reshape(-1)
    want = decisions.decide(pool, table, tokens, rows, pos.repeat_interleave(G), prompt_len[slots].repeat_interleave(G),
                            alpha_high=cfg.alpha_high, alpha_low=cfg.alpha_low,
                            recent_window_tokens=cfg.recent_window_tokens,
                            prompt_score_window_tokens=cfg.prompt_score_window_tokens, max_pos=int(pos.max()))
    got = decide_rows(pool.pages(), fmt, table, tokens, slots, pos, prompt_len,
                      alpha_tensor(cfg.alpha_high, cfg.alpha_low, "cpu"), rows_per_slot=G,
                      recent_window_tokens=cfg.recent_window_tokens,
                      prompt_score_window_tokens=cfg.prompt_score_window_tokens, **kernel_kwargs)
    return got, (want.high_delta, want.low_delta, want.new_index, want.move_from, want.move_to)


def check_threshold_ties(seeds=(0, 1, 2)) -> int:
    """Importances exactly on ``alpha / N`` (alphas 1.5 and 0.3: for most N their quotient divided in fp32 is one
    ulp off the fp64 one): the kernel (fp64 thresholds) and the torch decisions agree bit for bit, so a CPU and a
    GPU run tier such a token alike. Returns the tied scores placed (the test fails if there are none)."""
    from trtllm_diffkv.config import DiffKVConfig

    cfg = DiffKVConfig(recent_window_tokens=2, prompt_score_window_tokens=4, alpha_high=1.5, alpha_low=0.3)
    ties = []
    for seed in seeds:
        got, want = _decide_both(cfg, random_state(cfg, 700 + seed, ties=ties))
        for name, a, b in zip(("high_delta", "low_delta", "new_index", "move_from", "move_to"), got, want):
            assert torch.equal(a, b), f"threshold ties, seed {seed}: {name} differs at rows " \
                f"{torch.nonzero(a != b).flatten().tolist()}"
    off = [(a, n) for a, n in ties if float(torch.tensor(a, dtype=torch.float32) / torch.tensor(float(n))) !=
           float(torch.tensor(a / n, dtype=torch.float32))]
    assert len(off) > 10, "the ties must include thresholds that an fp32 division puts one ulp off"
    return len(ties)


def check_kernel_equals_reference(seeds=(0, 1)) -> int:
    """Kernel actions == ``decisions.decide`` for every tiered preset; returns the rows compared."""
    from trtllm_diffkv.config import PRESETS, DiffKVConfig
    from trtllm_diffkv.kernels.decision_kernel import alpha_tensor, decide_rows
    from trtllm_diffkv.paged import decisions

    # every compressing preset's thresholds and formats, once each (the decisions never read the key rotation or
    # the name: presets equal but for those are one case); windows shrunk to the tiny shapes (the rules are the same)
    configs = []
    for c in PRESETS.values():
        c = c.replace(recent_window_tokens=min(c.recent_window_tokens, 3),
                      prompt_score_window_tokens=min(c.prompt_score_window_tokens, 5), key_rotation="none")
        if c.tiered and all(c.replace(name=o.name) != o for o in configs):  # uniform presets decide nothing
            configs.append(c)
    configs.append(DiffKVConfig(recent_window_tokens=0, prompt_score_window_tokens=3, alpha_high=1.0, alpha_low=0.3))
    compared = 0
    for ci, cfg in enumerate(configs):
        moved, kinds = 0, set()  # over the seeds: the states exercise every branch of the decision table
        for seed in seeds:
            pool, fmt, table, tokens, slots, pos, prompt_len = random_state(cfg, 100 * ci + seed)
            G = 6
            rows = (slots[:, None] * G + torch.arange(G)).reshape(-1)
            want = decisions.decide(pool, table, tokens, rows, pos.repeat_interleave(G),
                                    prompt_len[slots].repeat_interleave(G), alpha_high=cfg.alpha_high,
                                    alpha_low=cfg.alpha_low, recent_window_tokens=cfg.recent_window_tokens,
                                    prompt_score_window_tokens=cfg.prompt_score_window_tokens,
                                    max_pos=int(pos.max()))
            # rows per program: one (the default), and 8 rows that span the sequence's 6 rows (2 layers of
            # 3 KV heads) and mask 2 (rows of one program differ in counts and tiers); blocks of 8 tie across loops
            for block, rows_per_program in ((128, 1), (8, 8)):
                got = decide_rows(pool.pages(), fmt, table, tokens, slots, pos, prompt_len,
                                  alpha_tensor(cfg.alpha_high, cfg.alpha_low, "cpu"), rows_per_slot=G,
                                  recent_window_tokens=cfg.recent_window_tokens,
                                  prompt_score_window_tokens=cfg.prompt_score_window_tokens, block_tokens=block,
                                  rows_per_program=rows_per_program)
                for name, a, b in zip(("high_delta", "low_delta", "new_index", "move_from", "move_to"), got,
                                      (want.high_delta, want.low_delta, want.new_index, want.move_from, want.move_to)):
                    assert a.dtype == b.dtype and torch.equal(a, b), (
                        f"{cfg.name} seed {seed} block {block} rows {rows_per_program}: {name} differs at rows "
                        f"{torch.nonzero(a != b).flatten().tolist()}: {a.tolist()} != {b.tolist()}")
            keep = decide_rows(pool.pages(), fmt, table, tokens, slots, pos, prompt_len,
                               alpha_tensor(cfg.alpha_high, cfg.alpha_low, "cpu"), rows_per_slot=G,
                               recent_window_tokens=cfg.recent_window_tokens,
                               prompt_score_window_tokens=cfg.prompt_score_window_tokens, compress=False)
            append = decisions.append_only(rows, tokens)  # the fp16 preset's actions
            for a, b in zip(keep, (append.high_delta, append.low_delta, append.new_index, append.move_from,
                                   append.move_to)):
                assert a.dtype == b.dtype and torch.equal(a, b), f"{cfg.name} seed {seed}: append-only actions differ"
            # a sliding-window layer (layer 0, window 3; layer 1 full): its rows take decisions.slide_windows'
            # actions, the full layer's rows keep theirs, with and without compression
            windows = torch.tensor([3, 0], dtype=torch.int32)
            row_windows = windows.repeat_interleave(3).repeat(slots.numel())
            for compress, base in ((True, want), (False, append)):
                slid = decisions.slide_windows(base, rows, tokens, pos.repeat_interleave(G),
                                               prompt_len[slots].repeat_interleave(G), row_windows)
                got = decide_rows(pool.pages(), fmt, table, tokens, slots, pos, prompt_len,
                                  alpha_tensor(cfg.alpha_high, cfg.alpha_low, "cpu"), rows_per_slot=G,
                                  recent_window_tokens=cfg.recent_window_tokens,
                                  prompt_score_window_tokens=cfg.prompt_score_window_tokens, compress=compress,
                                  layer_windows=windows, num_kv_heads=3)
                for name, a, b in zip(("high_delta", "low_delta", "new_index", "move_from", "move_to"), got,
                                      (slid.high_delta, slid.low_delta, slid.new_index, slid.move_from, slid.move_to)):
                    assert a.dtype == b.dtype and torch.equal(a, b), (
                        f"{cfg.name} seed {seed} windows, compress={compress}: {name} differs at rows "
                        f"{torch.nonzero(a != b).flatten().tolist()}")
            moved += (want.move_from >= 0).sum().item()
            kinds |= {(int(h), int(l), int(f >= 0)) for h, l, f in zip(want.high_delta, want.low_delta, want.move_from)}
            compared += rows.numel()
        if cfg.alpha_low < cfg.alpha_high:
            assert moved > 0 and len(kinds) >= 3, (cfg.name, kinds)
    return compared


def check_full_run() -> None:
    """The cache's kernel path in lockstep with the reference cache."""
    from conftest import random_llama
    from trtllm_diffkv.config import DiffKVConfig, get_preset
    from support.paged import run_lockstep

    model = random_llama(3, vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=64, max_position_embeddings=128)
    prompts = [list(range(3, 14)), list(range(40, 47))]
    kv = DiffKVConfig(recent_window_tokens=2, prompt_score_window_tokens=4, alpha_high=1.0, alpha_low=0.3)
    report = run_lockstep(model, kv, prompts, 6, num_pages=60, kv_atol=1e-4, out_atol=1e-3, use_triton=True,
                          high_tokens_per_page=4, page_manager="cpu", read_path="torch")
    assert sum(s.low_tokens for s in report.final_stats) > 0 and sum(s.pruned_tokens for s in report.final_stats) > 0
    prune = get_preset("qwen2.5-7b").replace(recent_window_tokens=2, prompt_score_window_tokens=4)
    report = run_lockstep(model, prune, prompts, 4, num_pages=60, kv_atol=1e-4, out_atol=1e-3, use_triton=True,
                          high_tokens_per_page=4, page_manager="cpu", read_path="torch")
    assert sum(s.pruned_tokens for s in report.final_stats) > 0


class _PadTee:
    """Attention backend: the unpadded cache runs the step; the padded cache gets the same q/k/v plus
    ``pad`` NaN rows; every layer's outputs must agree bit for bit and the padding rows give zeros."""

    def __init__(self, plain, padded, pad, where):
        self.plain, self.padded, self.pad, self.where = plain, padded, pad, where

    def forward(self, layer_idx, q, k, v):
        out = self.plain.forward(layer_idx, q, k, v).clone()
        nan = lambda x: torch.cat([x, torch.full((self.pad,) + x.shape[1:], float("nan"), dtype=x.dtype)])  # noqa: E731
        padded = self.padded.forward(layer_idx, nan(q), nan(k), nan(v))
        n = out.shape[0]
        assert torch.equal(out, padded[:n]), f"{self.where}, layer {layer_idx}: padded outputs differ"
        assert torch.equal(padded[n:], torch.zeros_like(padded[n:])), f"{self.where}: padding rows must give zeros"
        return out


class _EagerPlanGraph:
    """Stands in for a captured plan graph on the CPU: ``replay`` runs ``decode.plan_device`` again on the
    captured arguments (the cache's fixed input buffer), as the CUDA graph does (the plumbing check)."""

    def __init__(self, cache, args):
        self.args, self.replays = args, 0

    def replay(self):
        from trtllm_diffkv.paged import decode

        decode.plan_device(*self.args)
        self.replays += 1


def check_padded_plan(page_manager: str = "cpu", read_path: str = "auto") -> None:
    """Plans with ``pad_to`` give the unpadded plan's attention outputs, pool bytes and page-manager state."""
    from conftest import random_llama
    from trtllm_diffkv.config import DiffKVConfig
    from trtllm_diffkv.engine_config import EngineConfig
    from trtllm_diffkv.paged import PagedDiffKVCache

    model = random_llama(5, vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=128)
    kv = DiffKVConfig(recent_window_tokens=2, prompt_score_window_tokens=4, alpha_high=1.0, alpha_low=0.3)
    mc = model.config
    plain, padded = caches = [PagedDiffKVCache(kv, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                               EngineConfig(max_batch_size=4, max_seq_len=40, use_triton=True,
                                                            high_tokens_per_page=4, page_manager=page_manager,
                                                            read_path=read_path), num_pages=120)
                              for _ in range(2)]
    from trtllm_diffkv.paged import decode

    decode.capture_plan_graph = _EagerPlanGraph  # what DecodeGraphRunner switches on, with a CPU stand-in
    padded.capture_plan_graphs = True
    lens, toks = {}, {}

    def prefill(prompts, where):
        slots = sorted(prompts)
        for cache in caches:
            cache.plan(slots, [len(prompts[s]) for s in slots], [0] * len(slots), [True] * len(slots))
        ids = torch.tensor([t for s in slots for t in prompts[s]])
        positions = torch.cat([torch.arange(len(prompts[s])) for s in slots])
        last = torch.tensor([len(prompts[s]) for s in slots]).cumsum(0) - 1
        logits = model(ids, positions, _PadTee(plain, padded, 0, where), logits_indices=last)
        for cache in caches:
            cache.end_step()
        for i, s in enumerate(slots):
            lens[s], toks[s] = len(prompts[s]), int(logits[i].argmax())

    with torch.inference_mode():
        prefill({0: list(range(3, 12)), 2: list(range(20, 26))}, "prefill")
        for step in range(6):
            if step == 2:  # the request in slot 0 finishes; new prompts take slots 1 and 3
                for cache in caches:
                    cache.release([0])
                del lens[0], toks[0]
                prefill({1: [30, 31, 32], 3: [7, 8, 9, 10, 11]}, "second prefill")
            slots = sorted(toks)
            n = len(slots)
            args = (slots, [lens[s] + 1 for s in slots], [lens[s] for s in slots], [False] * n)
            plain.plan(*args)
            padded.plan(*args, pad_to=4)
            tee = _PadTee(plain, padded, 4 - n, f"decode step {step}")
            logits = model(torch.tensor([toks[s] for s in slots]), torch.tensor([lens[s] for s in slots]), tee)
            for cache in caches:
                cache.end_step()
            for i, s in enumerate(slots):
                lens[s], toks[s] = lens[s] + 1, int(logits[i].argmax())
            assert torch.equal(plain.pool.buffer, padded.pool.buffer), f"step {step}: pool bytes differ"
            assert plain.manager.snapshot().diff(padded.manager.snapshot()) == [], f"step {step}: page state differs"
            bufs = padded.decode_buffers[4]
            assert (bufs.row_ids[:, n:] == -1).all() and (bufs.page[:, n:] == -1).all()
    assert sum(plain.request_stats(s).low_tokens for s in lens) > 0  # the steps moved tokens to the low tier
    # first plan of n requests eager (and "captured"), then replays: 2 requests in steps 0-1, 3 in steps 2-5
    assert {k: g.replays for k, g in padded.plan_graphs.items()} == {(2, 4): 1, (3, 4): 3}
    for cache in caches:
        assert cache.step_errors() == {}, "padding rows (NaN keys/values) must not raise error flags"
        cache.release(sorted(lens))
        cache.manager.check_invariants()
        assert cache.manager.free_pages() == 120


def main(which: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

    patch_interpreter_for_numpy_2_4()
    if which == "kernel":
        print("ties", check_threshold_ties())
        print("OK", check_kernel_equals_reference())
    elif which == "run":
        check_full_run()
        print("OK")
    elif which == "padded":
        check_padded_plan()
        print("OK")


def _run(which: str) -> None:
    import subprocess

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, os.path.abspath(__file__), which], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-4000:] + result.stderr[-8000:]


COMPILE_SCRIPT = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trtllm_diffkv.kernels import decision_kernel as dk

I64 = ("slots_ptr", "pos_ptr", "prompt_len_ptr", "new_ptr", "from_ptr", "to_ptr", "rows_out")
types = dict({n: "*i64" for n in I64}, f32_ptr="*fp32", alpha_ptr="*fp64")
cases = [(dk._decide_kernel, dict(H_TOKENS=32, L_TOKENS=52, BLOCK=dk.BLOCK_TOKENS, COMPRESS=c, ROWS=8)) for c in (True, False)]
cases += [(dk._locate_kernel, dict(P_HIGH=32, P_LOW=52, MOVES=m, BLOCK=dk.LOCATE_BLOCK)) for m in (True, False)]
out = {}
for kernel, constexprs in cases:
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*i32" if n.endswith(("_ptr", "_out")) else "i32")
                 for n in kernel.arg_names}
    name = kernel.__name__ + str(sorted(constexprs.items()))
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        out[name] = sorted(set(re.findall(r"(div\\.[a-z0-9.]+|cvt\\.[a-z]+\\.f32\\.f64)", compiled.asm["ptx"])))
    except RuntimeError as exc:
        out[name] = "error: " + str(exc)[:400]
print(json.dumps(out))
"""


def test_decision_kernels_compile_for_sm90_with_ieee_division():
    """Both kernels compile for the H200 (sm_90) without a GPU; the decisions divide with IEEE rounding
    (``div.rn.f32`` for score / count, ``div.rn.f64`` + ``cvt.rn.f32.f64`` for alpha / N), no approximate
    division: what makes the GPU results equal the torch reference's."""
    import json
    import subprocess

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    errors = {k: v for k, v in results.items() if isinstance(v, str)}
    if errors and all("ptxas" in e.lower() for e in errors.values()):
        pytest.skip(f"cannot assemble for sm_90 here: {next(iter(errors.values()))}")
    assert errors == {} and len(results) == 4
    decide = results["_decide_kernel" + str(sorted(dict(BLOCK=128, COMPRESS=True, H_TOKENS=32, L_TOKENS=52, ROWS=8).items()))]
    assert {"div.rn.f32", "div.rn.f64", "cvt.rn.f32.f64"} <= set(decide), decide
    assert not [d for d in decide if d.startswith(("div.full", "div.approx"))], decide


def test_decision_kernel_equals_reference_all_presets():
    _run("kernel")


def test_paged_cache_with_decision_kernel_matches_reference_cache():
    _run("run")


def test_padded_decode_plan_equals_unpadded():
    _run("padded")


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    main(sys.argv[1] if len(sys.argv) > 1 else "kernel")
