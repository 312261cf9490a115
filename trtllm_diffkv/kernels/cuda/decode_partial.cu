// DiffKV paged decode attention: the partial kernel in CUDA C++ (sm_80+: mma.sync m16n8k16, movmatrix).
//
// Same contract as _decode_partial_kernel in attn_decode_kernels.py (the Triton path): it fills the
// DecodeWorkspace's part_m / part_l / part_acc (one slot per CTA) and, with STORE_PROBS, page_probs /
// page_max, which the Triton merge and score kernels then consume unchanged.
//
// Layout of the work:
//   grid (num_seqs, num_kv_heads, NSLOT); block WARPS warps. A row's pages, high tier then low tier
//   (one list), are split in NSLOT contiguous chunks, one per CTA; the CTA's warps take the chunk's pages
//   in turn (page u goes to warp u % WARPS). Each warp keeps its own online-softmax state over the pages
//   it reads (no barrier in the page loop); at the end the warps merge through shared memory and the
//   CTA writes one workspace slot.
//   Pages reach the warp through a ring of STAGES page buffers in shared memory (cp.async, filled STAGES - 1
//   pages ahead; staged_loop below), or with STAGES = 0 straight from global memory into registers (the
//   TensorRT AOT build). One page per loop step, in tiles of 16 tokens. Per tile:
//     S^T[token, head] = K[token, :] . Q^T[:, head]: mma with A = key codes (16 tokens x 16 dims per
//       k-step; codes loaded straight into the A fragment registers and made exact fp16 integers by
//       the 0x64 exponent-byte trick, no shared memory) and B = the query (8 heads, the GQA group,
//       n = 8). Dequantization is folded out: per token and key group, q.k = s (q.c) + z sum(q), so
//       each key group accumulates its own product.
//     out^T[dim, head] += V^T[dim, token] . P^T[token, head]: A = value codes dequantized in fp16
//       registers (one fma per two elements), B = the probabilities, moved from the first product's
//       accumulator layout into the B layout by movmatrix.trans.
//   Element orders inside a fragment are free as long as both operands agree: keys use the order the
//   bytes arrive in (key_dim() below, mirrored by the query fragments); values give each lane a
//   contiguous run of HEAD_DIM / 8 dims (row g of value tile i is dim (HEAD_DIM / 8) * g + 2 i, row
//   g + 8 is that + 1).
//
// Compile-time configuration (-D): HEAD_DIM (64 | 128), GROUP (<= 8), GROUP_PAD, BLOCK_D, PMAX,
// PAGE_BYTES, STORE_PROBS, WARPS, MIN_BLOCKS, STAGES (0: registers; >= 2: the shared-memory page ring), Q_BF16; per tier
// (H_ high, L_ low): TOKENS, KB (8 | 4), KG, VB (8 | 4 | 2),
// VG, KC, KM, VC, VM (segment byte offsets inside a page), COPY (bytes staged: the code and scale segments). Supported combinations are checked by
// kernels/cuda_decode.py before compiling.

#ifndef KEY_FOLD
#define KEY_FOLD 1
#endif
#ifndef Q_BF16
#define Q_BF16 0  // 1: q is bf16, rounded to fp16 as it is loaded (as torch's .to(float16) rounds it)
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// (x & mask) | 0x64006400: two codes under the fp16 exponent of 1024 (1024 + code << shift, exact)
__device__ __forceinline__ u32 magic(u32 x, u32 mask) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(0x64006400u));
    return r;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float h2f(u32 h) {
    float f;
    u16 x = (u16)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

// bf16 bits -> fp16 bits, round to nearest even (bf16 -> fp32 is exact)
__device__ __forceinline__ u32 bf2h(u32 b) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(__uint_as_float(b << 16)));
    return r;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Entry u of a row's page list (high pages first, hp of them, then the low pages): its table column (high page j at
// column j, low page j at R - 1 - j), tier and token count. The partial, score and merge kernels all walk it.
struct PageRef {
    int pos, count;
    bool low;
};
__device__ __forceinline__ PageRef page_ref(int u, int hp, int n_high, int n_low, int R) {
    PageRef r;
    r.low = u >= hp;
    r.pos = r.low ? R - 1 - (u - hp) : u;
    r.count = r.low ? min(n_low - (u - hp) * L_TOKENS, L_TOKENS) : min(n_high - u * H_TOKENS, H_TOKENS);
    return r;
}

// A load the compiler does not merge with an earlier load of the same address (a volatile access; an asm load
// instead made NVRTC drop the read-only path from the kernel's other loads of these arrays).
__device__ __forceinline__ int ld_volatile(const int* p) {
    return *reinterpret_cast<const volatile int*>(p);
}

// Row rs's page-list bounds: its pool row (-1: padding), tier token counts and page counts (hp high, lp low).
// AGAIN: loaded with ld_volatile (a second read the compiler keeps apart from the first).
struct RowPages {
    int row, n_high, n_low, hp, lp;
};

template <bool AGAIN = false>
__device__ __forceinline__ RowPages row_pages(const int* __restrict__ tier_tokens, const int* __restrict__ row_ids,
                                              int rs) {
    RowPages r;
    const auto load = [](const int* p) { return AGAIN ? ld_volatile(p) : *p; };
    r.row = load(row_ids + rs);
    r.n_high = r.row >= 0 ? load(tier_tokens + 2 * (long long)r.row) : 0;
    r.n_low = r.row >= 0 ? load(tier_tokens + 2 * (long long)r.row + 1) : 0;
    r.hp = (r.n_high + H_TOKENS - 1) / H_TOKENS;
    r.lp = (r.n_low + L_TOKENS - 1) / L_TOKENS;
    return r;
}

// (end of the helpers cuda/decode_merge.cu is compiled after: kernels/cuda_decode.py, merge_source)
__device__ __forceinline__ u32 movtrans(u32 x) {
    u32 r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// N consecutive 32-bit words from a 4N-byte aligned address (0 when !ok); N = 1 may be a half word.
template <int BYTES>
__device__ __forceinline__ void load_words(const unsigned char* p, bool ok, u32* w) {
    if constexpr (BYTES == 2) {
        w[0] = ok ? (u32)(*(const u16*)p) : 0u;
    } else if constexpr (BYTES == 4) {
        w[0] = ok ? *(const u32*)p : 0u;
    } else if constexpr (BYTES == 8) {
        uint2 v = ok ? *(const uint2*)p : make_uint2(0u, 0u);
        w[0] = v.x; w[1] = v.y;
    } else if constexpr (BYTES == 16) {
        uint4 v = ok ? *(const uint4*)p : make_uint4(0u, 0u, 0u, 0u);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else {
        static_assert(BYTES % 16 == 0, "chunk of 16-byte multiples");
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) load_words<16>(p + 16 * i, ok, w + 4 * i);
    }
}

// Slot pairs stay inside a head's PMAX probabilities and 4-byte aligned when every count is even.
constexpr bool PAIR_STORES = PMAX % 2 == 0 && H_TOKENS % 2 == 0 && L_TOKENS % 2 == 0;
constexpr int MT = HEAD_DIM / 16;  // value tiles (m16) per head; also key k-steps
constexpr int DPT = HEAD_DIM / 8;  // value dims per lane

// One tier's format and the fragment maps that follow from it.
template <int TOKENS_, int KB_, int KG_, int VB_, int VG_, int KC_, int KM_, int VC_, int VM_>
struct Tier {
    static constexpr int TOKENS = TOKENS_, KB = KB_, KG = KG_, VB = VB_, VG = VG_;
    static constexpr int KC = KC_, KM = KM_, VC = VC_, VM = VM_;
    static constexpr int NT = (TOKENS + 15) / 16;          // 16-token tiles per page
    // keys: each key group's bytes of a token are split over the 4 lanes of a quad
    static constexpr int KROW = HEAD_DIM * KB / 8;         // key bytes per token
    static constexpr int GS = HEAD_DIM / KG;               // dims per key group
    static constexpr int GBY = GS * KB / 8;                // key bytes per token and group
    static constexpr int CB = GBY / 4;                     // ... per lane
    static constexpr int NW = CB / 4;                      // 32-bit words per lane, token and group
    static constexpr int KSG = GS / 16;                    // k-steps per key group
    // values: each lane holds DPT contiguous dims of a token
    static constexpr int VROW = HEAD_DIM * VB / 8;
    static constexpr int VCB = DPT * VB / 8;               // value bytes per lane and token
    static constexpr int NVW = (VCB + 3) / 4;
    static constexpr int GSV = HEAD_DIM / VG;
    static_assert(KB == 8 || KB == 4, "key bits 8 or 4");
    static_assert(VB == 8 || VB == 4 || VB == 2, "value bits 8, 4 or 2");
    static_assert(CB >= 4 && CB % 4 == 0, "a lane's key chunk must be whole words");
    static_assert(KB == 8 ? NW == KSG : 2 * NW == KSG, "key words per k-step");
    static_assert(VCB >= 2 && GSV % DPT == 0, "a lane's value dims inside one group");

    // head dim of element e (0..3: k = 2t, 2t+1, 2t+8, 2t+9) of k-step j for quad lane t
    __device__ static int key_dim(int j, int t, int e) {
        const int gk = j / KSG, js = j % KSG;
        if (KB == 8) {
            return gk * GBY + t * CB + 4 * js + e;               // byte = dim
        } else {
            const int o = gk * GBY + t * CB + 4 * (js / 2);      // the word's first byte
            const int b = (e == 0) ? 0 : (e == 1) ? 2 : (e == 2) ? 1 : 3;
            return 2 * (o + b) + (js % 2);                      // low nibble: even dim, high: odd
        }
    }
};

typedef Tier<H_TOKENS, H_KB, H_KG, H_VB, H_VG, H_KC, H_KM, H_VC, H_VM> HighTier;
typedef Tier<L_TOKENS, L_KB, L_KG, L_VB, L_VG, L_KC, L_KM, L_VC, L_VM> LowTier;
constexpr int MAX_KG = (H_KG > L_KG) ? H_KG : L_KG;

struct WarpState {
    float m[2];        // running max (base 2) of heads 2t, 2t+1
    float l[2];        // this lane's part of the sums
    float acc[MT][4];  // out^T fragments: dims (row g, g + 8 of tile i) x heads 2t, 2t+1
};

// Query fragments (B operand, n = head g) for one tier's key element order, and the per-group query sums
// of heads 2t, 2t+1 (C layout). The four lanes of a quad hold every dim of head g once (key_dim() is a
// bijection per k-step group), so a group's sum is the quad's fragment sum: two xor shuffles, then each lane
// fetches heads 2t and 2t+1 from quads 2t and 2t+1 (a serial 128-term loop per lane cost ~2 us per warp
// and tier, on the order of the CTA's page loop at Llama-3-8B 48 x 4096).
template <class T>
__device__ __forceinline__ void load_query(const u16* __restrict__ qrow, int g, int t, u32 (&qf)[MT][2],
                                           float (&qsum)[MAX_KG][2]) {
    float part[MAX_KG];
#pragma unroll
    for (int gk = 0; gk < MAX_KG; ++gk) part[gk] = 0.f;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        u32 h[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 x = (g < GROUP) ? (u32)qrow[g * HEAD_DIM + T::key_dim(j, t, e)] : 0u;
            h[e] = Q_BF16 ? bf2h(x) : x;
        }
        qf[j][0] = h[0] | (h[1] << 16);
        qf[j][1] = h[2] | (h[3] << 16);
        part[j / T::KSG] += (h2f(h[0]) + h2f(h[1])) + (h2f(h[2]) + h2f(h[3]));
    }
#pragma unroll
    for (int gk = 0; gk < MAX_KG; ++gk) {
        float s = part[gk];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float v = __shfl_sync(0xffffffffu, s, 4 * (2 * t + c));
            qsum[gk][c] = (gk < T::KG) ? v : 0.f;
        }
    }
}

// Codes of value element e of tokens A, B (their words wa, wb) dequantized: half2 (v_A, v_B).
template <class T, int E>
__device__ __forceinline__ u32 dequant_pair(const u32* wa, const u32* wb, u32 s2, u32 z2) {
    constexpr int BIT = E * T::VB;
    constexpr int BYTE = BIT >> 3, SH = BIT & 7, WORD = BYTE >> 2, BB = BYTE & 3;
    constexpr u32 SEL = BB | (BB << 4) | ((BB + 4) << 8) | ((BB + 4) << 12);
    constexpr u32 M = ((1u << T::VB) - 1u) << SH;
    const u32 x = prmt(wa[WORD], wb[WORD], SEL);
    const u32 h = magic(x, M | (M << 16));                                   // 1024 + code << SH
    constexpr u32 SCALE = (u32)((15 - SH) << 10);                            // 2^-SH
    constexpr u32 OFFS = 0x8000u | (u32)((25 - SH) << 10);                   // -1024 * 2^-SH
    const u32 c = hfma2(h, SCALE | (SCALE << 16), OFFS | (OFFS << 16));      // the codes, exact
    return hfma2(c, s2, z2);
}

template <class T>
__device__ __forceinline__ void value_tile(const u32 (&vw)[4][T::NVW], const u32 (&vm)[4], u32 pb0, u32 pb1,
                                           float (&acc)[MT][4]) {
    const u32 s01 = prmt(vm[0], vm[1], 0x5410), z01 = prmt(vm[0], vm[1], 0x7632);
    const u32 s89 = prmt(vm[2], vm[3], 0x5410), z89 = prmt(vm[2], vm[3], 0x7632);
#define DIFFKV_VALUE_TILE(I)                                                                          \
    if constexpr ((I) < MT) {                                                                         \
        const u32 a0 = dequant_pair<T, 2 * (I)>(vw[0], vw[1], s01, z01);                              \
        const u32 a1 = dequant_pair<T, 2 * (I) + 1>(vw[0], vw[1], s01, z01);                          \
        const u32 a2 = dequant_pair<T, 2 * (I)>(vw[2], vw[3], s89, z89);                              \
        const u32 a3 = dequant_pair<T, 2 * (I) + 1>(vw[2], vw[3], s89, z89);                          \
        mma16816(acc[I], a0, a1, a2, a3, pb0, pb1);                                                   \
    }
    DIFFKV_VALUE_TILE(0) DIFFKV_VALUE_TILE(1) DIFFKV_VALUE_TILE(2) DIFFKV_VALUE_TILE(3)
    DIFFKV_VALUE_TILE(4) DIFFKV_VALUE_TILE(5) DIFFKV_VALUE_TILE(6) DIFFKV_VALUE_TILE(7)
#undef DIFFKV_VALUE_TILE
}

// One page of one tier: logits, the page's max, probabilities (stored for the score update), values.
template <class T, bool SMEM>
__device__ __forceinline__ void page_step(const unsigned char* __restrict__ page, int count, int g, int t,
                                          const u32 (&qf)[MT][2], const float (&qsum)[MAX_KG][2],
                                          float qk_scale, WarpState& st, u16* __restrict__ probs_page,
                                          float* __restrict__ max_page) {
    constexpr int NT = T::NT;
    u32 kw[NT][2][T::KG][T::NW];
    u32 km[NT][2][T::KG];
    u32 vw[NT][4][T::NVW];
    u32 vm[NT][4];
    const int vgrp = (DPT * g) / T::GSV;
    auto load_keys = [&](int tau) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int slot = 16 * tau + g + 8 * r;
            const bool ok = slot < count;
#pragma unroll
            for (int gk = 0; gk < T::KG; ++gk) {
                load_words<T::CB>(page + T::KC + slot * T::KROW + gk * T::GBY + t * T::CB, ok, kw[tau][r][gk]);
                km[tau][r][gk] = ok ? *(const u32*)(page + T::KM + (slot * T::KG + gk) * 4) : 0u;
            }
        }
    };
    auto load_values = [&](int tau) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int slot = 16 * tau + 2 * t + (r & 1) + 8 * (r >> 1);
            const bool ok = slot < count;
            load_words<T::VCB>(page + T::VC + slot * T::VROW + g * T::VCB, ok, vw[tau][r]);
            vm[tau][r] = ok ? *(const u32*)(page + T::VM + (slot * T::VG + vgrp) * 4) : 0u;
        }
    };
    // From global memory every load of the page is issued before any use (one latency a page); from the shared
    // page ring each tile is read where it is used (short live ranges: fewer registers, more warps).
    if constexpr (!SMEM) {
#pragma unroll
        for (int tau = 0; tau < NT; ++tau) { load_keys(tau); load_values(tau); }
    }
    // logits [tile][c0..c3]: c0 (token g, head 2t), c1 (g, 2t+1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1)
    float lg[NT][4];
    // KEY_FOLD: the products run on 1024 + code (the codes under the fp16 exponent of 1024, no subtraction), so
    // q.(1024 + c) = q.c + 1024 sum(q) and the logit is s q.(1024 + c) + (z - 1024 s) sum(q), the offset folded into
    // the zero-point term (fp32; one fma a token and group instead of a half2 subtraction per two codes).
    auto key_code = [](u32 h) { return KEY_FOLD ? h : hsub2(h, 0x64006400u); };
#pragma unroll
    for (int tau = 0; tau < NT; ++tau) {
        if constexpr (SMEM) load_keys(tau);
        float c[T::KG][4];
#pragma unroll
        for (int gk = 0; gk < T::KG; ++gk) {
            c[gk][0] = c[gk][1] = c[gk][2] = c[gk][3] = 0.f;
#pragma unroll
            for (int js = 0; js < T::KSG; ++js) {
                u32 a0, a1, a2, a3;
                if constexpr (T::KB == 8) {
                    const u32 w0 = kw[tau][0][gk][js], w1 = kw[tau][1][gk][js];
                    a0 = key_code(prmt(w0, 0x64646464u, 0x4140));
                    a1 = key_code(prmt(w1, 0x64646464u, 0x4140));
                    a2 = key_code(prmt(w0, 0x64646464u, 0x4342));
                    a3 = key_code(prmt(w1, 0x64646464u, 0x4342));
                } else {
                    const int sh = 4 * (js & 1);
                    const u32 w0 = kw[tau][0][gk][js >> 1] >> sh, w1 = kw[tau][1][gk][js >> 1] >> sh;
                    a0 = key_code(magic(w0, 0x000F000Fu));
                    a1 = key_code(magic(w1, 0x000F000Fu));
                    a2 = key_code(magic(w0 >> 8, 0x000F000Fu));
                    a3 = key_code(magic(w1 >> 8, 0x000F000Fu));
                }
                const int j = gk * T::KSG + js;
                mma16816(c[gk], a0, a1, a2, a3, qf[j][0], qf[j][1]);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = i >> 1;
            float x = 0.f;
#pragma unroll
            for (int gk = 0; gk < T::KG; ++gk) {
                const u32 meta = km[tau][r][gk];
                const float sk = h2f(meta & 0xFFFFu);
                const float zk = KEY_FOLD ? fmaf(-1024.f, sk, h2f(meta >> 16)) : h2f(meta >> 16);
                x += sk * c[gk][i] + zk * qsum[gk][i & 1];
            }
            const int slot = 16 * tau + g + 8 * r;
            lg[tau][i] = (slot < count) ? x * qk_scale : NEG_INF;
        }
    }
    // page max per head over the page's tokens (lanes of equal t hold one head's tokens)
    float pm[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int tau = 0; tau < NT; ++tau) {
        pm[0] = fmaxf(pm[0], fmaxf(lg[tau][0], lg[tau][2]));
        pm[1] = fmaxf(pm[1], fmaxf(lg[tau][1], lg[tau][3]));
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        pm[c] = fmaxf(pm[c], __shfl_xor_sync(0xffffffffu, pm[c], 4));
        pm[c] = fmaxf(pm[c], __shfl_xor_sync(0xffffffffu, pm[c], 8));
        pm[c] = fmaxf(pm[c], __shfl_xor_sync(0xffffffffu, pm[c], 16));
    }
    float alpha[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const float m_new = fmaxf(st.m[c], pm[c]);  // finite: the page has >= 1 token
        alpha[c] = ex2(st.m[c] - m_new);            // 0 on the first page (m = -inf)
        st.m[c] = m_new;
        st.l[c] *= alpha[c];
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        st.acc[i][0] *= alpha[0]; st.acc[i][1] *= alpha[1];
        st.acc[i][2] *= alpha[0]; st.acc[i][3] *= alpha[1];
    }
#pragma unroll
    for (int tau = 0; tau < NT; ++tau) {
        if constexpr (SMEM) load_values(tau);
        float p[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            p[i] = ex2(lg[tau][i] - st.m[i & 1]);
            st.l[i & 1] += p[i];
        }
        const u32 pb0 = movtrans(pack_f16x2(p[0], p[1]));  // P^T: tokens 2t, 2t+1 of head g
        const u32 pb1 = movtrans(pack_f16x2(p[2], p[3]));  // tokens 2t + 8, 2t + 9
        if (STORE_PROBS && g < GROUP) {
            // the transposed pairs are two adjacent slots of one head: one 4-byte store each, a quad
            // writing 16 contiguous bytes (a store per probability from the first product's layout cost
            // 33-49 us at Llama-3-8B 64 x 4096 / the default model's 256 x 4096 on the H200)
            const int s0 = 16 * tau + 2 * t;
            u16* hp = probs_page + g * PMAX;
            if constexpr (PAIR_STORES) {
                if (s0 < count) *(u32*)(hp + s0) = pb0;
                if (s0 + 8 < count) *(u32*)(hp + s0 + 8) = pb1;
            } else {
                if (s0 < count) hp[s0] = (u16)pb0;
                if (s0 + 1 < count) hp[s0 + 1] = (u16)(pb0 >> 16);
                if (s0 + 8 < count) hp[s0 + 8] = (u16)pb1;
                if (s0 + 9 < count) hp[s0 + 9] = (u16)(pb1 >> 16);
            }
        }
        value_tile<T>(vw[tau], vm[tau], pb0, pb1, st.acc);
    }
    if (STORE_PROBS && g == 0) {
#pragma unroll
        for (int c = 0; c < 2; ++c)
            if (2 * t + c < GROUP) max_page[2 * t + c] = st.m[c];
    }
}

// A warp's pages of one tier, u = u_first, u_first + WARPS, ... < u_end (list index u; the tier's page j = u - u_base
// sits at table column j, or R - 1 - j for the low tier), read straight from global memory into registers
// (STAGES == 0). (An L2 prefetch of the warp's next page, one bulk cp.async.bulk.prefetch.L2 per page, did not pay
// on the H200: 138.4 against 137.2 us a page-loop launch at Llama-3-8B 48 x 4096 all-high, 153 us two pages ahead;
// tools/sweep_kv_gpu.py, docs/PERFORMANCE.md.)
template <class T, bool LOW>
__device__ __forceinline__ void tier_loop(const unsigned char* __restrict__ pool, const int* __restrict__ trow,
                                          int u_first, int u_end, int u_base, int n_tier, int R, int g, int t,
                                          const u32 (&qf)[MT][2], const float (&qsum)[MAX_KG][2], float qk_scale,
                                          WarpState& st, u16* __restrict__ probs_row, float* __restrict__ max_row) {
    int next = u_first < u_end ? trow[LOW ? R - 1 - (u_first - u_base) : u_first - u_base] : 0;
    for (int u = u_first; u < u_end; u += WARPS) {
        const int pos = LOW ? R - 1 - (u - u_base) : u - u_base;
        const int page = next;  // the next page's id is read before this page's work
        if (u + WARPS < u_end) next = trow[LOW ? R - 1 - (u + WARPS - u_base) : u + WARPS - u_base];
        const int count = min(n_tier - (u - u_base) * T::TOKENS, T::TOKENS);
        page_step<T, false>(pool + (u64)page * PAGE_BYTES, count, g, t, qf, qsum, qk_scale, st,
                     probs_row + (long long)pos * GROUP * PMAX, max_row + (long long)pos * GROUP);
    }
}

// STAGES >= 2: each warp streams its pages through a ring of STAGES page buffers in shared memory with
// cp.async (16-byte chunks, L1 bypassed): while it computes page k, pages k + 1 .. k + STAGES - 1 are in
// flight, so the bytes in flight no longer depend on the registers a warp holds (at the register path's
// 3 CTAs a multiprocessor, 12 warps with one page each in flight, about 80 KB an SM: not enough to cover
// the latency of a loaded H200). A tier's copy covers the page's code and scale segments ([0, H_COPY) or
// [0, L_COPY)), not the scores. No barrier across warps: each warp waits for its own groups
// (cp.async.wait_group) and syncs its lanes (__syncwarp) before reading a buffer and before refilling it.
#ifndef STAGES
#define STAGES 0
#endif
constexpr int STAGE_BYTES = (PAGE_BYTES + 15) / 16 * 16;

__device__ __forceinline__ void cp_async16(unsigned char* dst, const unsigned char* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void stage_page(unsigned char* __restrict__ buf, const unsigned char* __restrict__ pool,
                                           int page, bool low, int lane) {
    const unsigned char* src = pool + (u64)page * PAGE_BYTES;
    const int nbytes = low ? L_COPY : H_COPY;
    for (int c = 16 * lane; c < nbytes; c += 16 * 32) cp_async16(buf + c, src + c);
}

// The warp's pages u = u_first, u_first + WARPS, ... < u_end of both tiers, staged (see above).
__device__ __forceinline__ void staged_loop(unsigned char* __restrict__ ring, const unsigned char* __restrict__ pool,
                                            const int* __restrict__ trow, int u_first, int u_end, int hp, int n_high,
                                            int n_low, int R, int lane, int g, int t, const u16* __restrict__ qrow,
                                            float qk_scale, WarpState& st, u16* __restrict__ probs_row,
                                            float* __restrict__ max_row) {
    const int n_mine = u_first < u_end ? (u_end - u_first + WARPS - 1) / WARPS : 0;
    if (n_mine == 0) return;
    // The page ids of the warp's pages k = 32 b + lane, one table load a lane per 32 pages, fetched a batch ahead
    // (a table load per page, right before its copy, put a dependent global load on every page's critical path).
    auto page_id = [&](int k) {
        return k < n_mine ? trow[page_ref(u_first + k * WARPS, hp, n_high, n_low, R).pos] : 0;
    };
    int ids = page_id(lane), ids_next = page_id(32 + lane);
    auto issue = [&](int k) {
        if (k < n_mine) {
            if (k > 0 && (k & 31) == 0) { ids = ids_next; ids_next = page_id(k + 32 + lane); }
            const int page = __shfl_sync(0xffffffffu, ids, k & 31);
            stage_page(ring + (k % STAGES) * STAGE_BYTES, pool, page, u_first + k * WARPS >= hp, lane);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
    // the query of the first page's tier, read while the first copies are in flight
    u32 qf[MT][2];
    float qsum[MAX_KG][2];
    int loaded = u_first >= hp;  // tier of the query fragments held: 0 high, 1 low
    if (loaded == 0) load_query<HighTier>(qrow, g, t, qf, qsum);
    else load_query<LowTier>(qrow, g, t, qf, qsum);
    for (int k = 0; k < n_mine; ++k) {
        issue(k + STAGES - 1);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const PageRef r = page_ref(u_first + k * WARPS, hp, n_high, n_low, R);
        const unsigned char* buf = ring + (k % STAGES) * STAGE_BYTES;
        u16* probs_page = probs_row + (long long)r.pos * GROUP * PMAX;
        float* max_page = max_row + (long long)r.pos * GROUP;
        if (!r.low) {
            if (loaded != 0) { load_query<HighTier>(qrow, g, t, qf, qsum); loaded = 0; }
            page_step<HighTier, true>(buf, r.count, g, t, qf, qsum, qk_scale, st, probs_page, max_page);
        } else {
            if (loaded != 1) { load_query<LowTier>(qrow, g, t, qf, qsum); loaded = 1; }
            page_step<LowTier, true>(buf, r.count, g, t, qf, qsum, qk_scale, st, probs_page, max_page);
        }
        __syncwarp();
    }
}

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef MERGE_PREFETCH
#define MERGE_PREFETCH 0  // 1: diffkv_decode_partial asks L2 to keep what the merge reads of its pages (score
                          // segments, probabilities, maxima); kernels/cuda_decode.py sets it on the staged path
#endif
#ifndef PREFETCH_RELOAD
#define PREFETCH_RELOAD 0  // the prefetch's two forms (partial_cta): NVRTC spills less with one or the other
                           // depending on the shape; kernels/cuda_decode.py (_spill_free_kernel) picks one
#endif
#ifndef FUSED_MERGE
#define FUSED_MERGE 0  // 1: this text is followed by cuda/decode_merge.cu and its diffkv_decode_attend (kernels/cuda_decode.py)
#endif

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
}

// The entries [u0, u1) of a row's page list that CTA slot cslot of num_slots takes (equal shares, the last shorter).
__device__ __forceinline__ void slot_pages(const RowPages& rp, int num_slots, int cslot, int& u0, int& u1) {
    const int total = rp.hp + rp.lp;
    const int per = (total + num_slots - 1) / num_slots;
    u0 = cslot * per;
    u1 = min(u0 + per, total);
}

// Asks L2 (evict_last) to keep what the row's merge reads next of its page-list entries [u0, u1), the CTA's threads
// striding over them: each page's score segment (read and rewritten), its probabilities and maxima. trow: the row's
// page table row; probs_row / max_row: the row's workspace cells. AGAIN: page ids read with ld_volatile.
template <bool AGAIN>
__device__ __forceinline__ void prefetch_merge_reads(const RowPages& rp, int u0, int u1, const int* __restrict__ trow,
                                                     const unsigned char* __restrict__ pool,
                                                     const u16* __restrict__ probs_row,
                                                     const float* __restrict__ max_row, int R) {
    for (int u = u0 + threadIdx.x; u < u1; u += WARPS * 32) {
        const PageRef r = page_ref(u, rp.hp, rp.n_high, rp.n_low, R);
        const int page = AGAIN ? ld_volatile(trow + r.pos) : trow[r.pos];
        const unsigned char* seg = pool + (u64)page * PAGE_BYTES + (r.low ? L_SC : H_SC);
        for (int c = 0; c < 4 * r.count; c += 128) prefetch_l2(seg + c);
        const unsigned char* pp = (const unsigned char*)(probs_row + (long long)r.pos * GROUP * PMAX);
        for (int c = 0; c < 2 * GROUP * PMAX; c += 128) prefetch_l2(pp + c);
        prefetch_l2(max_row + (long long)r.pos * GROUP);
    }
}

// The work of one CTA: slot cslot of row (seq, kvh), written to the workspace's slot (the kernels below differ in
// the grid's order only and in what follows). PREFETCH: once its partial states are stored the CTA asks L2
// (evict_last) to keep what the row's merge reads next of its pages: their score segments (read and rewritten), the
// probabilities and maxima this CTA has just written (diffkv_decode_attend; diffkv_decode_merge with MERGE_PREFETCH).
template <bool PREFETCH>
__device__ __forceinline__ void partial_cta(int seq, int kvh, int cslot, const u16* __restrict__ q,
                                            const unsigned char* __restrict__ pool, const int* __restrict__ table,
                                            const int* __restrict__ tier_tokens, const int* __restrict__ row_ids,
                                            float* __restrict__ part_m, float* __restrict__ part_l,
                                            float* __restrict__ part_acc, u16* __restrict__ page_probs,
                                            float* __restrict__ page_max, float qk_scale, int num_kv_heads,
                                            int num_slots, int R) {
#if STAGES
    // the page ring (WARPS x STAGES pages), reused for the warps' merge after a barrier
    extern __shared__ __align__(16) unsigned char dyn_smem[];
    float (*sm_m)[8] = reinterpret_cast<float (*)[8]>(dyn_smem);
    float (*sm_l)[8] = sm_m + WARPS;
    float (*sm_acc)[8][HEAD_DIM] = reinterpret_cast<float (*)[8][HEAD_DIM]>(sm_l + WARPS);
#else
    __shared__ float sm_m[WARPS][8], sm_l[WARPS][8];
    __shared__ float sm_acc[WARPS][8][HEAD_DIM];
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rs = seq * num_kv_heads + kvh;
    const int row = row_ids[rs];
    int n_high = 0, n_low = 0;
    if (row >= 0) {
        n_high = tier_tokens[2 * (long long)row];
        n_low = tier_tokens[2 * (long long)row + 1];
    }
    // row_pages' values with the loads under one branch (calling row_pages here compiles to another kernel)
    const int hp = (n_high + HighTier::TOKENS - 1) / HighTier::TOKENS;
    const RowPages rp = {row, n_high, n_low, hp, (n_low + LowTier::TOKENS - 1) / LowTier::TOKENS};
    int u0, u1;
    slot_pages(rp, num_slots, cslot, u0, u1);
    const u16* qrow = q + (long long)(seq * num_kv_heads + kvh) * GROUP * HEAD_DIM;
    const int* trow = table + (long long)(row < 0 ? 0 : row) * R;
    u16* probs_row = page_probs + (long long)rs * R * GROUP * PMAX;
    float* max_row = page_max + (long long)rs * R * GROUP;

    WarpState st;
    st.m[0] = st.m[1] = NEG_INF;
    st.l[0] = st.l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < MT; ++i) st.acc[i][0] = st.acc[i][1] = st.acc[i][2] = st.acc[i][3] = 0.f;
#if STAGES
    staged_loop(dyn_smem + warp * STAGES * STAGE_BYTES, pool, trow, u0 + warp, u1, hp, n_high, n_low, R, lane, g, t,
                qrow, qk_scale, st, probs_row, max_row);
    __syncthreads();  // every warp is done with the ring before the merge reuses it
#else
    u32 qf[MT][2];
    float qsum[MAX_KG][2];

    const int h_end = min(u1, hp);
    if (u0 + warp < h_end) {
        load_query<HighTier>(qrow, g, t, qf, qsum);
        tier_loop<HighTier, false>(pool, trow, u0 + warp, h_end, 0, n_high, R, g, t, qf, qsum, qk_scale, st, probs_row,
                                   max_row);
    }
    const int l_start = max(u0, hp) + warp;
    if (l_start < u1) {
        load_query<LowTier>(qrow, g, t, qf, qsum);
        tier_loop<LowTier, true>(pool, trow, l_start, u1, hp, n_low, R, g, t, qf, qsum, qk_scale, st, probs_row,
                                 max_row);
    }
#endif
    // finish the sums over the lanes of a head, then merge the warps
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        st.l[c] += __shfl_xor_sync(0xffffffffu, st.l[c], 4);
        st.l[c] += __shfl_xor_sync(0xffffffffu, st.l[c], 8);
        st.l[c] += __shfl_xor_sync(0xffffffffu, st.l[c], 16);
    }
    if (g == 0) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            sm_m[warp][2 * t + c] = st.m[c];
            sm_l[warp][2 * t + c] = st.l[c];
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int d0 = DPT * g + 2 * i;
        sm_acc[warp][2 * t][d0] = st.acc[i][0];
        sm_acc[warp][2 * t + 1][d0] = st.acc[i][1];
        sm_acc[warp][2 * t][d0 + 1] = st.acc[i][2];
        sm_acc[warp][2 * t + 1][d0 + 1] = st.acc[i][3];
    }
    __syncthreads();
    const long long slot_idx = (long long)rs * num_slots + cslot;
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += WARPS * 32) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][h]);
        float a = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float mw = sm_m[w][h];
            const float wt = (mw == NEG_INF) ? 0.f : ex2(mw - mx);
            a += wt * sm_acc[w][h][d];
            l += wt * sm_l[w][h];
        }
        part_acc[(slot_idx * GROUP_PAD + h) * BLOCK_D + d] = a;
        if (d == 0) {
            part_m[slot_idx * GROUP_PAD + h] = mx;
            part_l[slot_idx * GROUP_PAD + h] = l;
        }
    }
    if constexpr (PREFETCH) {  // last: the accumulators are dead by now
#if PREFETCH_RELOAD
        // The row's bounds and page ids loaded again and the addresses rebuilt from the kernel's parameters: nothing
        // of the prefetch stays live through the page loop.
        const RowPages again = row_pages<true>(tier_tokens, row_ids, rs);
        int v0, v1;
        slot_pages(again, num_slots, cslot, v0, v1);
        prefetch_merge_reads<true>(again, v0, v1, table + (long long)(again.row < 0 ? 0 : again.row) * R, pool,
                                   page_probs + (long long)rs * R * GROUP * PMAX, page_max + (long long)rs * R * GROUP,
                                   R);
#else
        // The page loop's bounds and pointers reused (they stay live through it).
        prefetch_merge_reads<false>(rp, u0, u1, trow, pool, probs_row, max_row, R);
#endif
    }
}

#if !FUSED_MERGE
// Grid (num_seqs, num_kv_heads, num_slots); the merge (cuda/decode_merge.cu) is a second launch.
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
diffkv_decode_partial(const u16* __restrict__ q, const unsigned char* __restrict__ pool,
                      const int* __restrict__ table, const int* __restrict__ tier_tokens,
                      const int* __restrict__ row_ids, float* __restrict__ part_m, float* __restrict__ part_l,
                      float* __restrict__ part_acc, u16* __restrict__ page_probs, float* __restrict__ page_max,
                      float qk_scale, int num_kv_heads, int num_slots, int R) {
    partial_cta<MERGE_PREFETCH != 0 && STORE_PROBS != 0>(blockIdx.x, blockIdx.y, blockIdx.z, q, pool, table,
                                                         tier_tokens, row_ids, part_m, part_l, part_acc, page_probs,
                                                         page_max, qk_scale, num_kv_heads, num_slots, R);
}

// The score update after the merge (replaces the Triton _decode_score_kernel on this backend): adds to
// every stored token's fp32 score the max over the group's query heads of its final probability,
// p_h * 2^(page_max_h - lse_h) (page_probs holds p_h relative to page_max_h). One warp per page, lanes
// over the page's slots, so the fp16 probabilities and the scores are read and written in whole
// sectors. Grid (num_seqs, num_kv_heads, ceil(R / SCORE_PAGES_PER_CTA)), SCORE_WARPS warps.
#ifndef SCORE_WARPS
#define SCORE_WARPS 8
#endif
#define SCORE_PAGES_PER_CTA (2 * SCORE_WARPS)

extern "C" __global__ void __launch_bounds__(SCORE_WARPS * 32)
diffkv_decode_scores(unsigned char* __restrict__ pool, const int* __restrict__ table,
                     const int* __restrict__ tier_tokens, const int* __restrict__ row_ids,
                     const u16* __restrict__ page_probs, const float* __restrict__ page_max,
                     const float* __restrict__ lse, int num_kv_heads, int R) {
    const int seq = blockIdx.x, kvh = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rs = seq * num_kv_heads + kvh;
    const int row = row_ids[rs];
    if (row < 0) return;
    const int n_high = tier_tokens[2 * (long long)row], n_low = tier_tokens[2 * (long long)row + 1];
    const int hp = (n_high + H_TOKENS - 1) / H_TOKENS;
    const int lp = (n_low + L_TOKENS - 1) / L_TOKENS;
    for (int u = blockIdx.z * SCORE_PAGES_PER_CTA + warp; u < min(hp + lp, (int)(blockIdx.z + 1) * SCORE_PAGES_PER_CTA);
         u += SCORE_WARPS) {
        const PageRef r = page_ref(u, hp, n_high, n_low, R);
        const long long cell = (long long)rs * R + r.pos;
        float factor[GROUP];
#pragma unroll
        for (int h = 0; h < GROUP; ++h) factor[h] = ex2(page_max[cell * GROUP + h] - lse[(long long)rs * GROUP_PAD + h]);
        const int page = table[(long long)row * R + r.pos];
        float* score = (float*)(pool + (u64)page * PAGE_BYTES + (r.low ? L_SC : H_SC));
        const u16* probs = page_probs + cell * GROUP * PMAX;
        for (int slot = lane; slot < r.count; slot += 32) {
            float best = 0.f;
#pragma unroll
            for (int h = 0; h < GROUP; ++h) best = fmaxf(best, h2f(probs[h * PMAX + slot]) * factor[h]);
            score[slot] += best;
        }
    }
}
#endif  // !FUSED_MERGE
