// DiffKV paged decode attention: the split-K merge with the score update folded in (CUDA C++, sm_80+).
//
// Replaces, on the CUDA backend, the Triton _decode_merge_kernel followed by diffkv_decode_scores (two launches
// per layer; 191 + 463 us a step at Llama-3-8B 48 x 4096 on the H200, docs/PERFORMANCE.md). The score update needs
// each query head's final log-sum-exp, known once every CTA of the row's split has written its partial state, i.e.
// after the partial kernel: so the merge is where the update can go without a cross-CTA wait.
//
//   grid (num_seqs, num_kv_heads, Z), MERGE_WARPS warps. Every CTA of a row (seq, kvh):
//   1. merges the row's NSLOT partial (m, l) per query head (warp w takes heads w, w + MERGE_WARPS, ...):
//      m_safe, 1 / l, lse = m_safe + log2 l (inf for an empty row), the slots' weights 2^(m_s - m_safe) into
//      shared memory (the Triton merge's arithmetic);
//   2. writes its share of the output (element e = z * threads + tid, stepping Z * threads: the GROUP x HEAD_DIM
//      outputs spread over the row's Z CTAs) and, CTA z = 0, the row's lse (the workspace's contract);
//   3. with SCORES, adds to every token of its SCORE_PAGES page-table positions the max over the group's query
//      heads of its final probability p_h 2^(page_max_h - lse_h) (page_probs holds p_h relative to page_max_h):
//      PAGES_PER_WARP pages a warp, a lane on two adjacent slots (one 4-byte load of fp16 pairs per head; two
//      2-byte loads where PMAX is odd, e.g. the default-k8v2 preset's 35-token low pages); CTA z takes the table
//      positions [z SCORE_PAGES, (z + 1) SCORE_PAGES).
//   Each load is issued as soon as its address is known, in three rounds (see diffkv_decode_merge below).
//   A padding row (row_ids < 0) has empty partial states: zeros out, lse inf, no score touched.
//
// Compile-time configuration (-D): GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, PMAX, PAGE_BYTES, MAX_SLOTS (>= 2 x the
// workspace's partitions), OUT_BF16 (the output's dtype: 1 bf16, 0 fp16), SCORES, MERGE_WARPS, PAGES_PER_WARP, and per tier
// H_TOKENS / L_TOKENS, H_SC / L_SC (score segment byte offsets). kernels/cuda_decode.py sets them.

// Compiled after the helpers at the top of decode_partial.cu (u32 / u16 / u64, NEG_INF, h2f, ex2, ...), which
// kernels/cuda_decode.py (merge_source) puts before this text; or, with FUSED_MERGE=1, after the whole of
// decode_partial.cu (fused_source), where diffkv_decode_attend at the end of this file runs the partial kernel's CTA
// work and this merge in one launch (the row's last CTA merges; see there).

#define POS_INF (__int_as_float(0x7f800000))

#ifndef FUSED_MERGE
#define FUSED_MERGE 0
#endif
#ifndef MERGE_WARPS
#define MERGE_WARPS 4
#endif
#ifndef PAGES_PER_WARP
#define PAGES_PER_WARP 4
#endif
#define SCORE_PAGES (PAGES_PER_WARP * MERGE_WARPS)  // page-table positions per CTA
constexpr int SLOT_ITERS = (PMAX + 63) / 64;       // a lane's slot pairs per page
constexpr bool PAIR_LOADS = PMAX % 2 == 0;          // a head's slot pairs 4-byte aligned (else two 2-byte loads)

__device__ __forceinline__ u16 f2out(float x) {
    u16 r;
#if OUT_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
    return r;
}

// Workspace reads: in diffkv_decode_attend through L2 (__ldcg: other CTAs of the same launch wrote them, and L1 is not
// coherent); in the standalone merge plain loads of const __restrict__ data (the read-only path, as before the fusion).
template <class T>
__device__ __forceinline__ T ws_load(const T* p) {
#if FUSED_MERGE
    return __ldcg(p);
#else
    return *p;
#endif
}

// A warp's page's probabilities, maxima and old scores, loaded before they are needed (the standalone merge: as soon
// as the page's tier counts and page id are known; the fused kernel's merging CTA: before the merge).
struct ScorePage {
    u32 probs[GROUP][SLOT_ITERS];  // slots 2 lane, 2 lane + 1 (+ 64 i) of each head: fp16 pairs (low half first)
    float pmax[GROUP];
    float score[SLOT_ITERS][2];
    float* dst;                    // the page's score segment (nullptr: no page)
    int count;
};

// The page at table position pos of row rs (a `high` page of `count` tokens, in pool page `page`): its probabilities,
// maxima and old scores into p.
__device__ __forceinline__ void load_cell(ScorePage& p, int pos, bool high, int count, int page, int rs, int R,
                                          unsigned char* __restrict__ pool, const u16* __restrict__ page_probs,
                                          const float* __restrict__ page_max, int lane) {
    p.count = count;
    const long long cell = (long long)rs * R + pos;
    p.dst = (float*)(pool + (u64)page * PAGE_BYTES + (high ? H_SC : L_SC));
    const u16* probs = page_probs + cell * GROUP * PMAX;
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        p.pmax[h] = ws_load(page_max + cell * GROUP + h);
#pragma unroll
        for (int i = 0; i < SLOT_ITERS; ++i) {
            const int slot = 2 * lane + 64 * i;
            const u16* ph = probs + h * PMAX + slot;
            if constexpr (PAIR_LOADS) {
                p.probs[h][i] = (slot < p.count) ? ws_load((const unsigned int*)ph) : 0u;
            } else {
                p.probs[h][i] = ((slot < p.count) ? (u32)ws_load(ph) : 0u) |
                                ((slot + 1 < p.count) ? (u32)ws_load(ph + 1) << 16 : 0u);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < SLOT_ITERS; ++i) {
        const int slot = 2 * lane + 64 * i;
        p.score[i][0] = (slot < p.count) ? p.dst[slot] : 0.f;
        p.score[i][1] = (slot + 1 < p.count) ? p.dst[slot + 1] : 0.f;
    }
}

// Page-list entry u of the row (high pages first; u >= hp + lp: no page).
__device__ __forceinline__ void load_score_page(ScorePage& p, int u, const RowPages& rp, int rs, int R,
                                                unsigned char* __restrict__ pool, const int* __restrict__ table,
                                                const u16* __restrict__ page_probs,
                                                const float* __restrict__ page_max, int lane) {
    p.count = 0;
    p.dst = nullptr;
    if (u >= rp.hp + rp.lp) return;
    const PageRef r = page_ref(u, rp.hp, rp.n_high, rp.n_low, R);
    load_cell(p, r.pos, !r.low, r.count, table[(long long)rp.row * R + r.pos], rs, R, pool, page_probs, page_max, lane);
}

// score += max over the heads of p_h 2^(page_max_h - lse_h) (diffkv_decode_scores' arithmetic, in its order)
__device__ __forceinline__ void apply_score_page(const ScorePage& p, const float* s_lse, int lane) {
    if (p.dst == nullptr) return;
    float best[SLOT_ITERS][2];
#pragma unroll
    for (int i = 0; i < SLOT_ITERS; ++i) best[i][0] = best[i][1] = 0.f;
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        const float factor = ex2(p.pmax[h] - s_lse[h]);
#pragma unroll
        for (int i = 0; i < SLOT_ITERS; ++i) {
            best[i][0] = fmaxf(best[i][0], h2f(p.probs[h][i] & 0xFFFFu) * factor);
            best[i][1] = fmaxf(best[i][1], h2f(p.probs[h][i] >> 16) * factor);
        }
    }
#pragma unroll
    for (int i = 0; i < SLOT_ITERS; ++i) {
        const int slot = 2 * lane + 64 * i;
        if (slot < p.count) p.dst[slot] = p.score[i][0] + best[i][0];
        if (slot + 1 < p.count) p.dst[slot + 1] = p.score[i][1] + best[i][1];
    }
}

constexpr int ACC_EARLY = MAX_SLOTS < 4 ? MAX_SLOTS : 4;  // slots of a thread's first output element loaded early

// The first 32 slots' partial (m, l) of the query heads warp, warp + NW, ... (slot lane of each; -inf / 0 past
// num_slots): issued early, since they depend on the row slot alone.
template <int NW>
struct SlotStates {
    float m[(GROUP + NW - 1) / NW], l[(GROUP + NW - 1) / NW];
};
template <int NW>
__device__ __forceinline__ void load_slot_states(SlotStates<NW>& st, const float* __restrict__ part_m,
                                                 const float* __restrict__ part_l, long long base, int num_slots,
                                                 int warp, int lane) {
#pragma unroll
    for (int k = 0; k < (GROUP + NW - 1) / NW; ++k) {
        const int h = warp + k * NW;
        const bool ok = h < GROUP && lane < num_slots;
        st.m[k] = ok ? ws_load(part_m + (base + lane) * GROUP_PAD + h) : NEG_INF;
        st.l[k] = ok ? ws_load(part_l + (base + lane) * GROUP_PAD + h) : 0.f;
    }
}

// The merge of the row's num_slots partial states by NW warps (warp w takes heads w, w + NW, ...): m_safe, 1 / l,
// lse = m_safe + log2 l (inf for an empty row) into s_inv / s_lse, the slots' weights 2^(m_s - m_safe) into s_w (the
// Triton merge's arithmetic). EARLY: slot lane's (m, l) from st (load_slot_states), the slots from 32 on loaded
// here; else every slot loaded here as its head is reached (the fused kernel: nothing held beside its pages). The
// caller syncs the block before reading the shared arrays.
template <bool EARLY, int NW>
__device__ __forceinline__ void merge_states(const SlotStates<NW>& st, const float* __restrict__ part_m,
                                             const float* __restrict__ part_l, long long base, int num_slots, int warp,
                                             int lane, float (*s_w)[GROUP], float* s_inv, float* s_lse) {
#pragma unroll
    for (int k = 0; k < (GROUP + NW - 1) / NW; ++k) {
        const int h = warp + k * NW;
        if (h >= GROUP) break;
        const int s0 = EARLY ? lane + 32 : lane;  // the first slot this lane loads here
        float mx = EARLY ? st.m[k] : NEG_INF;
        for (int s = s0; s < num_slots; s += 32) mx = fmaxf(mx, ws_load(part_m + (base + s) * GROUP_PAD + h));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_safe = (mx == NEG_INF) ? 0.f : mx;
        float l = 0.f;
        if (EARLY && lane < num_slots) {
            const float w = (st.m[k] == NEG_INF) ? 0.f : ex2(st.m[k] - m_safe);
            s_w[lane][h] = w;
            l += w * st.l[k];
        }
        for (int s = s0; s < num_slots; s += 32) {
            const float ms = ws_load(part_m + (base + s) * GROUP_PAD + h);
            const float w = (ms == NEG_INF) ? 0.f : ex2(ms - m_safe);
            s_w[s][h] = w;
            l += w * ws_load(part_l + (base + s) * GROUP_PAD + h);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) {
            s_inv[h] = (l > 0.f) ? 1.f / l : 0.f;
            s_lse[h] = (l > 0.f) ? m_safe + log2f(l) : POS_INF;
        }
    }
}

// The first ACC_EARLY slots' accumulators of output element `first` (0 past the row's elements or num_slots).
__device__ __forceinline__ void load_first_output(float (&acc)[ACC_EARLY], const float* __restrict__ part_acc,
                                                  long long base, int num_slots, int first) {
#pragma unroll
    for (int i = 0; i < ACC_EARLY; ++i)
        acc[i] = (first < GROUP * HEAD_DIM && i < num_slots)
                     ? ws_load(part_acc + ((base + i) * GROUP_PAD + first / HEAD_DIM) * BLOCK_D + first % HEAD_DIM)
                     : 0.f;
}

// Output elements e = first, first + stride, ... of the row's GROUP x HEAD_DIM (after merge_states and a barrier);
// element `first`'s first NE slots from acc (load_first_output; NE = 0: every slot loaded here, acc unused).
template <int NE>
__device__ __forceinline__ void write_output(u16* __restrict__ out, const float* __restrict__ part_acc, long long base,
                                             int num_slots, int rs, int first, int stride,
                                             const float (*s_w)[GROUP], const float* s_inv, const float* acc) {
    for (int e = first; e < GROUP * HEAD_DIM; e += stride) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM;
        float a = 0.f;
        int s = 0;
        if (NE > 0 && e == first) {
#pragma unroll
            for (int i = 0; i < NE; ++i)
                if (i < num_slots) a += s_w[i][h] * acc[i];
            s = NE;
        }
        for (; s < num_slots; ++s) a += s_w[s][h] * ws_load(part_acc + ((base + s) * GROUP_PAD + h) * BLOCK_D + d);
        out[((long long)rs * GROUP + h) * HEAD_DIM + d] = f2out(a * s_inv[h]);
    }
}

#if !FUSED_MERGE
#ifndef MERGE_MIN_BLOCKS
#define MERGE_MIN_BLOCKS 1
#endif
// The loads of diffkv_decode_merge are issued in three rounds, each as soon as its addresses are known, so that a
// CTA waits for three memory round trips instead of six (row id; tier counts; page table; page scores; partial m;
// partial l and accumulators, one after the other, before):
//   1. what needs only the row slot rs: the row id, the (m, l) of slots lane and lane + 32 ... (the first 32 here)
//      of the warp's heads, and the first ACC_EARLY slots' accumulators of the thread's first output element;
//   2. what needs the row id: the tier counts and the table entries of the CTA's SCORE_PAGES table positions
//      (position-indexed: CTA z covers positions [z SCORE_PAGES, (z + 1) SCORE_PAGES); a position < hp holds high
//      page pos, one >= R - lp low page R - 1 - pos, the rest none);
//   3. after the merge and the output (whose values arrived with round 1), what needs the counts and page ids:
//      the pages' probabilities, maxima and old scores; then the update.
// diffkv_decode_attend's merging CTA runs the same functions (bit for bit the same arithmetic).
extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32, MERGE_MIN_BLOCKS)
diffkv_decode_merge(u16* __restrict__ out, const float* __restrict__ part_m, const float* __restrict__ part_l,
                    const float* __restrict__ part_acc, float* __restrict__ lse_out, unsigned char* __restrict__ pool,
                    const int* __restrict__ table, const int* __restrict__ tier_tokens,
                    const int* __restrict__ row_ids, const u16* __restrict__ page_probs,
                    const float* __restrict__ page_max, int num_kv_heads, int num_slots, int R) {
    __shared__ float s_w[MAX_SLOTS][GROUP];
    __shared__ float s_inv[GROUP], s_lse[GROUP];
    const int seq = blockIdx.x, kvh = blockIdx.y, z = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rs = seq * num_kv_heads + kvh;
    const long long base = (long long)rs * num_slots;
    // round 1
#if SCORES
    const int row = row_ids[rs];
#endif
    SlotStates<MERGE_WARPS> st;
    load_slot_states(st, part_m, part_l, base, num_slots, warp, lane);
    const int e0 = z * MERGE_WARPS * 32 + threadIdx.x;
    float acc[ACC_EARLY];
    load_first_output(acc, part_acc, base, num_slots, e0);
    // round 2
#if SCORES
    RowPages rp;
    rp.row = row;
    rp.n_high = row >= 0 ? tier_tokens[2 * (long long)row] : 0;
    rp.n_low = row >= 0 ? tier_tokens[2 * (long long)row + 1] : 0;
    int page[PAGES_PER_WARP];
#pragma unroll
    for (int k = 0; k < PAGES_PER_WARP; ++k) {
        const int pos = z * SCORE_PAGES + warp + k * MERGE_WARPS;
        page[k] = (row >= 0 && pos < R) ? table[(long long)row * R + pos] : -1;
    }
#endif
    merge_states<true>(st, part_m, part_l, base, num_slots, warp, lane, s_w, s_inv, s_lse);
    __syncthreads();
    if (z == 0 && threadIdx.x < GROUP) lse_out[(long long)rs * GROUP_PAD + threadIdx.x] = s_lse[threadIdx.x];
    write_output<ACC_EARLY>(out, part_acc, base, num_slots, rs, e0, gridDim.z * MERGE_WARPS * 32, s_w, s_inv, acc);
#if SCORES
    // round 3, then the update
    rp.hp = (rp.n_high + H_TOKENS - 1) / H_TOKENS;
    rp.lp = (rp.n_low + L_TOKENS - 1) / L_TOKENS;
    ScorePage sp[PAGES_PER_WARP];
#pragma unroll
    for (int k = 0; k < PAGES_PER_WARP; ++k) {
        const int pos = z * SCORE_PAGES + warp + k * MERGE_WARPS;
        sp[k].count = 0;
        sp[k].dst = nullptr;
        if (pos < rp.hp) {
            load_cell(sp[k], pos, true, min(rp.n_high - pos * H_TOKENS, H_TOKENS), page[k], rs, R, pool, page_probs,
                      page_max, lane);
        } else if (pos >= R - rp.lp && pos < R) {
            const int j = R - 1 - pos;
            load_cell(sp[k], pos, false, min(rp.n_low - j * L_TOKENS, L_TOKENS), page[k], rs, R, pool, page_probs,
                      page_max, lane);
        }
    }
#pragma unroll
    for (int k = 0; k < PAGES_PER_WARP; ++k) apply_score_page(sp[k], s_lse, lane);
#endif
}
#endif  // !FUSED_MERGE

#if FUSED_MERGE
// The partial kernel, merge and score update in one launch (compiled after the whole of decode_partial.cu, with both
// files' macros and FUSED_MERGE=1). Grid (num_slots, num_kv_heads, num_seqs): a row's CTAs are neighbours in launch
// order, so they run at about the same time. Each CTA does partial_cta's work, then counts itself done on the row's
// counter (row_done, zero before the launch; the classic threadfence-reduction handshake: every thread's writes are
// fenced before one thread's atomicAdd); the row's last CTA resets the counter (for the next launch) and does what
// diffkv_decode_merge does for the row: the merge of the row's num_slots partial states, its output and lse, and the
// score update of every page of the row, PAGES_PER_WARP pages a warp at a time (their score segments, probabilities
// and maxima were prefetched into L2 by the CTAs that read the pages). One launch a layer instead of two, no CTA of the merge grid
// left without pages (that grid spans the page table's width), and the probabilities read back from L2.
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
diffkv_decode_attend(const u16* __restrict__ q, unsigned char* __restrict__ pool, const int* __restrict__ table,
                     const int* __restrict__ tier_tokens, const int* __restrict__ row_ids, float* __restrict__ part_m,
                     float* __restrict__ part_l, float* __restrict__ part_acc, u16* __restrict__ page_probs,
                     float* __restrict__ page_max, float qk_scale, int num_kv_heads, int num_slots, int R,
                     u16* __restrict__ out, float* __restrict__ lse_out, int* __restrict__ row_done) {
    __shared__ float s_w[MAX_SLOTS][GROUP];
    __shared__ float s_inv[GROUP], s_lse[GROUP];
    __shared__ int s_last;
    const int seq = blockIdx.z, kvh = blockIdx.y;
    partial_cta<SCORES != 0>(seq, kvh, blockIdx.x, q, pool, table, tier_tokens, row_ids, part_m, part_l, part_acc,
                             page_probs, page_max, qk_scale, num_kv_heads, num_slots, R);
    const int rs = seq * num_kv_heads + kvh;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(row_done + rs, 1) + 1;
        s_last = done == num_slots;
        if (done == num_slots) row_done[rs] = 0;  // every CTA of the row has counted: ready for the next launch
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long base = (long long)rs * num_slots;
#if SCORES
    const RowPages rp = row_pages(tier_tokens, row_ids, rs);
    ScorePage sp[PAGES_PER_WARP];
#pragma unroll
    for (int k = 0; k < PAGES_PER_WARP; ++k)
        load_score_page(sp[k], warp + k * WARPS, rp, rs, R, pool, table, page_probs, page_max, lane);
#endif
    // no early loads here: they would stay live beside the pages' registers (spills at the partial kernel's cap)
    const SlotStates<WARPS> st{};
    merge_states<false>(st, part_m, part_l, base, num_slots, warp, lane, s_w, s_inv, s_lse);
    __syncthreads();
    if (threadIdx.x < GROUP) lse_out[(long long)rs * GROUP_PAD + threadIdx.x] = s_lse[threadIdx.x];
    write_output<0>(out, part_acc, base, num_slots, rs, threadIdx.x, WARPS * 32, s_w, s_inv, nullptr);
#if SCORES
    for (int first = 0;; first += WARPS * PAGES_PER_WARP) {
#pragma unroll
        for (int k = 0; k < PAGES_PER_WARP; ++k) apply_score_page(sp[k], s_lse, lane);
        const int next = first + WARPS * PAGES_PER_WARP;
        if (next >= rp.hp + rp.lp) break;
#pragma unroll
        for (int k = 0; k < PAGES_PER_WARP; ++k)
            load_score_page(sp[k], next + warp + k * WARPS, rp, rs, R, pool, table, page_probs, page_max, lane);
    }
#endif
}
#endif  // FUSED_MERGE
