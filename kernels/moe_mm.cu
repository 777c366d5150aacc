// The prompt path's routed experts grouped on the card: no expert counts go to the host, no
// expert is dequantized to a whole f16 copy, and a layer's experts take six launches whatever
// the router chose (engine/cuda/moe.py, _planned: the input's f16 copy, then the four below and
// combine_rows).
//
//   moe_plan       one block: the (token, expert) pairs counted per expert, each pair's row in
//                  expert order (pos_of), the token of each row (sorted_tok), and the tiles: runs
//                  of at most MM_BM rows of one expert (tile e, first row, rows), n_tiles of them.
//   moe_mm_gu_<t>  h[row] = silu(x[tok] . Wg[e]) * (x[tok] . Wu[e]) for every row of every tile
//                  (x in f16), gate and up of type t expanded into shared memory a slice at a time,
//                  the products on the tensor cores (mma m16n8k16, f16 in, f32 sums); h in f16.
//   moe_mm_dn_<t>  y[row] = h[row] . Wd[e], f32.
//   combine_rows   (moe.cu) each token's rows weighted and added in rank order.
//
// Where a row lands inside its expert's run does not change its sums (each output element adds
// the same products in the same order whichever tile row holds it), so the plan's atomics make
// no result depend on timing.
#include "common.cuh"
#include "blocks.cuh"
#include "f16x2.cuh"
#include "mt.cuh"

#define MM_BM 64                      // rows (tokens) of a tile
#define MM_BN 128                     // weight rows (outputs) of a block
#define MM_BK 64                      // values of the inner dimension a step
#define MM_LD (MM_BK + 8)             // halves a shared row: +8 so the fragment loads hit 32 banks

// ids [n_pairs] (token-major, A a token), experts < E. Shared memory 8 E bytes. Block 1024.
extern "C" __global__ void moe_plan(const int* __restrict__ ids, int n_pairs, int A, int E,
                                    int* __restrict__ pos_of, int* __restrict__ sorted_tok,
                                    int* __restrict__ tiles /* [3, max_tiles] */, int max_tiles,
                                    int* __restrict__ n_tiles) {
    extern __shared__ int plan_sm[];
    int* count = plan_sm;             // [E]: rows per expert, then the rows placed so far
    int* start = plan_sm + E;         // [E]: the expert's first row
    pdl_wait();
    pdl_next();
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int row = 0, t = 0;
        for (int e = 0; e < E; e++) {
            int c = count[e];
            start[e] = row;
            for (int r = 0; r < c && t < max_tiles; r += MM_BM, t++) {
                tiles[t] = e;
                tiles[max_tiles + t] = row + r;
                tiles[2 * max_tiles + t] = min(MM_BM, c - r);
            }
            row += c;
            count[e] = 0;
        }
        *n_tiles = t;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int e = ids[p];
        int j = start[e] + atomicAdd(&count[e], 1);
        pos_of[p] = j;
        sorted_tok[j] = p / A;
    }
}

__device__ __forceinline__ u32 lds32(const u16* p) { return *(const u32*)p; }
// IV floats into shared memory as f16 (16-byte stores), or IV zeros where v is null
template <int IV>
__device__ __forceinline__ void store_f16(uint4* o, const float* v) {
#pragma unroll
    for (int c = 0; c < IV / 8; c++)
        o[c] = v ? make_uint4(pack2(v[8 * c], v[8 * c + 1]), pack2(v[8 * c + 2], v[8 * c + 3]),
                              pack2(v[8 * c + 4], v[8 * c + 5]), pack2(v[8 * c + 6], v[8 * c + 7]))
                 : make_uint4(0u, 0u, 0u, 0u);
}

// One item of a block format held between its load and its expansion into shared memory as f16
// (o[IV / 8]): generic through floats; Q4_K and Q6_K, the formats of the K-quant mixes' experts,
// keep their scales as f16x2 words and expand in f16x2 arithmetic.
template <class T> struct Item {
    enum { IV = T::IV };
    T q;
    __device__ __forceinline__ void load(const u8* row, int item) { q.load(row, item); }
    __device__ __forceinline__ void expand_h(uint4* o) const {
        float v[IV];
        q.expand(v);
        store_f16<IV>(o, v);
    }
};
// A block's thread reads a row of its own, so each load instruction touches as many lines as the warp has
// threads: the items below load in as few (16-byte) instructions as their alignment lets.
template <> struct Item<Q4K> {
    enum { IV = Q4K::IV };
    int q[8];
    u32 s[2], m[2];                               // values 0-31 (low nibbles) and 32-63 (high): scale, -min
    __device__ __forceinline__ void load(const u8* row, int item) {
        const u8* b = row + (i64)(item >> 2) * Q4K::BYTES;         // 16-aligned (144-byte blocks)
        int g = item & 3, sc0, m0, sc1, m1;
        uint4 h = *(const uint4*)b;                                // d, dmin, the 12 bytes of scales
        const int4* p = (const int4*)(b + 16 + 32 * g);
        int4 x = p[0], y = p[1];
        q[0] = x.x; q[1] = x.y; q[2] = x.z; q[3] = x.w; q[4] = y.x; q[5] = y.y; q[6] = y.z; q[7] = y.w;
        kscale(h.y, h.z, h.w, 2 * g, sc0, m0);
        kscale(h.y, h.z, h.w, 2 * g + 1, sc1, m1);
        float d = h2f((u16)(h.x & 0xffff)), dmin = h2f((u16)(h.x >> 16));
        s[0] = splat(d * (float)sc0); s[1] = splat(d * (float)sc1);
        m[0] = splat(-dmin * (float)m0); m[1] = splat(-dmin * (float)m1);
    }
    __device__ __forceinline__ void expand_h(uint4* o) const {
#pragma unroll
        for (int half = 0; half < 2; half++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                u32 w0 = ((u32)q[2 * c] >> (4 * half)) & 0x0F0F0F0Fu, w1 = ((u32)q[2 * c + 1] >> (4 * half)) & 0x0F0F0F0Fu;
                o[4 * half + c] = make_uint4(hfma2(hsub2(BYTES_AS_F16(w0, 0x4140), H1024), s[half], m[half]),
                                             hfma2(hsub2(BYTES_AS_F16(w0, 0x4342), H1024), s[half], m[half]),
                                             hfma2(hsub2(BYTES_AS_F16(w1, 0x4140), H1024), s[half], m[half]),
                                             hfma2(hsub2(BYTES_AS_F16(w1, 0x4342), H1024), s[half], m[half]));
            }
    }
};
template <> struct Item<Q6K> {
    enum { IV = Q6K::IV };
    int q[8];                                     // 6-bit values 0-63, four a word
    u32 s[2];                                     // values 0-15, 16-31: d times the sub-block's scale
    __device__ __forceinline__ void load(const u8* row, int item) {  // Q6K::load's values, wider loads
        const u8* b = row + (i64)(item >> 3) * Q6K::BYTES;         // 2-aligned (210-byte blocks)
        int h = (item >> 2) & 1, j = item & 3, sl = (j >> 1) * 4, sh = 2 * j;
        u32 lw[8], hw[8];
        ld32_b2_wide(b + 64 * h + (j & 1) * 32, lw);
        ld32_b2_wide(b + 128 + 32 * h, hw);
        u32 sc = ld_h(b + 192 + 8 * h + 2 * j);
        float d = h2f(ld_h(b + 208));
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = (int)(((lw[k] >> sl) & 0x0F0F0F0Fu) | (((hw[k] >> sh) & 0x03030303u) << 4));
        s[0] = splat(d * (float)(int)(i8)(sc & 0xff)); s[1] = splat(d * (float)(int)(i8)(sc >> 8));
    }
    __device__ __forceinline__ void expand_h(uint4* o) const {
        const u32 bias = 0x64206420u;             // (1056, 1056): 1024 + the format's offset 32
#pragma unroll
        for (int c = 0; c < 4; c++) {
            u32 w0 = (u32)q[2 * c], w1 = (u32)q[2 * c + 1], sc = s[c >> 1];
            o[c] = make_uint4(hmul2(hsub2(BYTES_AS_F16(w0, 0x4140), bias), sc),
                              hmul2(hsub2(BYTES_AS_F16(w0, 0x4342), bias), sc),
                              hmul2(hsub2(BYTES_AS_F16(w1, 0x4140), bias), sc),
                              hmul2(hsub2(BYTES_AS_F16(w1, 0x4342), bias), sc));
        }
    }
};

// A warp's 32 x 32 part of the tile: warp w takes rows 32 (w >> 2), columns 32 (w & 3), so that each of
// the SM's four schedulers (warp w % 4) holds one warp of each half of the rows.
__device__ __forceinline__ int warp_m0() { return (threadIdx.x / WARP >> 2) * 32; }
__device__ __forceinline__ int warp_c0() { return (threadIdx.x / WARP & 3) * 32; }

// One MM_BK step of the warp's part: acc[mt][nt][4] += xs[rows] . ws[cols], fragment layouts as PTX's
// mma.m16n8k16 (.row.col). A 16-row slice wholly past the tile's rows is skipped: an expert's tile is
// often part full (a 512-id prompt gives an expert about 32 rows of a tile's 64, a 64-id one about 4).
__device__ __forceinline__ void mm_step(const u16* __restrict__ xs, const u16* __restrict__ ws, float (*acc)[4][4],
                                        int rows) {
    int lane = threadIdx.x % WARP, g = lane >> 2, q = lane & 3;
    int m0 = warp_m0(), c0 = warp_c0();
    if (m0 >= rows) return;
    bool two = m0 + 16 < rows;
#pragma unroll
    for (int kk = 0; kk < MM_BK; kk += 16) {
        u32 a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const u16* p = xs + (m0 + mt * 16 + g) * MM_LD + kk + 2 * q;
            if (mt == 0 || two) {
                a[mt][0] = lds32(p);
                a[mt][1] = lds32(p + 8 * MM_LD);
                a[mt][2] = lds32(p + 8);
                a[mt][3] = lds32(p + 8 * MM_LD + 8);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const u16* p = ws + (c0 + nt * 8 + g) * MM_LD + kk + 2 * q;
            u32 b0 = lds32(p), b1 = lds32(p + 8);
            mma16816(acc[0][nt], a[0], b0, b1);
            if (two) mma16816(acc[1][nt], a[1], b0, b1);
        }
    }
}

// The next step held in registers while this step multiplies (256 threads). The tile's slice of
// the f16 input (rows x[rowmap[r0 + i]], or x[r0 + i] without a map; 2 uint4 a thread) ...
struct XPre {
    enum { N = MM_BM * MM_BK / 8 / 256 };
    const u16* src[N];
    uint4 v[N];
    __device__ __forceinline__ void init(const u16* __restrict__ x, const int* __restrict__ rowmap, int r0, int rows,
                                         int K) {
#pragma unroll
        for (int j = 0; j < N; j++) {
            int i = threadIdx.x + 256 * j, r = i / (MM_BK / 8), c = (i % (MM_BK / 8)) * 8;
            src[j] = r < rows ? x + (i64)(rowmap ? rowmap[r0 + r] : r0 + r) * K + c : nullptr;
        }
    }
    __device__ __forceinline__ void load(int k0) {
#pragma unroll
        for (int j = 0; j < N; j++) v[j] = src[j] ? *(const uint4*)(src[j] + k0) : make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ void store(u16* __restrict__ xs) const {
#pragma unroll
        for (int j = 0; j < N; j++) {
            int i = threadIdx.x + 256 * j, r = i / (MM_BK / 8), c = (i % (MM_BK / 8)) * 8;
            *(uint4*)(xs + r * MM_LD + c) = v[j];
        }
    }
};
// ... and of one weight matrix, by TPM threads (t: the thread's place among them): its blocks'
// registers, item i being row i / PER_ROW, part i % PER_ROW of the step.
template <class T, int TPM> struct WPre {
    enum { PER_ROW = MM_BK / T::IV, ITEMS = MM_BN * PER_ROW, N = (ITEMS + TPM - 1) / TPM };
    Item<T> q[N];
    __device__ __forceinline__ void load(const u8* w, i64 rb, int rows_w, int n0, int k0, int t) {
#pragma unroll
        for (int j = 0; j < N; j++) {
            int i = t + TPM * j, r = i / PER_ROW;
            if (i >= ITEMS) break;
            if (n0 + r < rows_w) q[j].load(w + (i64)(n0 + r) * rb, k0 / T::IV + i % PER_ROW);
        }
    }
    __device__ __forceinline__ void store(u16* ws, int rows_w, int n0, int t) const {
#pragma unroll
        for (int j = 0; j < N; j++) {
            int i = t + TPM * j, r = i / PER_ROW;
            if (i >= ITEMS) break;
            uint4* o = (uint4*)(ws + r * MM_LD + (i % PER_ROW) * T::IV);
            if (n0 + r < rows_w) q[j].expand_h(o);
            else store_f16<T::IV>(o, nullptr);
        }
    }
};

__device__ __forceinline__ void zero_acc(float (*acc)[4][4]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int l = 0; l < 4; l++) acc[i][j][l] = 0.f;
}

// The warp's outputs: h = silu(gate) * up as f16 (GU), or y f32; rows past `rows`, columns past N skipped.
template <bool GU>
__device__ __forceinline__ void mm_store(const float (*a)[4][4], const float (*b)[4][4], int rows, int r0, int n0, int N,
                                         void* __restrict__ out) {
    int lane = threadIdx.x % WARP, g = lane >> 2, q = lane & 3;
    int m0 = warp_m0(), c0 = warp_c0();
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            int n = n0 + c0 + nt * 8 + 2 * q;
            if (n >= N) continue;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                int m = m0 + mt * 16 + g + 8 * half;
                if (m >= rows) continue;
                float v0 = a[mt][nt][2 * half], v1 = a[mt][nt][2 * half + 1];
                if (GU) {
                    v0 = silu(v0) * b[mt][nt][2 * half];
                    v1 = silu(v1) * b[mt][nt][2 * half + 1];
                    *(u32*)((u16*)out + (i64)(r0 + m) * N + n) = pack2(v0, v1);
                } else {
                    *(float2*)((float*)out + (i64)(r0 + m) * N + n) = make_float2(v0, v1);
                }
            }
        }
}

// gate and up (GU: x f16 [T, K] through sorted_tok, out h f16 [n_pairs, N]) or down (x = h f16, out
// y f32 [n_pairs, N]) over one tile and MM_BN outputs. grid (ceil(N / MM_BN), max_tiles), block 256.
// Each step's slices are loaded into registers while the step before multiplies. Gate and up split
// the block: threads 0-127 load and expand gate's rows, 128-255 up's, so that every thread expands
// one matrix's share and holds one step of it (before, each thread expanded both, half the block
// idle, and holding both in registers did not fit two blocks an SM).
template <class T, bool GU>
__device__ __forceinline__ void mm_tile(const u64* __restrict__ tab0, const u64* __restrict__ tab1, i64 rb0, i64 rb1,
                                        int N, int K, const u16* __restrict__ x, const int* __restrict__ rowmap,
                                        const int* __restrict__ tiles, int max_tiles, const int* __restrict__ n_tiles,
                                        void* __restrict__ out) {
    constexpr int TPM = GU ? 128 : 256;           // threads a weight matrix
    __shared__ __align__(16) u16 xs[MM_BM * MM_LD];
    __shared__ __align__(16) u16 s0[MM_BN * MM_LD];
    __shared__ __align__(16) u16 s1[GU ? MM_BN * MM_LD : 8];
    pdl_wait();
    pdl_next();
    int tile = blockIdx.y;
    if (tile >= *n_tiles) return;
    int e = tiles[tile], r0 = tiles[max_tiles + tile], rows = tiles[2 * max_tiles + tile];
    int n0 = blockIdx.x * MM_BN;
    int mat = GU ? threadIdx.x / TPM : 0, t = threadIdx.x % TPM;
    const u8* w = (const u8*)(mat ? tab1[e] : tab0[e]);
    i64 rb = mat ? rb1 : rb0;
    u16* ws = mat ? s1 : s0;
    float a0[2][4][4], a1[GU ? 2 : 1][4][4];
    zero_acc(a0);
    if (GU) zero_acc(a1);
    XPre xp;
    WPre<T, TPM> wp;
    xp.init(x, rowmap, r0, rows, K);
    if (!GU) xp.load(0);
    wp.load(w, rb, N, n0, 0, t);
    for (int k0 = 0; k0 < K; k0 += MM_BK) {
        __syncthreads();
        if (GU) xp.load(k0);
        xp.store(xs);
        wp.store(ws, N, n0, t);
        __syncthreads();
        if (k0 + MM_BK < K) {
            if (!GU) xp.load(k0 + MM_BK);
            wp.load(w, rb, N, n0, k0 + MM_BK, t);
        }
        mm_step(xs, s0, a0, rows);
        if constexpr (GU) mm_step(xs, s1, a1, rows);
    }
    mm_store<GU>(a0, a1, rows, r0, n0, N, out);
}

// One pair of kernels per block format (moe.py's MM_TYPES names them by ggml type).
#define MOE_MM(T, name)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_mm_gu_##name(                                    \
        const u64* tab_g, const u64* tab_u, i64 rbg, i64 rbu, int F, int K, const u16* x, const int* sorted_tok, \
        const int* tiles, int max_tiles, const int* n_tiles, u16* h) {                                         \
        mm_tile<T, true>(tab_g, tab_u, rbg, rbu, F, K, x, sorted_tok, tiles, max_tiles, n_tiles, h);     \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_mm_dn_##name(                                       \
        const u64* tab_d, i64 rbd, int D, int F, const u16* h, const int* tiles, int max_tiles, const int* n_tiles, \
        float* y) {                                                                                            \
        mm_tile<T, false>(tab_d, tab_d, rbd, rbd, D, F, h, nullptr, tiles, max_tiles, n_tiles, y);        \
    }
MOE_MM(Q4K, q4_k)
MOE_MM(Q5K, q5_k)
MOE_MM(Q6K, q6_k)
MOE_MM(Q8_0, q8_0)
MOE_MM(Q4_0, q4_0)
MOE_MM(Q5_0, q5_0)

// ---- a decode step's experts on the tensor cores (mt.cuh) ----
// The step's (token, expert) pairs grouped by expert on the card, then each expert's weights read
// once for all the rows that chose it (the per-pair kernels of moe.cu read an expert once a pair):
//   moe_dplan   one block: groups [G][MT_G] (expert, rows, its pairs), n_groups;
//   moe_mt_gu   act[pair] = silu(x[tok] . Wg[e]) * (x[tok] . Wu[e]) in f16, grid (F / 8, G): block
//               (f, j) takes rows f .. f + 7 of gate (n-tile 0) and of up (n-tile 1) for group j;
//   moe_mt_dn   y[pair] = act[pair] . Wd[e], f32, grid (D / 16, G);
//   combine_rows (moe.cu) each token's pairs weighted and added in rank order.
// G = min(E, pairs) blocks a column, those past n_groups return at once (a captured step's grid is
// fixed). A pair's place in its group does not change its sums (an mma's rows are independent), so
// the plan's atomics make no result depend on timing.
#define MT_G (2 + MT_ROWS)            // a group: expert, rows, then up to MT_ROWS pairs (a token picks an expert once)

// ids [P] (token-major), P <= blockDim; shared memory 8 E bytes.
extern "C" __global__ void moe_dplan(const int* __restrict__ ids, int P, int E, int* __restrict__ groups,
                                     int* __restrict__ n_groups) {
    extern __shared__ int dplan_sm[];
    int* first = dplan_sm;            // [E]: the expert's first pair
    int* slot = dplan_sm + E;         // [E]: its group, then
    __shared__ int wc[32], cnt[1024];
    pdl_wait();
    pdl_next();
    int p = threadIdx.x, lane = p % WARP, w = p / WARP;
    for (int e = p; e < E; e += blockDim.x) first[e] = P;
    for (int i = p; i < P; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    int e = p < P ? ids[p] : 0;
    if (p < P) atomicMin(&first[e], p);
    __syncthreads();
    bool lead = p < P && first[e] == p;
    unsigned m = __ballot_sync(0xffffffffu, lead);
    if (lane == 0) wc[w] = __popc(m);
    __syncthreads();
    int gi = __popc(m & ((1u << lane) - 1u));
    for (int k = 0; k < w; k++) gi += wc[k];
    if (lead) {
        slot[e] = gi;
        groups[gi * MT_G] = e;
    }
    if (p == 0) {
        int n = 0;
        for (int k = 0; k < (int)(blockDim.x / WARP); k++) n += wc[k];
        *n_groups = n;
    }
    __syncthreads();
    if (p < P) {
        int g = slot[e], r = atomicAdd(&cnt[g], 1);
        groups[g * MT_G + 2 + r] = p;
    }
    __syncthreads();
    if (lead) groups[gi * MT_G + 1] = cnt[gi];
}

template <class T>
__device__ __forceinline__ void moe_mt_gu_run(const u8* wg, const u8* wu, i64 rbg, i64 rbu, int F, int D,
                                              const u16* __restrict__ x16, const int* __restrict__ grp, int n, int A,
                                              u16* __restrict__ act, float* __restrict__ red) {
    int lane = threadIdx.x % WARP, g = lane >> 2, f0 = blockIdx.x * 8;
    const u8* rows[2] = {wg + (i64)(f0 + g) * rbg, wu + (i64)(f0 + g) * rbu};
    float acc[2][4];
    mt_sum<T, 2>(rows, threadIdx.x / WARP, D / 256, g < n ? x16 + (i64)(grp[g] / A) * D : nullptr,
                 g + 8 < n ? x16 + (i64)(grp[g + 8] / A) * D : nullptr, acc, false);
    // n-tile 0 (gate) and 1 (up) of the same place: the reduction's first half holds gate, the second up
    mt_reduce<2>(acc, red, [&](int nt, int j, int l, float v) {
        if (nt == 1) red[(MT_KS * 2 * 4 + j) * WARP + l] = v;       // up, beside the warps' parts
    });
    __syncthreads();
    int nw = blockDim.x / WARP;
    for (int i = threadIdx.x; i < 4 * WARP; i += blockDim.x) {
        int j = i / WARP, l = i % WARP;
        float gate = 0.f;
        for (int k = 0; k < nw; k++) gate += red[k * 2 * 4 * WARP + i];
        int r = (l >> 2) + (j >> 1) * 8;
        if (r < n) act[(i64)grp[r] * F + f0 + 2 * (l & 3) + (j & 1)] = f2h(silu(gate) * red[(MT_KS * 2 * 4 + j) * WARP + l]);
    }
}

// x16 [T, D] f16, act [P, F] f16; D % 256 == 0, F % 8 == 0; gate and up of one type, Q4_K or Q6_K.
// Block 32 min(MT_KS, D / 256).
extern "C" __global__ void __launch_bounds__(128) moe_mt_gu(const u64* __restrict__ tab_g, const u64* __restrict__ tab_u,
                                                            int type, i64 rbg, i64 rbu, int F, int D,
                                                            const u16* __restrict__ x16, const int* __restrict__ groups,
                                                            const int* __restrict__ n_groups, int A, u16* __restrict__ act) {
    __shared__ float red[(MT_KS * 2 + 1) * 4 * WARP];
    pdl_wait();
    pdl_next();
    int j = blockIdx.y;
    if (j >= *n_groups) return;
    const int* gr = groups + j * MT_G;
    int e = gr[0], n = gr[1];
    const u8* wg = (const u8*)tab_g[e];
    const u8* wu = (const u8*)tab_u[e];
    if (type == T_Q4_K) moe_mt_gu_run<MtQ4K>(wg, wu, rbg, rbu, F, D, x16, gr + 2, n, A, act, red);
    else moe_mt_gu_run<MtQ6K>(wg, wu, rbg, rbu, F, D, x16, gr + 2, n, A, act, red);
}

template <class T>
__device__ __forceinline__ void moe_mt_dn_run(const u8* wd, i64 rbd, int D, int F, const u16* __restrict__ act,
                                              const int* __restrict__ grp, int n, float* __restrict__ y,
                                              float* __restrict__ red) {
    int lane = threadIdx.x % WARP, g = lane >> 2, d0 = blockIdx.x * 16;
    const u8* rows[2] = {wd + (i64)min(d0 + g, D - 1) * rbd, wd + (i64)min(d0 + 8 + g, D - 1) * rbd};
    float acc[2][4];
    mt_sum<T, 2>(rows, threadIdx.x / WARP, F / 256, g < n ? act + (i64)grp[g] * F : nullptr,
                 g + 8 < n ? act + (i64)grp[g + 8] * F : nullptr, acc, false);
    mt_reduce<2>(acc, red, [&](int nt, int j, int l, float v) {
        int r = (l >> 2) + (j >> 1) * 8, d = d0 + nt * 8 + 2 * (l & 3) + (j & 1);
        if (r < n && d < D) y[(i64)grp[r] * D + d] = v;
    });
}

// act [P, F] f16, y [P, D] f32; F % 256 == 0. Block 32 min(MT_KS, F / 256).
extern "C" __global__ void __launch_bounds__(128) moe_mt_dn(const u64* __restrict__ tab_d, int type, i64 rbd, int D, int F,
                                                            const u16* __restrict__ act, const int* __restrict__ groups,
                                                            const int* __restrict__ n_groups, float* __restrict__ y) {
    __shared__ float red[MT_KS * 2 * 4 * WARP];
    pdl_wait();
    pdl_next();
    int j = blockIdx.y;
    if (j >= *n_groups) return;
    const int* gr = groups + j * MT_G;
    const u8* wd = (const u8*)tab_d[gr[0]];
    if (type == T_Q4_K) moe_mt_dn_run<MtQ4K>(wd, rbd, D, F, act, gr + 2, gr[1], y, red);
    else moe_mt_dn_run<MtQ6K>(wd, rbd, D, F, act, gr + 2, gr[1], y, red);
}
