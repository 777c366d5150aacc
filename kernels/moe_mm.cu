// The prompt path's routed experts grouped on the card: no expert counts go to the host, no
// expert is dequantized to a whole f16 copy, and a layer's experts take five launches whatever
// the router chose (engine/cuda/moe.py, _planned).
//
//   moe_plan       one block: the (token, expert) pairs counted per expert, each pair's row in
//                  expert order (pos_of), the token of each row (sorted_tok), and the tiles: runs
//                  of at most MM_BM rows of one expert (tile e, first row, rows), n_tiles of them.
//   moe_mm_gu_<t>  h[row] = silu(x[tok] . Wg[e]) * (x[tok] . Wu[e]) for every row of every tile,
//                  gate and up of type t dequantized into shared memory a slice at a time, the
//                  products on the tensor cores (mma m16n8k16, f16 in, f32 sums); h in f16.
//   moe_mm_dn_<t>  y[row] = h[row] . Wd[e], f32.
//   combine_rows   (moe.cu) each token's rows weighted and added in rank order.
//
// Where a row lands inside its expert's run does not change its sums (each output element adds
// the same products in the same order whichever tile row holds it), so the plan's atomics make
// no result depend on timing.
#include "common.cuh"
#include "blocks.cuh"

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

__device__ __forceinline__ u32 pack2(float a, float b) { return (u32)f2h(a) | ((u32)f2h(b) << 16); }
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

__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The tile's rows [MM_BM, MM_BK] from column k0 into xs as f16, rows past `rows` zero: row i is
// x[rowmap[r0 + i]] of x f32 [*, K] (gate and up's input; down's is prefetched by XPre).
__device__ __forceinline__ void mm_load_x(const float* __restrict__ x, const int* __restrict__ rowmap, int r0, int rows,
                                          int K, int k0, u16* __restrict__ xs) {
    for (int i = threadIdx.x; i < MM_BM * (MM_BK / 4); i += blockDim.x) {
        int r = i / (MM_BK / 4), c = (i % (MM_BK / 4)) * 4;
        uint2 v = make_uint2(0u, 0u);
        if (r < rows) {
            float4 f = *(const float4*)(x + (i64)rowmap[r0 + r] * K + k0 + c);
            v = make_uint2(pack2(f.x, f.y), pack2(f.z, f.w));
        }
        *(uint2*)(xs + r * MM_LD + c) = v;
    }
}

// Weight rows n0 .. n0 + MM_BN of one expert (row_bytes apart from w), values k0 .. k0 + MM_BK,
// dequantized into ws as f16; rows at or past N zero.
template <class T>
__device__ __forceinline__ void mm_load_w(const u8* __restrict__ w, i64 row_bytes, int N, int n0, int k0,
                                          u16* __restrict__ ws) {
    const int per_row = MM_BK / T::IV;
    for (int i = threadIdx.x; i < MM_BN * per_row; i += blockDim.x) {
        int r = i / per_row, it = k0 / T::IV + i % per_row;
        uint4* o = (uint4*)(ws + r * MM_LD + (it * T::IV - k0));
        if (n0 + r < N) {
            float v[T::IV];
            T q;
            q.deq(w + (i64)(n0 + r) * row_bytes, it, v);
            store_f16<T::IV>(o, v);
        } else {
            store_f16<T::IV>(o, nullptr);
        }
    }
}

// One MM_BK step of a warp's 32 x 32 part of the tile (warp w: rows 32 (w & 1), columns 32 (w >> 1)):
// acc[mt][nt][4] += xs[rows] . ws[cols]. Fragment layouts as PTX's mma.m16n8k16 (.row.col).
__device__ __forceinline__ void mm_step(const u16* __restrict__ xs, const u16* __restrict__ ws, float (*acc)[4][4]) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, g = lane >> 2, q = lane & 3;
    int m0 = (w & 1) * 32, c0 = (w >> 1) * 32;
#pragma unroll
    for (int kk = 0; kk < MM_BK; kk += 16) {
        u32 a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const u16* p = xs + (m0 + mt * 16 + g) * MM_LD + kk + 2 * q;
            a[mt][0] = lds32(p);
            a[mt][1] = lds32(p + 8 * MM_LD);
            a[mt][2] = lds32(p + 8);
            a[mt][3] = lds32(p + 8 * MM_LD + 8);
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const u16* p = ws + (c0 + nt * 8 + g) * MM_LD + kk + 2 * q;
            u32 b0 = lds32(p), b1 = lds32(p + 8);
#pragma unroll
            for (int mt = 0; mt < 2; mt++) mma16816(acc[mt][nt], a[mt], b0, b1);
        }
    }
}

// Down's next step held in registers while this step multiplies (256 threads): the tile's slice of h
// (f16 rows h[r0 + i], 2 uint4 a thread) and of the weight (its blocks' registers, one item a thread
// at most: item i is row i / per_row, part i % per_row of the step).
struct XPre {
    enum { N = MM_BM * MM_BK / 8 / 256 };
    uint4 v[N];
    __device__ __forceinline__ void load(const u16* __restrict__ x, int r0, int rows, int K, int k0) {
#pragma unroll
        for (int j = 0; j < N; j++) {
            int i = threadIdx.x + 256 * j, r = i / (MM_BK / 8), c = (i % (MM_BK / 8)) * 8;
            v[j] = r < rows ? *(const uint4*)(x + (i64)(r0 + r) * K + k0 + c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    __device__ __forceinline__ void store(u16* __restrict__ xs) const {
#pragma unroll
        for (int j = 0; j < N; j++) {
            int i = threadIdx.x + 256 * j, r = i / (MM_BK / 8), c = (i % (MM_BK / 8)) * 8;
            *(uint4*)(xs + r * MM_LD + c) = v[j];
        }
    }
};
template <class T> struct WPre {
    enum { PER_ROW = MM_BK / T::IV, ITEMS = MM_BN * PER_ROW, N = (ITEMS + 255) / 256 };
    T q[N];
    __device__ __forceinline__ void load(const u8* w, i64 rb, int rows_w, int n0, int k0) {
#pragma unroll
        for (int j = 0; j < N; j++) {
            int i = threadIdx.x + 256 * j, r = i / PER_ROW;
            if (i >= ITEMS) break;
            if (n0 + r < rows_w) q[j].load(w + (i64)(n0 + r) * rb, k0 / T::IV + i % PER_ROW);
        }
    }
    __device__ __forceinline__ void store(u16* ws, int rows_w, int n0) const {
#pragma unroll
        for (int j = 0; j < N; j++) {
            int i = threadIdx.x + 256 * j, r = i / PER_ROW;
            if (i >= ITEMS) break;
            uint4* o = (uint4*)(ws + r * MM_LD + (i % PER_ROW) * T::IV);
            if (n0 + r < rows_w) {
                float v[T::IV];
                q[j].expand(v);
                store_f16<T::IV>(o, v);
            } else {
                store_f16<T::IV>(o, nullptr);
            }
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
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, g = lane >> 2, q = lane & 3;
    int m0 = (w & 1) * 32, c0 = (w >> 1) * 32;
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

// gate and up (GU: x f32 [T, K] through sorted_tok, out h f16 [n_pairs, N]) or down (x = h f16, out
// y f32 [n_pairs, N]) over one tile and MM_BN outputs. grid (ceil(N / MM_BN), max_tiles), block 256.
// Down loads its next step's slices into registers while this step's products run (its loop is short
// enough to hold them: 13,475 against 13,190 tok/s at 4096 ids, 8,863 against 6,611 at 512,
// docs/performance.md run M); gate and up load each step after the last step's products (prefetching
// them too took 196 registers, one block an SM, and was no faster).
template <class T, bool GU>
__device__ __forceinline__ void mm_tile(const u64* __restrict__ tab0, const u64* __restrict__ tab1, i64 rb0, i64 rb1,
                                        int N, int K, const void* __restrict__ x, const int* __restrict__ sorted_tok,
                                        const int* __restrict__ tiles, int max_tiles, const int* __restrict__ n_tiles,
                                        void* __restrict__ out) {
    __shared__ __align__(16) u16 xs[MM_BM * MM_LD];
    __shared__ __align__(16) u16 s0[MM_BN * MM_LD];
    __shared__ __align__(16) u16 s1[GU ? MM_BN * MM_LD : 8];
    pdl_wait();
    pdl_next();
    int tile = blockIdx.y;
    if (tile >= *n_tiles) return;
    int e = tiles[tile], r0 = tiles[max_tiles + tile], rows = tiles[2 * max_tiles + tile];
    int n0 = blockIdx.x * MM_BN;
    const u8* w0 = (const u8*)tab0[e];
    const u8* w1 = GU ? (const u8*)tab1[e] : w0;
    float a0[2][4][4], a1[GU ? 2 : 1][4][4];
    zero_acc(a0);
    if (GU) zero_acc(a1);
    if constexpr (GU) {
        for (int k0 = 0; k0 < K; k0 += MM_BK) {
            __syncthreads();
            mm_load_x((const float*)x, sorted_tok, r0, rows, K, k0, xs);
            mm_load_w<T>(w0, rb0, N, n0, k0, s0);
            mm_load_w<T>(w1, rb1, N, n0, k0, s1);
            __syncthreads();
            mm_step(xs, s0, a0);
            mm_step(xs, s1, a1);
        }
    } else {
        XPre xp;
        WPre<T> wp;
        xp.load((const u16*)x, r0, rows, K, 0);
        wp.load(w0, rb0, N, n0, 0);
        for (int k0 = 0; k0 < K; k0 += MM_BK) {
            __syncthreads();
            xp.store(xs);
            wp.store(s0, N, n0);
            __syncthreads();
            if (k0 + MM_BK < K) {
                xp.load((const u16*)x, r0, rows, K, k0 + MM_BK);
                wp.load(w0, rb0, N, n0, k0 + MM_BK);
            }
            mm_step(xs, s0, a0);
        }
    }
    mm_store<GU>(a0, a1, rows, r0, n0, N, out);
}

// One pair of kernels per block format (moe.py's MM_TYPES names them by ggml type).
#define MOE_MM(T, name)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) moe_mm_gu_##name(                                       \
        const u64* tab_g, const u64* tab_u, i64 rbg, i64 rbu, int F, int K, const float* x, const int* sorted_tok, \
        const int* tiles, int max_tiles, const int* n_tiles, u16* h) {                                         \
        mm_tile<T, true>(tab_g, tab_u, rbg, rbu, F, K, x, sorted_tok, tiles, max_tiles, n_tiles, h);     \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) moe_mm_dn_##name(                                       \
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
