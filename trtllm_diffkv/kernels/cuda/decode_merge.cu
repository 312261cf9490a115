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
//      2-byte loads where PMAX is odd, e.g. the default-k8v2 preset's 35-token low pages). The
//      pages' probabilities, maxima and old scores are loaded first, before step 1, since they do not depend on
//      the merge: the row's chain of dependent loads (row id, tier counts, page table, page) overlaps the merge's.
//   A padding row (row_ids < 0) has empty partial states: zeros out, lse inf, no score touched.
//
// Compile-time configuration (-D): GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, PMAX, PAGE_BYTES, MAX_SLOTS (>= 2 x the
// workspace's partitions), OUT_BF16 (the output's dtype: 1 bf16, 0 fp16), SCORES, MERGE_WARPS, PAGES_PER_WARP, and per tier
// H_TOKENS / L_TOKENS, H_SC / L_SC (score segment byte offsets). kernels/cuda_decode.py sets them.

// Compiled after the helpers at the top of decode_partial.cu (u32 / u16 / u64, NEG_INF, h2f, ex2, ...), which
// kernels/cuda_decode.py (merge_source) puts before this text.

#define POS_INF (__int_as_float(0x7f800000))

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

// A warp's pages' probabilities, maxima and scores, loaded before the merge (they do not depend on it).
struct ScorePage {
    u32 probs[GROUP][SLOT_ITERS];  // slots 2 lane, 2 lane + 1 (+ 64 i) of each head: fp16 pairs (low half first)
    float pmax[GROUP];
    float score[SLOT_ITERS][2];
    float* dst;                    // the page's score segment (nullptr: no page)
    int count;
};

extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32)
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
#if SCORES
    const int row = row_ids[rs];
    ScorePage sp[PAGES_PER_WARP];
    {
        int n_high = 0, n_low = 0;
        if (row >= 0) {
            n_high = tier_tokens[2 * (long long)row];
            n_low = tier_tokens[2 * (long long)row + 1];
        }
        const int hp = (n_high + H_TOKENS - 1) / H_TOKENS;
        const int lp = row >= 0 ? (n_low + L_TOKENS - 1) / L_TOKENS : 0;
#pragma unroll
        for (int k = 0; k < PAGES_PER_WARP; ++k) {
            const int u = z * SCORE_PAGES + warp + k * MERGE_WARPS;
            ScorePage& p = sp[k];
            p.count = 0;
            p.dst = nullptr;
            if (u >= hp + lp) continue;
            const bool high = u < hp;
            const int j = high ? u : u - hp;
            const int pos = high ? u : R - 1 - j;
            p.count = high ? min(n_high - j * H_TOKENS, H_TOKENS) : min(n_low - j * L_TOKENS, L_TOKENS);
            const long long cell = (long long)rs * R + pos;
            const int page = table[(long long)row * R + pos];
            p.dst = (float*)(pool + (u64)page * PAGE_BYTES + (high ? H_SC : L_SC));
            const u16* probs = page_probs + cell * GROUP * PMAX;
#pragma unroll
            for (int h = 0; h < GROUP; ++h) {
                p.pmax[h] = page_max[cell * GROUP + h];
#pragma unroll
                for (int i = 0; i < SLOT_ITERS; ++i) {
                    const int slot = 2 * lane + 64 * i;
                    const u16* ph = probs + h * PMAX + slot;
                    if constexpr (PAIR_LOADS) {
                        p.probs[h][i] = (slot < p.count) ? *(const u32*)ph : 0u;
                    } else {
                        p.probs[h][i] = ((slot < p.count) ? (u32)ph[0] : 0u) | ((slot + 1 < p.count) ? (u32)ph[1] << 16 : 0u);
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
    }
#endif
    for (int h = warp; h < GROUP; h += MERGE_WARPS) {
        float mx = NEG_INF;
        for (int s = lane; s < num_slots; s += 32) mx = fmaxf(mx, part_m[(base + s) * GROUP_PAD + h]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_safe = (mx == NEG_INF) ? 0.f : mx;
        float l = 0.f;
        for (int s = lane; s < num_slots; s += 32) {
            const float ms = part_m[(base + s) * GROUP_PAD + h];
            const float w = (ms == NEG_INF) ? 0.f : ex2(ms - m_safe);
            s_w[s][h] = w;
            l += w * part_l[(base + s) * GROUP_PAD + h];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) {
            s_inv[h] = (l > 0.f) ? 1.f / l : 0.f;
            s_lse[h] = (l > 0.f) ? m_safe + log2f(l) : POS_INF;
        }
    }
    __syncthreads();
    if (z == 0 && threadIdx.x < GROUP) lse_out[(long long)rs * GROUP_PAD + threadIdx.x] = s_lse[threadIdx.x];
    const int step = gridDim.z * MERGE_WARPS * 32;
    for (int e = z * MERGE_WARPS * 32 + threadIdx.x; e < GROUP * HEAD_DIM; e += step) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM;
        float a = 0.f;
        for (int s = 0; s < num_slots; ++s) a += s_w[s][h] * part_acc[((base + s) * GROUP_PAD + h) * BLOCK_D + d];
        out[((long long)rs * GROUP + h) * HEAD_DIM + d] = f2out(a * s_inv[h]);
    }
#if SCORES
    // score += max over the heads of p_h 2^(page_max_h - lse_h) (diffkv_decode_scores' arithmetic, in its order)
#pragma unroll
    for (int k = 0; k < PAGES_PER_WARP; ++k) {
        const ScorePage& p = sp[k];
        if (p.dst == nullptr) continue;
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
#endif
}
