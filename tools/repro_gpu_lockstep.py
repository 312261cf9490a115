"""Reproduce the GPU-only lockstep difference (docs/PERFORMANCE.md, paged path; found and fixed: the reference
quantizer divided by a Python int, which torch on CUDA computes as a reciprocal multiplication) at its configuration.

    TRITON_INTERPRET=1 python3 tools/repro_gpu_lockstep.py triton   # whole Triton path, interpreted
    TRITON_INTERPRET=1 python3 tools/repro_gpu_lockstep.py torch    # torch ops, CPU page manager
    python3 tools/repro_gpu_lockstep.py gpu                          # on a CUDA machine
    python3 tools/repro_gpu_lockstep.py gpu-torch-writes   # CUDA, torch write ops + Triton page manager
    python3 tools/repro_gpu_lockstep.py gpu-torch-prefill  # CUDA, Triton write kernels, torch scored prefill
    python3 tools/repro_gpu_lockstep.py dump-writes OUT_DIR  # CUDA: byte-for-byte replay of every pool write

The edge-case-4 configuration of tests/paged/test_paged_gpu.py (peaked tiny Llama, prompt lengths
around both tiers' page capacities), 3 decode steps, torch read path; prints the largest output
difference against the reference cache and where it is.

``dump-writes OUT_DIR [--device cuda|cpu] [--prompts K] [--steps S] [--budget SECONDS] [--no-interp]
[--interp-procs N] [--from-records FILE]`` runs the workload of ``gpu`` (Triton write kernels, Triton page manager, torch read
path) and records, around every launch that writes (or feeds a write to) the pool, the bytes of
every page it touched before and after, and its inputs: ``write_tokens`` (prefill, decode tokens,
the second half of a move), ``read_tokens`` (the first half of a move), the decode attention's
score update (torch op). Any pool change between two recorded launches (page manager, decision
kernel, anything else) is reported as an unrecorded writer. Each write/read launch is then
replayed in isolation from its recorded pre-state and inputs by the torch ops on the same device,
the torch ops on the CPU, and the Triton interpreter on the CPU (a subprocess with
``TRITON_INTERPRET=1``, fed a ``torch.save`` file), and the FIRST launch whose bytes differ is
reported per comparison, decoded: kernel, page, segment, slot, row (request slot, layer, KV head),
position, codes, fp16 scale/zero, fp32 score, int32 position, and, for a differing scale, the
candidate scales (IEEE ``(hi - lo) / qmax`` versus torch-on-CUDA's ``(hi - lo) * (1 / qmax)``).
A microcheck compares ``tensor / python_number`` and ``quant.quantize`` on the device and the CPU.
Writes ``OUT_DIR/dump_writes_report.txt`` and ``.json`` and ``OUT_DIR/dump_writes_records.pt``
(every recorded launch; ``--from-records`` re-analyzes it on a CPU machine, e.g. when the
interpreter did not finish within ``--budget`` on the device); prints a short summary. The
interpreter replay runs in ``--interp-procs`` children over chunks of rows. On a machine without
CUDA, ``--device cpu`` under ``TRITON_INTERPRET=1`` runs the same machinery (interpreter as the
recorded run; ``--selftest-corrupt`` flips one recorded byte to exercise the difference report):
a smoke test of the mode itself.
"""
import os, sys, time
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tests"), REPO]
import torch
from support.paged import patch_interpreter_for_numpy_2_4, run_lockstep
patch_interpreter_for_numpy_2_4()

SEGMENTS = ("key_codes", "key_meta", "value_codes", "value_meta", "score", "position")


def workload(num_prompts=None):
    """(model on the CPU, config, prompts): the edge-case-4 configuration."""
    from conftest import peaked_tiny_llama
    from trtllm_diffkv.config import DiffKVConfig
    from trtllm_diffkv.paged import PagedDiffKVCache
    cfg = DiffKVConfig(recent_window_tokens=16, prompt_score_window_tokens=32, alpha_high=1.0, alpha_low=0.3)
    model = peaked_tiny_llama()
    probe = PagedDiffKVCache(cfg, 1, 8, 2, 64, num_pages=1, max_slots=1, max_seq_len_tokens=8)
    caps = (probe.page_format.high_tokens_per_page, probe.page_format.low_tokens_per_page)
    lengths = sorted({n for p in caps for n in (p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1)})
    print("caps", caps, "lengths", lengths, flush=True)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    if num_prompts:
        prompts = prompts[:num_prompts]
    return model, cfg, prompts


def run_mode(which):
    model, CFG, prompts = workload()
    t = time.time()
    kw = {"triton": dict(use_triton=True, page_manager="triton"), "torch": dict(use_triton=False, page_manager="cpu"),
          "gpu": dict(use_triton=True, page_manager="triton"),
          "gpu-torch-writes": dict(use_triton=False, page_manager="triton"),
          "gpu-torch-prefill": dict(use_triton=True, page_manager="triton")}[which]
    if which == "gpu-torch-prefill":  # everything Triton except the prefill attention + scores (torch_ops)
        import trtllm_diffkv.paged.cache as cache_module
        from trtllm_diffkv.paged import torch_ops
        _kernels = cache_module._kernels
        cache_module._kernels = lambda *a, **k: (*_kernels(*a, **k)[:2], torch_ops.scored_prefill_attention)
    if which.startswith("gpu"):
        model = model.cuda()
    rep = run_lockstep(model, CFG, prompts, 3, num_pages=6000, kv_atol=1e-4, out_atol=1e-3, stable_check=True,
                       read_path="torch", **kw)
    print(which, "OK max_out_diff", rep.max_out_diff, rep.max_out_diff_at, time.time() - t, flush=True)


# ====================================================================== dump-writes
def _c(t):
    """A detached contiguous CPU copy (never an alias of a buffer the run reuses)."""
    return None if t is None else t.detach().contiguous().cpu().clone()


class Recorder:
    """Wraps the cache's write/read ops and the decode attention; records bytes and inputs per launch."""

    def __init__(self, real_ops):
        self.real = real_ops
        self.launches = []  # write/read records (CPU tensors)
        self.attn = []  # decode attention / score update summaries
        self.unrecorded = []  # pool changes between recorded launches
        self.where = "setup"
        self.last_post = None
        self.cache = None
        self.errors = []

    # -- pool guard: anything that changed the pool since the last recorded launch
    def _guard(self, pages, label):
        if self.last_post is None or self.last_post.shape != pages.shape:
            return
        changed = (pages != self.last_post).any(1).nonzero().flatten()
        if changed.numel():
            self.unrecorded.append(dict(before_launch=label, pages=changed[:32].tolist(), count=int(changed.numel())))

    def _changed(self, before, after):
        return (after != before).any(1).nonzero().flatten()

    def write_tokens(self, pages, page_format, tier, dest_page, dest_slot, keys, values, *, key_offsets=None,
                     offset_rows=None, scores=None, positions=None, error_flags=None, error_index=None):
        label = f"{self.where}: write_tokens[{tier}]"
        self._guard(pages, label)
        before = pages.clone()
        ef_before = _c(error_flags)
        args = dict(dest_page=_c(dest_page), dest_slot=_c(dest_slot), keys=_c(keys), values=_c(values),
                    key_offsets=_c(key_offsets), offset_rows=_c(offset_rows), scores=_c(scores),
                    positions=_c(positions), error_flags=ef_before, error_index=_c(error_index))
        self.real.write_tokens(pages, page_format, tier, dest_page, dest_slot, keys, values, key_offsets=key_offsets,
                               offset_rows=offset_rows, scores=scores, positions=positions, error_flags=error_flags,
                               error_index=error_index)
        changed = self._changed(before, pages)
        dp = dest_page.long()
        dest_pages = torch.unique(dp[dp >= 0])
        touched = torch.unique(torch.cat([dest_pages, changed]))
        stray = sorted(set(changed.tolist()) - set(dest_pages.tolist()))
        self.launches.append(dict(kind="write_tokens", index=len(self.launches), where=label, tier=tier,
                                  touched=_c(touched), pre=_c(before[touched]), post=_c(pages[touched]), stray=stray,
                                  args=args, error_flags_post=_c(error_flags)))
        self.last_post = pages.clone()

    def read_tokens(self, pages, page_format, tier, src_page, src_slot, keys_out, values_out, scores_out=None,
                    positions_out=None):
        label = f"{self.where}: read_tokens[{tier}]"
        self._guard(pages, label)
        before = pages.clone()
        self.real.read_tokens(pages, page_format, tier, src_page, src_slot, keys_out, values_out, scores_out,
                              positions_out)
        changed = self._changed(before, pages)
        sp = src_page.long()
        touched = torch.unique(sp[sp >= 0])
        self.launches.append(dict(kind="read_tokens", index=len(self.launches), where=label, tier=tier,
                                  touched=_c(touched), pre=_c(before[touched]), stray=changed.tolist(),
                                  args=dict(src_page=_c(src_page), src_slot=_c(src_slot)),
                                  out=dict(keys=_c(keys_out), values=_c(values_out), scores=_c(scores_out),
                                           positions=_c(positions_out))))
        self.last_post = pages.clone()

    def __getattr__(self, name):  # anything else of the ops module
        return getattr(self.real, name)

    # -- decode attention (torch op in this workload): the score update writes the score segments
    def wrap_attention(self, fn, fmt_of):
        rec = self

        def attention(q, pool_pages, page_format, page_table, tier_tokens, row_ids, out, *, sm_scale,
                      update_scores=True, **kw):
            label = f"{rec.where}: decode_attention+score_update"
            rec._guard(pool_pages, label)
            before = pool_pages.clone()
            fn(q, pool_pages, page_format, page_table, tier_tokens, row_ids, out, sm_scale=sm_scale,
               update_scores=update_scores, **kw)
            entry = dict(where=label)
            try:
                entry.update(_attention_check(fn, before, pool_pages, q, page_format, page_table, tier_tokens,
                                              row_ids, out, sm_scale, update_scores))
            except Exception as exc:  # noqa: BLE001 - report and go on
                entry["error"] = f"comparison not made: {type(exc).__name__}: {exc}"
            rec.attn.append(entry)
            rec.last_post = pool_pages.clone()

        return attention


def _score_cell_mask(pages_cpu, fmt, page_table, tier_tokens, row_ids):
    """Bool [num_pages, page_bytes]: the score bytes of every token the attention reads (may change)."""
    from trtllm_diffkv.paged import torch_ops
    from trtllm_diffkv.paged.gather import gather_tier
    pool = torch_ops._pool(pages_cpu, fmt)
    rows = row_ids.reshape(-1).long()
    rows = rows[rows >= 0]
    mask = torch.zeros_like(pages_cpu, dtype=torch.bool)
    if not rows.numel():
        return mask
    counts = tier_tokens[rows].long()
    for i, tier in enumerate(("high", "low")):
        width = int(counts[:, i].max())
        if not width:
            continue
        view = gather_tier(pool, page_table, tier_tokens, rows, tier, width)
        p, s = view.page[view.valid].long(), view.slot[view.valid].long()
        off = fmt.tier(tier).score.offset_bytes + s * 4
        for b in range(4):
            mask[p, off + b] = True
    return mask


def _attention_check(fn, before, after, q, fmt, page_table, tier_tokens, row_ids, out, sm_scale, update_scores):
    """Replay the torch decode attention on the CPU from the pre-state; compare output and pool bytes."""
    orig = getattr(fn, "__wrapped_original__", fn)
    cpu_pages = before.cpu().clone()
    pt, tt, rid = page_table.cpu(), tier_tokens.cpu(), row_ids.cpu()
    cpu_out = torch.empty(out.shape, dtype=out.dtype)
    orig(q.cpu(), cpu_pages, fmt, pt, tt, rid, cpu_out, sm_scale=sm_scale, update_scores=update_scores)
    got = after.cpu()
    allowed = _score_cell_mask(before.cpu(), fmt, pt, tt, rid)
    diff = got != cpu_pages
    res = dict(out_max_abs_diff=float((out.float().cpu() - cpu_out.float()).abs().max()) if out.numel() else 0.0,
               bytes_differing=int(diff.sum()), bytes_differing_outside_score_cells=int((diff & ~allowed).sum()),
               pages_changed_by_run=int((got != before.cpu()).any(1).sum()),
               bytes_changed_outside_score_cells_by_run=int(((got != before.cpu()) & ~allowed).sum()))
    if allowed.any():
        f_run = got[allowed].view(-1, 4).contiguous().view(torch.float32).flatten()
        f_cpu = cpu_pages[allowed].view(-1, 4).contiguous().view(torch.float32).flatten()
        res["score_cells"] = int(f_run.numel())
        res["score_cells_differing"] = int((f_run != f_cpu).sum())
        res["score_max_abs_diff"] = float((f_run - f_cpu).abs().max())
    return res


# ---------------------------------------------------------------- replay of one launch
def _live_rows(rec):
    a = rec["args"]
    if rec["kind"] == "write_tokens":
        return torch.nonzero(a["dest_page"].long() >= 0).flatten()
    return torch.nonzero(a["src_page"].long() >= 0).flatten()


def replay(rec, ops, fmt, device, live=None):
    """Run ``ops``' version of the recorded launch on a mini pool (the touched pages' pre-state).

    Only the live rows (or the subset ``live`` of them) are passed (every row is its own program: same
    bytes per row). Returns a dict of CPU tensors: ``post`` mini pool (+ ``error_flags``) for a write, the
    outputs of the rows for a read.
    """
    a = rec["args"]
    touched = rec["touched"].long()
    mini = rec["pre"].clone().to(device)
    live = _live_rows(rec) if live is None else live
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    if rec["kind"] == "write_tokens":
        if not live.numel():
            return dict(post=mini.cpu(), error_flags=a["error_flags"])
        page = torch.searchsorted(touched, a["dest_page"].long()[live]).to(torch.int32)
        ef = a["error_flags"].clone() if a["error_flags"] is not None else None
        ef_d = dev(ef)
        sub = lambda t: None if t is None else t[live]  # noqa: E731
        ops.write_tokens(mini, fmt, rec["tier"], dev(page), dev(sub(a["dest_slot"])), dev(sub(a["keys"])),
                         dev(sub(a["values"])), key_offsets=dev(a["key_offsets"]),
                         offset_rows=dev(sub(a["offset_rows"])) if a["key_offsets"] is not None else None,
                         scores=dev(sub(a["scores"])), positions=dev(sub(a["positions"])),
                         error_flags=ef_d, error_index=dev(sub(a["error_index"])) if ef is not None else None)
        return dict(post=mini.cpu(), error_flags=None if ef_d is None else ef_d.cpu())
    n, D = live.numel(), fmt.head_dim
    page = torch.searchsorted(touched, a["src_page"].long()[live]).to(torch.int32)
    k = torch.zeros(n, D, dtype=torch.float32, device=device)
    v = torch.zeros_like(k)
    sc = torch.zeros(n, dtype=torch.float32, device=device)
    po = torch.zeros(n, dtype=torch.int32, device=device)
    if n:
        ops.read_tokens(mini, fmt, rec["tier"], dev(page), dev(a["src_slot"][live]), k, v, sc, po)
    return dict(keys=k.cpu(), values=v.cpu(), scores=sc.cpu(), positions=po.cpu())


def recorded_result(rec):
    """The run's own result in the shape :func:`replay` returns."""
    if rec["kind"] == "write_tokens":
        return dict(post=rec["post"], error_flags=rec["error_flags_post"])
    live = _live_rows(rec)
    return {k: (None if v is None else v[live]) for k, v in rec["out"].items()}


# ---------------------------------------------------------------- decoding differences
def _f16(x):
    import numpy as np
    return float(np.float16(x))


def _scale_candidates(span, qmax):
    """fp16 scale from an fp32 span: IEEE division (CPU torch, Triton div_rn) and reciprocal multiply
    (torch on CUDA for ``tensor / python_number``: ``a * float(1.0 / b)``)."""
    import numpy as np
    s = np.float32(span)
    eps = np.float32(2.0 ** -14)
    ieee = max(np.float32(s / np.float32(qmax)), eps)
    recip = max(np.float32(s * np.float32(1.0 / qmax)), eps)
    return dict(span_fp32=float(s), ieee_fp32=float(ieee), recip_fp32=float(recip),
                ieee_fp16=float(np.float16(ieee)), recip_fp16=float(np.float16(recip)))


def _segment_of(fmt, tier, byte):
    lay = fmt.tier(tier)
    t = lay.tier
    for name in SEGMENTS:
        seg = lay.segment(name)
        if seg.offset_bytes <= byte < seg.offset_bytes + seg.size_bytes:
            if name in ("key_codes", "value_codes"):
                bits = t.key_bits if name == "key_codes" else t.value_bits
                per = fmt.head_dim * bits // 8
            elif name in ("key_meta", "value_meta"):
                bits, groups = (t.key_bits, t.key_groups) if name == "key_meta" else (t.value_bits, t.value_groups)
                per = groups * 4 if bits < 16 else 0
            else:
                per = 4
            if not per:
                return name, None
            slot = (byte - seg.offset_bytes) // per
            return (name, slot) if slot < lay.tokens_per_page else (name + " (alignment padding)", None)
    return "page tail (no segment)", None


def _decode_slot(mini, fmt, tier, j, slot):
    """Every segment of token ``slot`` of mini page ``j``, decoded."""
    from trtllm_diffkv.paged import torch_ops
    from trtllm_diffkv.quant import unpack_codes
    pool = torch_ops._pool(mini.contiguous(), fmt)
    t = fmt.tier(tier).tier
    out = {}
    for side, bits in (("key", t.key_bits), ("value", t.value_bits)):
        codes = pool.segment(tier, f"{side}_codes")[j, slot]
        if bits == 16:
            out[f"{side}_fp16"] = codes.contiguous().view(torch.float16).float().tolist()
            continue
        out[f"{side}_codes"] = unpack_codes(codes, bits).tolist()
        meta = pool.segment(tier, f"{side}_meta")[j, slot]
        out[f"{side}_scale"] = meta[:, 0].float().tolist()
        out[f"{side}_zero"] = meta[:, 1].float().tolist()
        out[f"{side}_scale_hex"] = [f"{int(b):04x}" for b in meta[:, 0].contiguous().view(torch.int16).tolist()]
    out["score"] = float(pool.segment(tier, "score")[j, slot])
    out["score_hex"] = f"{int(pool.segment(tier, 'score')[j, slot].view(torch.int32)) & 0xffffffff:08x}"
    out["position"] = int(pool.segment(tier, "position")[j, slot])
    return out


def _row_inputs(rec, fmt, row, cache_shape):
    """What the kernel quantized for row ``row``: per side and group lo/hi/span and the scale candidates."""
    a = rec["args"]
    t = fmt.tier(rec["tier"]).tier
    info = dict(row=int(row))
    if a.get("offset_rows") is not None:
        r = int(a["offset_rows"][row])
        L, H = cache_shape
        info["cache_row"] = r
        info["request_slot"], rem = divmod(r, L * H)
        info["layer"], info["kv_head"] = divmod(rem, H)
    if a.get("positions") is not None:
        info["position_in"] = int(a["positions"][row])
    if a.get("scores") is not None:
        info["score_in"] = float(a["scores"][row])
    for side, bits, groups in (("key", t.key_bits, t.key_groups), ("value", t.value_bits, t.value_groups)):
        x = a["keys" if side == "key" else "values"][row].float()
        if side == "key" and a.get("key_offsets") is not None:
            x = x - a["key_offsets"][int(a["offset_rows"][row])].float()
        if not bool(torch.isfinite(x).all()):
            info[f"{side}_nonfinite_input"] = True
        if bits == 16:
            continue
        qmax = 2 ** bits - 1
        xg = x.reshape(groups, -1)
        gi = []
        for g in range(groups):
            lo, hi = float(xg[g].min()), float(xg[g].max())
            import numpy as np
            span = np.float32(hi) - np.float32(lo)
            d = dict(group=g, lo=lo, hi=hi, zero_fp16=_f16(lo), **_scale_candidates(span, qmax))
            gi.append(d)
        info[f"{side}_groups"] = gi
        info[f"{side}_input"] = x.tolist()
    return info


def diff_write(rec, mine, theirs, fmt, cache_shape, max_slots=24):
    """Byte differences of two mini pools of a write launch, decoded per (page, slot, segment)."""
    a, b = mine["post"], theirs["post"]
    res = dict(equal=True)
    if a.shape != b.shape:
        return dict(equal=False, note=f"shapes differ {tuple(a.shape)} {tuple(b.shape)}")
    diff = (a != b)
    ef_a, ef_b = mine.get("error_flags"), theirs.get("error_flags")
    if ef_a is not None and ef_b is not None and not torch.equal(ef_a, ef_b):
        res.update(equal=False, error_flags=dict(mine=ef_a.tolist(), theirs=ef_b.tolist()))
    if not diff.any():
        return res
    res["equal"] = False
    res["bytes_differing"] = int(diff.sum())
    touched = rec["touched"].long()
    cells = {}
    for j, byte in diff.nonzero().tolist():
        seg, slot = _segment_of(fmt, rec["tier"], byte)
        cells.setdefault((j, slot if slot is not None else -1), set()).add(seg)
    res["cells_differing"] = len(cells)
    seg_count = {}
    for segs in cells.values():
        for s in segs:
            seg_count[s] = seg_count.get(s, 0) + 1
    res["segments_differing"] = seg_count
    a_args = rec["args"]
    dp = a_args["dest_page"].long()
    ds = a_args["dest_slot"].long()
    details = []
    for (j, slot), segs in sorted(cells.items())[:max_slots]:
        page = int(touched[j])
        d = dict(page=page, slot=slot, segments=sorted(segs))
        if slot >= 0:
            rows = torch.nonzero((dp == page) & (ds == slot)).flatten().tolist()
            d["rows_writing_it"] = rows
            d["mine"] = _decode_slot(a, fmt, rec["tier"], j, slot)
            d["theirs"] = _decode_slot(b, fmt, rec["tier"], j, slot)
            d["pre"] = _decode_slot(rec["pre"], fmt, rec["tier"], j, slot)
            for key in list(d["mine"]):
                if key.endswith("_codes"):
                    m, t = d["mine"][key], d["theirs"][key]
                    d[key + "_differing_elements"] = [(e, m[e], t[e]) for e in range(len(m)) if m[e] != t[e]][:64]
            if rows:
                d["input"] = _row_inputs(rec, fmt, rows[-1], cache_shape)
        details.append(d)
    res["first_cells"] = details
    return res


def diff_read(rec, mine, theirs):
    res = dict(equal=True)
    for k in ("keys", "values", "scores", "positions"):
        x, y = mine.get(k), theirs.get(k)
        if x is None or y is None:
            continue
        if x.shape != y.shape:
            res.update(equal=False)
            res[k] = f"shapes differ {tuple(x.shape)} {tuple(y.shape)}"
            continue
        bits_x = x.view(torch.int32) if x.dtype == torch.float32 else x
        bits_y = y.view(torch.int32) if y.dtype == torch.float32 else y
        ne = bits_x != bits_y
        if ne.any():
            res["equal"] = False
            idx = ne.nonzero().tolist()[:16]
            live = _live_rows(rec)
            res[k] = dict(count=int(ne.sum()), max_abs=float((x.float() - y.float()).abs().max()),
                          first=[dict(row=int(live[i[0]]), index=i, mine=float(x[tuple(i)]), theirs=float(y[tuple(i)]),
                                      src_page=int(rec["args"]["src_page"][live[i[0]]]),
                                      src_slot=int(rec["args"]["src_slot"][live[i[0]]])) for i in idx])
    return res


def launch_checks(rec, fmt):
    """Input sanity of one launch: duplicate (page, slot) (a write race), out-of-range slots, non-finite rows."""
    a = rec["args"]
    tpp = fmt.tier(rec["tier"]).tokens_per_page
    live = _live_rows(rec)
    if rec["kind"] == "write_tokens":
        p, s = a["dest_page"].long()[live], a["dest_slot"].long()[live]
    else:
        p, s = a["src_page"].long()[live], a["src_slot"].long()[live]
    out = dict(rows=int(a["dest_page" if rec["kind"] == "write_tokens" else "src_page"].numel()),
               live_rows=int(live.numel()), pages_touched=int(rec["touched"].numel()), stray_pages=rec["stray"][:32])
    bad_slot = (s < 0) | (s >= tpp)
    if bad_slot.any():
        out["slots_out_of_range"] = [(int(p[i]), int(s[i])) for i in bad_slot.nonzero().flatten()[:16]]
    if p.numel():
        key = p * (tpp + 1) + s
        uniq, counts = torch.unique(key, return_counts=True)
        if (counts > 1).any():
            dup = uniq[counts > 1]
            out["duplicate_page_slot"] = [(int(k // (tpp + 1)), int(k % (tpp + 1))) for k in dup[:16]]
    if rec["kind"] == "write_tokens" and live.numel():
        nf = ~(torch.isfinite(a["keys"][live].float()).all(1) & torch.isfinite(a["values"][live].float()).all(1))
        if nf.any():
            out["nonfinite_input_rows"] = live[nf].tolist()[:16]
    return out


# ---------------------------------------------------------------- the division microcheck
def division_check(device):
    """torch ``tensor / python_number`` and ``quant.quantize`` on ``device`` against the CPU (IEEE)."""
    from trtllm_diffkv.quant import quantize
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1 << 20, generator=g) * torch.exp2(torch.randint(-8, 8, (1 << 20,), generator=g).float())
    res = {}
    for q in (3, 15, 255):
        cpu = x / q
        dev_scalar = (x.to(device) / q).cpu()
        dev_tensor = (x.to(device) / torch.full((1,), float(q), device=device)).cpu()
        recip = x * torch.tensor(1.0 / q, dtype=torch.float32)
        res[f"div_by_{q}"] = dict(
            device_scalar_vs_cpu_ieee_mismatches=int((dev_scalar != cpu).sum()),
            device_scalar_equals_reciprocal_multiply=bool(torch.equal(dev_scalar, recip)),
            device_tensor_divisor_vs_cpu_ieee_mismatches=int((dev_tensor != cpu).sum()))
    rows = torch.randn(1, 1 << 16, 64, generator=g) * 3
    for bits, groups in ((8, 1), (4, 2), (4, 1), (2, 4)):
        qc, qd = quantize(rows, bits, groups), quantize(rows.to(device), bits, groups)
        res[f"quantize_b{bits}_g{groups}"] = dict(
            groups=int(qc.scale.numel()), scale_mismatches=int((qd.scale.cpu() != qc.scale).sum()),
            zero_mismatches=int((qd.zero.cpu() != qc.zero).sum()), code_byte_mismatches=int((qd.codes.cpu() != qc.codes).sum()))
    return res


# ---------------------------------------------------------------- interpreter child
def replay_child(argv):
    """``dump-writes-replay IN.pt OUT_DIR NPROCS K``: replay tasks K, K + NPROCS, ... with the Triton
    interpreter (a task: one launch's chunk of live rows; one result file per task)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "the interpreter replay needs TRITON_INTERPRET=1"
    from trtllm_diffkv.kernels import quant_write
    blob = torch.load(argv[0], weights_only=False)
    out_dir, nprocs, me = argv[1], int(argv[2]), int(argv[3])
    fmt = blob["fmt"]
    by_index = {r["index"]: r for r in blob["launches"]}
    t0 = time.time()
    for k, (index, rows) in enumerate(blob["tasks"]):
        if k % nprocs != me:
            continue
        try:
            res = replay(by_index[index], quant_write, fmt, "cpu", rows)
        except Exception as exc:  # noqa: BLE001 - next task
            res = dict(error=f"{type(exc).__name__}: {exc}")
        path = os.path.join(out_dir, f"task_{k:05d}.pt")
        torch.save(res, path + ".tmp")
        os.replace(path + ".tmp", path)  # a child stopped at the budget leaves no half-written result
        print(f"interp task {k} launch {index} ({rows.numel()} rows) {time.time() - t0:.1f}s", flush=True)


def interp_tasks(launches, chunk):
    """(launch index, live rows) tasks in launch order: big launches split so that children share them."""
    tasks = []
    for r in launches:
        live = _live_rows(r)
        parts = list(torch.split(live, chunk)) if live.numel() else [live]
        tasks += [(r["index"], p.clone()) for p in parts]
    return tasks


def merge_interp(rec, parts):
    """One launch's result from its tasks' results (rows write disjoint slots; flags only go 0 -> 1)."""
    for p in parts:
        if p is None:
            return dict(error="not replayed (the interpreter children did not get to it within the budget)")
        if "error" in p:
            return p
    if rec["kind"] == "write_tokens":
        pre = rec["pre"]
        post = pre.clone()
        flags = None
        for p in parts:
            changed = p["post"] != pre
            post[changed] = p["post"][changed]
            if p.get("error_flags") is not None:
                flags = p["error_flags"].clone() if flags is None else torch.maximum(flags, p["error_flags"])
        return dict(post=post, error_flags=flags)
    return {k: torch.cat([p[k] for p in parts]) for k in ("keys", "values", "scores", "positions")}


def _strip_for_child(rec):
    return {k: v for k, v in rec.items() if k not in ("post", "out", "error_flags_post")}


# ---------------------------------------------------------------- the mode
def dump_writes(argv):
    import argparse
    import json
    import traceback

    ap = argparse.ArgumentParser(prog="repro_gpu_lockstep.py dump-writes")
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=0, help="first K prompts only (0: all, as in `gpu`)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--num-pages", type=int, default=6000)
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for the whole mode (the interpreter "
                    "replay gets what is left; launches not replayed in time are reported as such)")
    ap.add_argument("--no-interp", action="store_true")
    ap.add_argument("--from-records", default="", help="no run: analyze OUT_DIR/dump_writes_records.pt of an "
                    "earlier run (e.g. a GPU run brought back) with the CPU replays (torch, interpreter)")
    ap.add_argument("--scratch", default="", help="folder for the interpreter's input and results (default: a "
                    "fresh temporary folder)")
    ap.add_argument("--no-save-records", action="store_true", help="do not write OUT_DIR/dump_writes_records.pt "
                    "(every recorded launch: pre/post bytes of its pages and inputs; for offline replays)")
    ap.add_argument("--interp-procs", type=int, default=0, help="interpreter children (0: cpu_count - 2, <= 12)")
    ap.add_argument("--interp-chunk", type=int, default=96, help="live rows per interpreter task")
    ap.add_argument("--selftest-corrupt", action="store_true", help="smoke test of the difference reports: flip "
                    "one key-scale byte in the recorded result of the first write launch with live rows")
    opt = ap.parse_args(argv)
    t_start = time.time()
    os.makedirs(opt.out_dir, exist_ok=True)
    report = dict(device=opt.device, torch=torch.__version__, argv=argv)
    try:
        import triton
        report["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    if opt.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    lines = []

    def say(msg=""):
        lines.append(msg)
        print(msg, flush=True)

    # 0. the division microcheck
    try:
        report["division_check"] = division_check(opt.device)
    except Exception as exc:  # noqa: BLE001
        report["division_check"] = f"not made: {type(exc).__name__}: {exc}"

    if opt.from_records:
        saved = torch.load(opt.from_records, weights_only=False)
        report.update(saved.get("report", {}))
        report["from_records"] = opt.from_records
        return analyze(opt, report, lines, say, saved["launches"], saved["fmt"], saved["cache_shape"],
                       saved["run_name"] + " (from records)", saved.get("attn", []), saved.get("unrecorded", []),
                       None, t_start, "cpu")

    # 1. the recorded run
    import trtllm_diffkv.paged.cache as cache_module
    from trtllm_diffkv.paged import torch_ops
    from trtllm_diffkv.paged.cache import PagedDiffKVCache
    model, cfg, prompts = workload(opt.prompts or None)
    if opt.device != "cpu":
        model = model.to(opt.device)
    rec = Recorder(None)
    orig_kernels, orig_attn = cache_module._kernels, torch_ops.paged_decode_attention
    orig_plan, orig_forward = PagedDiffKVCache.plan, PagedDiffKVCache.forward
    wrapped_attn = rec.wrap_attention(orig_attn, None)
    wrapped_attn.__wrapped_original__ = orig_attn
    counters = dict(plan=0)

    def kernels(*a, **k):
        ops, attn, pre = orig_kernels(*a, **k)
        rec.real = ops
        return rec, attn, pre

    def plan(self, *a, **k):
        rec.cache = self
        rec.where = "prefill plan" if counters["plan"] == 0 else f"decode step {counters['plan']} plan (moves)"
        counters["plan"] += 1
        return orig_plan(self, *a, **k)

    def forward(self, layer_idx, *a, **k):
        step = counters["plan"] - 1
        rec.where = ("prefill" if step == 0 else f"decode step {step}") + f", layer {layer_idx}"
        return orig_forward(self, layer_idx, *a, **k)

    cache_module._kernels = kernels
    torch_ops.paged_decode_attention = wrapped_attn  # decode_layer compares with this name: no workspace
    PagedDiffKVCache.plan, PagedDiffKVCache.forward = plan, forward
    t = time.time()
    try:
        lock = run_lockstep(model, cfg, prompts, opt.steps, num_pages=opt.num_pages, kv_atol=1e-4, out_atol=1e-3,
                            stable_check=True, read_path="torch", use_triton=True, page_manager="triton")
        report["lockstep"] = f"OK max_out_diff {lock.max_out_diff:.6g} at {lock.max_out_diff_at}"
    except AssertionError as exc:
        report["lockstep"] = f"FAILED (as expected on the GPU): {exc}"
    except Exception as exc:  # noqa: BLE001 - the recorded launches are still worth comparing
        report["lockstep"] = f"ERROR {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        cache_module._kernels, torch_ops.paged_decode_attention = orig_kernels, orig_attn
        PagedDiffKVCache.plan, PagedDiffKVCache.forward = orig_plan, orig_forward
    report["run_seconds"] = round(time.time() - t, 1)
    cache = rec.cache
    if cache is None:
        say("no cache was created: nothing recorded")
        report["lines"] = lines
        with open(os.path.join(opt.out_dir, "dump_writes_report.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        return
    fmt = cache.page_format
    cache_shape = (cache.num_layers, cache.num_kv_heads)
    run_name = ("triton-" + opt.device) if cache.use_triton else ("torch-" + opt.device)
    if opt.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        run_name = "triton-interpreter(recorded run)"
    if not opt.no_save_records:
        path = os.path.join(opt.out_dir, "dump_writes_records.pt")
        try:
            keep = {k: report[k] for k in ("device", "gpu", "torch", "triton", "lockstep", "division_check",
                                           "run_seconds") if k in report}
            torch.save(dict(fmt=fmt, launches=rec.launches, cache_shape=cache_shape, run_name=run_name,
                            attn=rec.attn, unrecorded=rec.unrecorded, report=keep), path)
            size = os.path.getsize(path)
            if size > 15 * 2**20:  # what comes back from a device call is capped at 16 MiB a file
                os.remove(path)
                report["records"] = f"not kept: {size / 2**20:.1f} MiB"
            else:
                report["records"] = f"{path} ({size / 2**20:.1f} MiB)"
        except Exception as exc:  # noqa: BLE001
            report["records"] = f"not saved: {type(exc).__name__}: {exc}"
    return analyze(opt, report, lines, say, rec.launches, fmt, cache_shape, run_name, rec.attn, rec.unrecorded,
                   rec.real if cache.use_triton else None, t_start, opt.device)


def analyze(opt, report, lines, say, launches, fmt, cache_shape, run_name, attn, unrecorded, triton_ops, t_start,
            device):
    """Replays of every recorded launch (torch on ``device`` and the CPU, the compiled kernel again, the
    interpreter), the comparisons, the report files and the summary."""
    import json
    import subprocess
    import tempfile
    from trtllm_diffkv.paged import torch_ops
    report["recorded_launches"] = len(launches)
    report["unrecorded_pool_changes"] = unrecorded
    report["launch_checks"] = [dict(index=r["index"], where=r["where"], **launch_checks(r, fmt)) for r in launches]

    # 2. the interpreter replay, in the background (NPROCS children) while the torch replays run
    scratch = opt.scratch or tempfile.mkdtemp(prefix="dump_writes_")  # bulky files stay out of OUT_DIR
    children, interp_dir, tasks = [], os.path.join(scratch, "interp"), []
    if not opt.no_interp:
        try:
            os.makedirs(interp_dir, exist_ok=True)
            tasks = interp_tasks(launches, opt.interp_chunk)
            blob_path = os.path.join(scratch, "launches_for_interpreter.pt")
            torch.save(dict(fmt=fmt, launches=[_strip_for_child(r) for r in launches], tasks=tasks), blob_path)
            env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
            nprocs = opt.interp_procs or min(12, max(1, (os.cpu_count() or 2) - 2))
            report["interp_procs"] = nprocs
            for k in range(nprocs):
                log = open(os.path.join(scratch, f"interp_child_{k}.log"), "w")
                children.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "dump-writes-replay", blob_path, interp_dir,
                     str(nprocs), str(k)], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        except Exception as exc:  # noqa: BLE001
            report["interp"] = f"not started: {type(exc).__name__}: {exc}"

    # 3. torch replays (same device, CPU)
    results = {run_name: [recorded_result(r) for r in launches]}
    if opt.selftest_corrupt:
        for r, res in zip(launches, results[run_name]):
            live = _live_rows(r)
            if r["kind"] == "write_tokens" and live.numel():
                j = int(torch.searchsorted(r["touched"].long(), r["args"]["dest_page"][live[0]].long()))
                byte = fmt.tier(r["tier"]).key_meta.offset_bytes + int(r["args"]["dest_slot"][live[0]]) * 4 + 1
                res["post"] = res["post"].clone()
                res["post"][j, byte] ^= 1
                say(f"selftest: flipped page {int(r['touched'][j])} byte {byte} of launch {r['index']}")
                break
    replays = [(f"torch-{device}", torch_ops, device)] + ([("torch-cpu", torch_ops, "cpu")] if device != "cpu" else [])
    if device != "cpu" and triton_ops is not None:  # the same compiled kernel again, from the recorded pre-state
        replays.insert(0, (f"triton-{device}-replay", triton_ops, device))
    for name, ops, device in replays:
        if name in results:
            name += "(2)"
        rs = []
        for r in launches:
            try:
                rs.append(replay(r, ops, fmt, device))
            except Exception as exc:  # noqa: BLE001
                rs.append(dict(error=f"{type(exc).__name__}: {exc}"))
        results[name] = rs

    # 4. collect the interpreter's results (what finished within the budget)
    if children:
        deadline = t_start + opt.budget - 10.0
        stopped = 0
        for ch in children:
            try:
                ch.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                ch.kill()  # a child this mode started (by its Popen object)
                ch.wait()
                stopped += 1
        report["interp"] = (f"{len(children)} children, exit codes {[ch.returncode for ch in children]}"
                            + (f", {stopped} stopped at the budget" if stopped else ""))
        per_launch = {r["index"]: [] for r in launches}
        for k, (index, _) in enumerate(tasks):
            path = os.path.join(interp_dir, f"task_{k:05d}.pt")
            try:
                per_launch[index].append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
            except Exception as exc:  # noqa: BLE001 - e.g. a file cut short by the stop
                per_launch[index].append(dict(error=f"unreadable task result: {exc}"))
        results["triton-interpreter-cpu"] = [merge_interp(r, per_launch[r["index"]]) for r in launches]
        tails = {}
        for k in range(len(children)):
            try:
                with open(os.path.join(scratch, f"interp_child_{k}.log")) as f:
                    tails[k] = f.read()[-1500:]
            except OSError as exc:
                tails[k] = str(exc)
        report["interp_child_log_tails"] = tails

    # 5. comparisons: the recorded run against each replay, and the CPU replays against each other
    names = list(results)
    pairs = [(run_name, n) for n in names if n != run_name]
    if "triton-interpreter-cpu" in results:
        pairs.append(("triton-interpreter-cpu", "torch-cpu"))
    if f"torch-{device}" in results and device != "cpu":
        pairs.append((f"torch-{device}", "torch-cpu"))
    comparisons = []
    for mine_name, theirs_name in pairs:
        entry = dict(pair=f"{mine_name} vs {theirs_name}", launches_equal=0, launches_differing=0,
                     not_compared=[], first_difference=None, differing=[])
        for r, mine, theirs in zip(launches, results[mine_name], results[theirs_name]):
            if "error" in mine or "error" in theirs:
                entry["not_compared"].append(dict(index=r["index"], where=r["where"],
                                                  why=mine.get("error") or theirs.get("error")))
                continue
            try:
                d = diff_write(r, mine, theirs, fmt, cache_shape) if r["kind"] == "write_tokens" else \
                    diff_read(r, mine, theirs)
            except Exception as exc:  # noqa: BLE001
                entry["not_compared"].append(dict(index=r["index"], where=r["where"],
                                                  why=f"diff failed: {type(exc).__name__}: {exc}"))
                continue
            if d["equal"]:
                entry["launches_equal"] += 1
                continue
            entry["launches_differing"] += 1
            summary = dict(index=r["index"], where=r["where"], **{k: v for k, v in d.items() if k != "first_cells"})
            entry["differing"].append(summary)
            if entry["first_difference"] is None:
                entry["first_difference"] = dict(index=r["index"], where=r["where"], kind=r["kind"], tier=r["tier"],
                                                 **d)
        comparisons.append(entry)
    report["comparisons"] = comparisons
    report["attention_score_updates"] = attn
    report["seconds"] = round(time.time() - t_start, 1)

    # 6. text report + summary
    say(f"dump-writes: device {report.get('device')} ({report.get('gpu', 'cpu')}), torch {torch.__version__}, "
        f"triton {report.get('triton')}, recorded run = {run_name}")
    say(f"lockstep: {report['lockstep'].splitlines()[0]}")
    say(f"recorded launches: {len(launches)} (write/read), attention score updates: {len(attn)}, "
        f"run {report['run_seconds']} s, total {report['seconds']} s; interpreter: {report.get('interp', 'off')}")
    say(f"records: {report.get('records', 'not saved')}")
    dc = report["division_check"]
    if isinstance(dc, dict):
        say("division check (device vs CPU IEEE): " + "; ".join(
            f"{k}: scalar-divisor mismatches {v['device_scalar_vs_cpu_ieee_mismatches']}"
            f" (== x*(1/q): {v['device_scalar_equals_reciprocal_multiply']}), tensor-divisor mismatches "
            f"{v['device_tensor_divisor_vs_cpu_ieee_mismatches']}" for k, v in dc.items() if k.startswith("div")))
        say("quantize device vs CPU: " + "; ".join(
            f"{k}: scale {v['scale_mismatches']}/{v['groups']}, codes bytes {v['code_byte_mismatches']}"
            for k, v in dc.items() if k.startswith("quantize")))
    else:
        say(f"division check: {dc}")
    if unrecorded:
        say(f"UNRECORDED pool changes (a writer outside the recorded launches): {unrecorded[:4]}")
    else:
        say("no pool change outside the recorded launches (page manager, decisions, locations wrote no pool byte)")
    for c in report["launch_checks"]:
        flags = {k: c[k] for k in ("stray_pages", "slots_out_of_range", "duplicate_page_slot", "nonfinite_input_rows")
                 if c.get(k)}
        if flags:
            say(f"launch {c['index']} ({c['where']}): INPUT/WRITE ANOMALY {flags}")
    bad_attn = [a for a in attn if a.get("error") or a.get("bytes_changed_outside_score_cells_by_run")
                or a.get("bytes_differing_outside_score_cells")]
    if attn:
        worst = max((a.get("score_max_abs_diff", 0.0) for a in attn), default=0.0)
        worst_out = max((a.get("out_max_abs_diff", 0.0) for a in attn), default=0.0)
        ndiff = sum(a.get("score_cells_differing", 0) for a in attn)
        say(f"decode attention (torch op) vs its CPU replay: {len(attn)} launches, output max |diff| "
            f"{worst_out:.3g}, score cells differing {ndiff} (max |diff| {worst:.3g}; float rounding of the softmax "
            f"is expected here), launches with bytes outside the score cells changed/differing or errors: "
            f"{len(bad_attn)}")
    for c in comparisons:
        fd = c["first_difference"]
        head = (f"[{c['pair']}] equal {c['launches_equal']}, differing {c['launches_differing']}, "
                f"not compared {len(c['not_compared'])}")
        if fd is None:
            nc = c["not_compared"]
            say(head + (": no byte differs" if not nc else
                        f": no byte differs among the compared; first not compared: launch {nc[0]['index']} "
                        f"({nc[0]['why']})"))
            continue
        say(head + f"; FIRST: launch {fd['index']} {fd['where']} ({fd['kind']})")
        if fd["kind"] == "write_tokens":
            say(f"    bytes differing {fd.get('bytes_differing')}, cells {fd.get('cells_differing')}, "
                f"segments {fd.get('segments_differing')}")
            for cell in fd.get("first_cells", [])[:3]:
                inp = cell.get("input", {})
                say(f"    page {cell['page']} slot {cell['slot']} segments {cell['segments']} rows "
                    f"{cell.get('rows_writing_it')} request slot {inp.get('request_slot')} layer {inp.get('layer')} "
                    f"KV head {inp.get('kv_head')} position {inp.get('position_in')}")
                m, t2 = cell.get("mine", {}), cell.get("theirs", {})
                for side in ("key", "value"):
                    if f"{side}_scale" in m and (m[f"{side}_scale"] != t2.get(f"{side}_scale")
                                                 or m[f"{side}_zero"] != t2.get(f"{side}_zero")):
                        say(f"      {side} scale {m[f'{side}_scale']} vs {t2.get(f'{side}_scale')}, zero "
                            f"{m[f'{side}_zero']} vs {t2.get(f'{side}_zero')}")
                        for gi in inp.get(f"{side}_groups", []):
                            say(f"        group {gi['group']}: span fp32 {gi['span_fp32']!r}, IEEE scale "
                                f"{gi['ieee_fp32']!r}->fp16 {gi['ieee_fp16']!r}, reciprocal scale "
                                f"{gi['recip_fp32']!r}->fp16 {gi['recip_fp16']!r}")
                    if cell.get(f"{side}_codes_differing_elements"):
                        say(f"      {side} codes differing (element, mine, theirs): "
                            f"{cell[f'{side}_codes_differing_elements'][:8]}")
                for k in ("score", "position"):
                    if m.get(k) != t2.get(k):
                        say(f"      {k}: {m.get(k)!r} vs {t2.get(k)!r}")
        else:
            say("    " + str({k: v for k, v in fd.items() if k in ("keys", "values", "scores", "positions")})[:600])
    report["lines"] = lines
    with open(os.path.join(opt.out_dir, "dump_writes_report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(opt.out_dir, "dump_writes_report.txt"), "w") as f:
        f.write("\n".join(lines) + "\n\n")
        for c in comparisons:
            f.write(f"== {c['pair']}\n")
            if c["first_difference"] is not None:
                f.write(json.dumps(c["first_difference"], indent=1, default=str)[:60000] + "\n")
            f.write(f"differing launches: {json.dumps(c['differing'], default=str)[:20000]}\n")
            f.write(f"not compared: {json.dumps(c['not_compared'], default=str)[:4000]}\n\n")
        f.write("== launch checks\n" + "\n".join(json.dumps(c, default=str) for c in report["launch_checks"]) + "\n")
        f.write("== attention score updates\n" + "\n".join(json.dumps(a, default=str) for a in attn) + "\n")
        f.write("== division check\n" + json.dumps(report["division_check"], indent=1, default=str) + "\n")
    say(f"report: {os.path.join(opt.out_dir, 'dump_writes_report.txt')} (+ .json)")


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "dump-writes":
        dump_writes(sys.argv[2:])
    elif which == "dump-writes-replay":
        replay_child(sys.argv[2:])
    else:
        run_mode(which)
