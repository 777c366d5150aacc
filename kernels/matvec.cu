// Matrix-vector products for decode and small batches, reading GGUF blocks in place.
// The activation is quantized to int8 per 32 values first (quantize_q8), as
// llama.cpp's CUDA mmvq does, so the inner loop is dp4a on packed nibbles.
#include "common.cuh"
#include "blocks.cuh"
#include "mt.cuh"


// x [rows, K] float -> xq int8 [rows, K], xd [rows, K/32] scale, xs [rows, K/32] = xd * sum(xq).
// One warp per 32 values; optional y = x * rsqrt(mean(x^2)+eps) * w first (fused RMSNorm:
// then one block per row). Plain version: grid (rows*K/32/8), block 256.
extern "C" __global__ void quantize_q8(const float* __restrict__ x, int K, int n_blocks,
                                       i8* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs) {
    pdl_wait();
    pdl_next();
    int blk = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (blk >= n_blocks) return;
    store_q8(x[(i64)blk * 32 + lane], (i64)blk * 32 + lane, xq, xd, xs);
}

// RMSNorm then quantize: one block per row (blockDim a multiple of 32, K <= 8 * blockDim);
// writes y (float), when yq is set (K % 32 == 0) its int8-per-32 form, and when yh is set its f16
// form (mmt's input).
extern "C" __global__ void rms_norm_q8(const float* __restrict__ x, const float* __restrict__ w, int K, float eps,
                                       float* __restrict__ y, i8* __restrict__ yq, float* __restrict__ yd,
                                       float* __restrict__ ys, u16* __restrict__ yh) {
    __shared__ float sh[32];
    pdl_wait();
    pdl_next();
    const float* xr = x + (i64)blockIdx.x * K;
    float v[8];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int i = threadIdx.x + j * blockDim.x;
        v[j] = i < K ? xr[i] : 0.f;
        ss += v[j] * v[j];
    }
    ss = block_sum(ss, sh);
    float scale = rsqrtf(ss / (float)K + eps);
    int lane = threadIdx.x % WARP;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (j * blockDim.x >= K) break;          // uniform over the block
        float o = i < K ? v[j] * scale * w[i] : 0.f;
        i64 at = (i64)blockIdx.x * K + i;
        if (i < K) y[at] = o;
        if (yh && i < K) yh[at] = f2h(o);
        if (yq) {                                 // a warp covers one q8 block (K % 32 == 0)
            float amax = warp_max(fabsf(o));
            float d = amax / 127.f;
            int q = amax == 0.f ? 0 : __float2int_rn(o / d);
            float sum = warp_sum((float)q) * d;
            if (i < K) {
                yq[at] = (i8)q;
                if (lane == 0) { yd[at / 32] = d; ys[at / 32] = sum; }
            }
        }
    }
}

// R rows per warp: every row's item is loaded before any is used, so a warp keeps R loads
// in flight (a decode mat-vec is bound by how many bytes are on their way, not by math).
template <class T, int MAXB, int R>
__device__ __forceinline__ void rows_q(const u8* __restrict__ row, i64 row_bytes, int n_rows_left, int n_items,
                                       const i8* __restrict__ xq, const float* __restrict__ xd,
                                       const float* __restrict__ xs, int K, int B, float (*acc)[MAXB]) {
    int lane = threadIdx.x % WARP;
    for (int it = lane; it < n_items; it += WARP) {
        T w[R];
#pragma unroll
        for (int r = 0; r < R; r++) if (r < n_rows_left) w[r].load(row + r * row_bytes, it);
#pragma unroll
        for (int r = 0; r < R; r++)
            if (r < n_rows_left) {
#pragma unroll
                for (int b = 0; b < MAXB; b++)
                    if (b < B) acc[r][b] += w[r].dot(xq + (i64)b * K, xd + (i64)b * (K / 32), xs + (i64)b * (K / 32), it);
            }
    }
}

// x times nw (when set) elementwise: the fused RMSNorm's weight; its row scale comes after.
template <class T, int MAXB, int R>
__device__ __forceinline__ void rows_f(const u8* __restrict__ row, i64 row_bytes, int n_rows_left,
                                       const float* __restrict__ x, const float* __restrict__ nw, int K, int B,
                                       float (*acc)[MAXB]) {
    int lane = threadIdx.x % WARP;
#pragma unroll 4
    for (int i = lane * 4; i < K; i += WARP * 4) {      // K % 4 == 0: four values per lane per step
        float4 n4 = nw ? *(const float4*)(nw + i) : make_float4(1.f, 1.f, 1.f, 1.f);
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r >= n_rows_left) break;
            const u8* rr = row + r * row_bytes;
            float4 w4 = T::get4(rr, i);
            float w0 = w4.x * n4.x, w1 = w4.y * n4.y, w2 = w4.z * n4.z, w3 = w4.w * n4.w;
#pragma unroll
            for (int b = 0; b < MAXB; b++)
                if (b < B) {
                    float4 xv = *(const float4*)(x + (i64)b * K + i);
                    acc[r][b] += w0 * xv.x + w1 * xv.y + w2 * xv.z + w3 * xv.w;
                }
        }
    }
}

template <int MAXB, int R>
__device__ __forceinline__ void row_dot(int type, const u8* row, i64 rb, int nr, int K, const i8* xq, const float* xd,
                                        const float* xs, const float* xf, const float* nw, int B, float (*acc)[MAXB]) {
    switch (type) {
        case T_Q4_K: rows_q<Q4K, MAXB, R>(row, rb, nr, K / 64, xq, xd, xs, K, B, acc); break;
        case T_Q5_K: rows_q<Q5K, MAXB, R>(row, rb, nr, K / 64, xq, xd, xs, K, B, acc); break;
        case T_Q6_K: rows_q<Q6K, MAXB, R>(row, rb, nr, K / 32, xq, xd, xs, K, B, acc); break;
        case T_Q8_0: rows_q<Q8_0, MAXB, R>(row, rb, nr, K / 32, xq, xd, xs, K, B, acc); break;
        case T_Q5_0: rows_q<Q5_0, MAXB, R>(row, rb, nr, K / 32, xq, xd, xs, K, B, acc); break;
        case T_Q4_0: rows_q<Q4_0, MAXB, R>(row, rb, nr, K / 32, xq, xd, xs, K, B, acc); break;
        case T_F32: rows_f<F32W, MAXB, R>(row, rb, nr, xf, nw, K, B, acc); break;
        case T_F16: rows_f<F16W, MAXB, R>(row, rb, nr, xf, nw, K, B, acc); break;
        case T_BF16: rows_f<BF16W, MAXB, R>(row, rb, nr, xf, nw, K, B, acc); break;
    }
}

// Up to four weights over one activation in one launch (Q, K and V; the qwen35 family's four
// projections of one normed row; or a single matrix). Rows [0, n0) belong to weight 0, [n0, n0+n1)
// to weight 1, and so on. One warp per row, all B tokens per warp so each weight byte is read once.
// out_i[b, row] = x_b . W_i[row] (+ bias_i[row]) (+ res_i[b, row]).
struct MatDesc {
    const u8* w; i64 row_bytes; int type; int n_rows;
    float* out; const float* bias; const float* res;
};
#define MAT_PARAMS(i) const u8* w##i, i64 rb##i, int t##i, int n##i, float* o##i, const float* b##i, const float* r##i
#define MAT_ARGS w0, rb0, t0, n0, o0, b0, r0, w1, rb1, t1, n1, o1, b1, r1, w2, rb2, t2, n2, o2, b2, r2, \
    w3, rb3, t3, n3, o3, b3, r3
// Rows go to warps R at a time: rows [0, n0) are weight 0's, then weight 1's, 2's, 3's; a group of
// R rows never straddles two weights (each weight's rows start a new group).
// The weight and rows of group `group` (false: there is no such group).
__device__ __forceinline__ bool pick_rows(const MatDesc& m0, const MatDesc& m1, const MatDesc& m2, const MatDesc& m3,
                                          int n_mats, int R, int group, MatDesc& m, int& row) {
    int g = (m0.n_rows + R - 1) / R;
    m = m0;
    if (group >= g) {
        group -= g;
        g = (m1.n_rows + R - 1) / R;
        m = m1;
        if (n_mats < 2) return false;
        if (group >= g) {
            group -= g;
            g = (m2.n_rows + R - 1) / R;
            m = m2;
            if (n_mats < 3) return false;
            if (group >= g) {
                group -= g;
                m = m3;
                if (n_mats < 4 || group >= (m3.n_rows + R - 1) / R) return false;
            }
        }
    }
    row = group * R;
    return true;
}
// This warp's group in pass j of rpw: a block's warps take consecutive groups in each pass.
__device__ __forceinline__ int warp_group(int j, int rpw) {
    int nw = blockDim.x / WARP;
    return (blockIdx.x * rpw + j) * nw + threadIdx.x / WARP;
}
// The warp's rows of passes 0..rpw-1 into L1 (weights only: safe before pdl_wait).
__device__ __forceinline__ void prefetch_rows(const MatDesc& m0, const MatDesc& m1, const MatDesc& m2,
                                              const MatDesc& m3, int n_mats, int rpw) {
    for (int j = 0; j < rpw; j++) {
        MatDesc m;
        int row;
        if (!pick_rows(m0, m1, m2, m3, n_mats, 1, warp_group(j, rpw), m, row)) return;
        const u8* p = m.w + (i64)row * m.row_bytes;
        for (i64 o = (threadIdx.x % WARP) * 128; o < m.row_bytes; o += WARP * 128) prefetch_l1(p + o);
    }
}

// nw, xscale (the fused RMSNorm, float weights only): x is the raw row, times nw elementwise,
// the dot times xscale[b] at the end.
template <int MAXB, int R>
__device__ __forceinline__ void mmv3_body(MAT_PARAMS(0), MAT_PARAMS(1), MAT_PARAMS(2), MAT_PARAMS(3), int n_mats,
                                          int K,
                                          const i8* __restrict__ xq, const float* __restrict__ xd,
                                          const float* __restrict__ xs, const float* __restrict__ xf, int B,
                                          int group, const float* __restrict__ nw = nullptr,
                                          const float* __restrict__ xscale = nullptr) {
    MatDesc m0 = {w0, rb0, t0, n0, o0, b0, r0}, m1 = {w1, rb1, t1, n1, o1, b1, r1}, m2 = {w2, rb2, t2, n2, o2, b2, r2},
            m3 = {w3, rb3, t3, n3, o3, b3, r3};
    MatDesc m;
    int row;
    if (!pick_rows(m0, m1, m2, m3, n_mats, R, group, m, row)) return;
    int nr = min(R, m.n_rows - row);
    float acc[R][MAXB];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < MAXB; b++) acc[r][b] = 0.f;
    row_dot<MAXB, R>(m.type, m.w + (i64)row * m.row_bytes, m.row_bytes, nr, K, xq, xd, xs, xf, nw, B, acc);
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < MAXB; b++) acc[r][b] = warp_sum(acc[r][b]);
    bool fscale = xscale && (m.type == T_F32 || m.type == T_F16 || m.type == T_BF16);
    if (threadIdx.x % WARP == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r >= nr) break;
            for (int b = 0; b < B; b++) {
                float v = fscale ? acc[r][b] * xscale[b] : acc[r][b];
                if (m.bias) v += m.bias[row + r];
                if (m.res) v += m.res[(i64)b * m.n_rows + row + r];
                m.out[(i64)b * m.n_rows + row + r] = v;
            }
        }
    }
}

// One row per warp (more rows per warp measured slower on the H200: registers cut occupancy).
// The warp's row is prefetched into L1 before pdl_wait, so its loads overlap the kernel before.
template <int MAXB>
__device__ __forceinline__ void mmv3_entry(MAT_PARAMS(0), MAT_PARAMS(1), MAT_PARAMS(2), MAT_PARAMS(3), int n_mats,
                                           int K,
                                           const i8* xq, const float* xd, const float* xs, const float* xf, int B) {
    MatDesc m0 = {w0, rb0, t0, n0, o0, b0, r0}, m1 = {w1, rb1, t1, n1, o1, b1, r1}, m2 = {w2, rb2, t2, n2, o2, b2, r2},
            m3 = {w3, rb3, t3, n3, o3, b3, r3};
    prefetch_rows(m0, m1, m2, m3, n_mats, 1);
    pdl_wait();
    pdl_next();
    mmv3_body<MAXB, 1>(MAT_ARGS, n_mats, K,
                       xq, xd, xs, xf, B, warp_group(0, 1));
}
#define MMV3(NB) extern "C" __global__ void mmv3_b##NB(MAT_PARAMS(0), MAT_PARAMS(1), MAT_PARAMS(2), MAT_PARAMS(3), \
    int n_mats, int K, const i8* xq, const float* xd, const float* xs, const float* xf, int B) { \
    mmv3_entry<NB>(MAT_ARGS, n_mats, K, \
                   xq, xd, xs, xf, B); }
MMV3(1)
MMV3(2)
MMV3(4)
MMV3(8)
MMV3(16)    // 9-16 rows (DECODE_ROWS): the weights mmt does not take (F32 routers, Q8_0, Q5_0, Q4_0, Q5_K, F16, BF16)

// The same mat-vec with the RMSNorm before it fused into its prologue. x is the raw residual
// [B, K]; each block first prefetches its weight rows (so their loads overlap the kernel
// before and the norm), then makes y = x * rsqrt(mean(x^2) + eps) * nw and its int8-per-32
// form in shared memory, exactly as rms_norm_q8 does; block 0 also writes y and its int8 form
// (y, yq, yd, ys) for the kernels after. Float weights read x times nw and scale the dot by
// the row's rsqrt. Each warp takes rpw (1 or 2) rows one after another: the launch picks 2
// where one row a warp would take more than one wave of blocks (Q/K/V of a 2048-wide model:
// 640 blocks, 3 a SM at these registers), so the norm is made once per block, not per wave.
// Dynamic shared memory: B*K int8 + 2*B*K/32 floats + MAXB floats. K % 32 == 0,
// K <= 8 * NORM_IT * blockDim.
#define NORM_IT 4
template <int MAXB>
__device__ __forceinline__ void mmv3n_body(MAT_PARAMS(0), MAT_PARAMS(1), MAT_PARAMS(2), MAT_PARAMS(3), int n_mats,
                                           int K,
                                           const float* __restrict__ x, const float* __restrict__ nw, float eps,
                                           float* __restrict__ y, i8* __restrict__ yq, float* __restrict__ yd,
                                           float* __restrict__ ys, int B, int rpw) {
    extern __shared__ __align__(16) u8 smem[];
    __shared__ float red[32];
    i8* sq = (i8*)smem;                                   // [B, K]
    float* sd = (float*)(smem + (i64)B * K);              // [B, K/32]
    float* ss = sd + B * (K / 32);                        // [B, K/32]
    float* sc = ss + B * (K / 32);                        // [MAXB]
    {
        MatDesc m0 = {w0, rb0, t0, n0, o0, b0, r0}, m1 = {w1, rb1, t1, n1, o1, b1, r1}, m2 = {w2, rb2, t2, n2, o2, b2, r2},
            m3 = {w3, rb3, t3, n3, o3, b3, r3};
        prefetch_rows(m0, m1, m2, m3, n_mats, rpw);
    }
    pdl_wait();
    pdl_next();
    // thread i holds chunks i, i + blockDim, ... of 8 consecutive values: all of its x and nw
    // loads go out at once; a q8 group of 32 is 4 neighbouring lanes (2 shuffles)
    int lane = threadIdx.x % WARP;
    bool out = blockIdx.x == 0 && y != nullptr;
    int n_ch = K / 8, n_it = (n_ch + blockDim.x - 1) / blockDim.x;          // n_it <= NORM_IT
    for (int b = 0; b < B; b++) {
        const float* xr = x + (i64)b * K;
        float v[NORM_IT][8];
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < NORM_IT; j++) {
            int c = threadIdx.x + j * blockDim.x;
            if (j < n_it && c < n_ch) {
                float4 a = *(const float4*)(xr + c * 8), e = *(const float4*)(xr + c * 8 + 4);
                v[j][0] = a.x; v[j][1] = a.y; v[j][2] = a.z; v[j][3] = a.w;
                v[j][4] = e.x; v[j][5] = e.y; v[j][6] = e.z; v[j][7] = e.w;
            } else {
#pragma unroll
                for (int l = 0; l < 8; l++) v[j][l] = 0.f;
            }
#pragma unroll
            for (int l = 0; l < 8; l++) acc += v[j][l] * v[j][l];
        }
        acc = block_sum(acc, red);
        float scale = rsqrtf(acc / (float)K + eps);
        if (threadIdx.x == 0) sc[b] = scale;
#pragma unroll
        for (int j = 0; j < NORM_IT; j++) {
            if (j >= n_it) break;                           // uniform over the block
            int c = threadIdx.x + j * blockDim.x;
            bool on = c < n_ch;                             // the same for a group's 4 lanes
            float o[8], amax = 0.f;
            if (on) {
                float4 a = *(const float4*)(nw + c * 8), e = *(const float4*)(nw + c * 8 + 4);
                float wv[8] = {a.x, a.y, a.z, a.w, e.x, e.y, e.z, e.w};
#pragma unroll
                for (int l = 0; l < 8; l++) { o[l] = v[j][l] * scale * wv[l]; amax = fmaxf(amax, fabsf(o[l])); }
            } else {
#pragma unroll
                for (int l = 0; l < 8; l++) o[l] = 0.f;
            }
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            float d = amax / 127.f;
            int q[8], qs = 0;
#pragma unroll
            for (int l = 0; l < 8; l++) { q[l] = amax == 0.f ? 0 : __float2int_rn(o[l] / d); qs += q[l]; }
            qs += __shfl_xor_sync(0xffffffffu, qs, 1);
            qs += __shfl_xor_sync(0xffffffffu, qs, 2);
            float sum = (float)qs * d;       // the values' sum as quantized (exact: small integers)
            if (on) {
                u32 lo = (u32)(q[0] & 0xff) | ((u32)(q[1] & 0xff) << 8) | ((u32)(q[2] & 0xff) << 16) | ((u32)(q[3] & 0xff) << 24);
                u32 hi = (u32)(q[4] & 0xff) | ((u32)(q[5] & 0xff) << 8) | ((u32)(q[6] & 0xff) << 16) | ((u32)(q[7] & 0xff) << 24);
                *(uint2*)(sq + (i64)b * K + c * 8) = make_uint2(lo, hi);
                int g = c / 4;
                if ((lane & 3) == 0) { sd[b * (K / 32) + g] = d; ss[b * (K / 32) + g] = sum; }
                if (out) {
                    *(float4*)(y + (i64)b * K + c * 8) = make_float4(o[0], o[1], o[2], o[3]);
                    *(float4*)(y + (i64)b * K + c * 8 + 4) = make_float4(o[4], o[5], o[6], o[7]);
                    *(uint2*)(yq + (i64)b * K + c * 8) = make_uint2(lo, hi);
                    if ((lane & 3) == 0) { yd[(i64)b * (K / 32) + g] = d; ys[(i64)b * (K / 32) + g] = sum; }
                }
            }
        }
    }
    __syncthreads();
    mmv3_body<MAXB, 1>(MAT_ARGS, n_mats,
                       K, sq, sd, ss, x, B, warp_group(0, rpw), nw, sc);
    if (rpw > 1)
        mmv3_body<MAXB, 1>(MAT_ARGS, n_mats,
                           K, sq, sd, ss, x, B, warp_group(1, rpw), nw, sc);
}
#define MMV3N(NB) extern "C" __global__ void __launch_bounds__(256, 3) mmv3n_b##NB(MAT_PARAMS(0), MAT_PARAMS(1), \
    MAT_PARAMS(2), MAT_PARAMS(3), int n_mats, int K, const float* x, const float* nw, float eps, float* y, i8* yq, float* yd, float* ys, int B, int rpw) { \
    mmv3n_body<NB>(MAT_ARGS, n_mats, K, \
                   x, nw, eps, y, yq, yd, ys, B, rpw); }
MMV3N(1)
MMV3N(2)
MMV3N(4)
MMV3N(8)
// No MMV3N(16): at 3 blocks of 256 an SM (85 registers) 16 rows' accumulators would spill; past 8 rows
// norm_matmuls runs rms_norm_q8, then mmt / mmv3 (backend.py MMV3N_ROWS).

// ---- dense decode products on the tensor cores (mt.cuh) ----
// mmt: out_i[b, n] = x[b] . W_i[n] (+ bias_i[n]) (+ res_i[b, n]) for B <= 16 rows of an f16 x and Q4_K
// or Q6_K weights (the K-quant mixes' dense matrices). mmv3 spends per row and per weight value; at
// 8 rows it took 3.5-3.9x one row's time. A block (32 min(MT_KS, K / 256) threads) takes 16 weight
// rows of one weight (pick_rows): two n-tiles.
#define MMT_NT 2
template <class T>
__device__ __forceinline__ void mmt_run(const MatDesc& m, int n0, int K, const u16* __restrict__ x, int B,
                                        float* __restrict__ red) {
    int lane = threadIdx.x % WARP, g = lane >> 2;
    const u8* rows[MMT_NT];
#pragma unroll
    for (int nt = 0; nt < MMT_NT; nt++) rows[nt] = m.w + (i64)min(n0 + nt * 8 + g, m.n_rows - 1) * m.row_bytes;
    float acc[MMT_NT][4];
    mt_sum<T, MMT_NT>(rows, threadIdx.x / WARP, K / 256, g < B ? x + (i64)g * K : nullptr,
                      g + 8 < B ? x + (i64)(g + 8) * K : nullptr, acc, true);
    mt_reduce<MMT_NT>(acc, red, [&](int nt, int j, int l, float v) {
        int b = (l >> 2) + (j >> 1) * 8, n = n0 + nt * 8 + 2 * (l & 3) + (j & 1);
        if (b < B && n < m.n_rows) {
            if (m.bias) v += m.bias[n];
            if (m.res) v += m.res[(i64)b * m.n_rows + n];
            m.out[(i64)b * m.n_rows + n] = v;
        }
    });
}

// Grid: the weights' tiles of 16 rows (each weight's start a new one); x [B, K] f16, K % 256 == 0,
// B <= 16; every weight Q4_K or Q6_K (the launch sends others to mmv3).
extern "C" __global__ void __launch_bounds__(128) mmt(MAT_PARAMS(0), MAT_PARAMS(1), MAT_PARAMS(2), MAT_PARAMS(3),
                                                      int n_mats, int K, const u16* __restrict__ x, int B) {
    __shared__ float red[MT_KS * MMT_NT * 4 * WARP];
    MatDesc m0 = {w0, rb0, t0, n0, o0, b0, r0}, m1 = {w1, rb1, t1, n1, o1, b1, r1}, m2 = {w2, rb2, t2, n2, o2, b2, r2},
            m3 = {w3, rb3, t3, n3, o3, b3, r3};
    MatDesc m;
    int row;
    bool on = pick_rows(m0, m1, m2, m3, n_mats, MMT_NT * 8, blockIdx.x, m, row);
    if (on && m.type == T_Q4_K) mmt_run<MtQ4K>(m, row, K, x, B, red);
    else if (on && m.type == T_Q6_K) mmt_run<MtQ6K>(m, row, K, x, B, red);
    else { pdl_wait(); pdl_next(); }
}

// Banned ids before a greedy pick (a request whose only logit bias is -inf on some ids, as ignore_eos bans
// the stop ids): grid B, block 32; ban [NB, B] int32 (a graph's input rows, -1: none), each id in range set
// to -inf in its row of x [B, n], as the sampler's bias makes it (argmax_* then pick the first largest of
// what is left).
extern "C" __global__ void ban_ids(float* __restrict__ x, int n, const int* __restrict__ ban, int nb) {
    pdl_wait();
    pdl_next();
    int b = blockIdx.x, nrow = gridDim.x;
    for (int j = threadIdx.x; j < nb; j += blockDim.x) {
        int id = ban[(i64)j * nrow + b];
        if (id >= 0 && id < n) x[(i64)b * n + id] = -INFINITY;
    }
}

// Greedy pick: the first index of the largest logit per row (numpy's argmax tie rule), in two
// passes: argmax_part, grid (NP, B), block 256: block p's best of row b's piece p (8 values a
// thread, four loads in flight) into part_v/part_i [B, NP]; argmax_final, grid B, block 32:
// the best of the NP pieces (a piece's pair is its first best, pieces in index order).
#define AMX_PER 8
extern "C" __global__ void argmax_part(const float* __restrict__ x, int n, float* __restrict__ part_v,
                                       int* __restrict__ part_i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    pdl_wait();
    pdl_next();
    int b = blockIdx.y, np = gridDim.x;
    const float* r = x + (i64)b * n;
    int span = blockDim.x * AMX_PER, i0 = blockIdx.x * span;
    float best = -3.4e38f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int k = 0; k < AMX_PER; k++) {
        int i = i0 + k * blockDim.x + threadIdx.x;     // ascending per thread: its first best is kept
        if (i < n) {
            float v = r[i];
            if (v > best) { best = v; bi = i; }
        }
    }
    warp_argmax(best, bi);
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    if (lane == 0) { sv[w] = best; si[w] = bi; }
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x / WARP;
        best = lane < nw ? sv[lane] : -3.4e38f;
        bi = lane < nw ? si[lane] : 0x7fffffff;
        warp_argmax(best, bi);
        if (lane == 0) { part_v[(i64)b * np + blockIdx.x] = best; part_i[(i64)b * np + blockIdx.x] = bi; }
    }
}
extern "C" __global__ void argmax_final(const float* __restrict__ part_v, const int* __restrict__ part_i, int np,
                                        int* __restrict__ out) {
    pdl_wait();
    pdl_next();
    int b = blockIdx.x, lane = threadIdx.x;
    float best = -3.4e38f;
    int bi = 0x7fffffff;
    for (int p = lane; p < np; p += WARP) {
        float v = part_v[(i64)b * np + p];
        int i = part_i[(i64)b * np + p];
        if (v > best || (v == best && i < bi)) { best = v; bi = i; }
    }
    warp_argmax(best, bi);
    if (lane == 0) out[b] = bi;
}

// The K largest logits of each row (K <= TOPK_MAX), in the sampler chain's order: descending,
// ties to the lower index (sampler._sorted_top), for a sampled pick whose chain after top_k
// runs on the host over K candidates instead of the whole row. A (value, index) pair is one
// 64-bit key, the float's bits made order-preserving above the index's complement, so one
// descending sort gives that order. Two passes: topk_part, grid (NP, B), block 512: block p
// sorts row b's TOPK_SPAN values p*SPAN.. (bitonic, in shared memory) and keeps its first K
// keys in part [B, NP, K], counting NaNs into nan[b] (zeroed by the caller); topk_final, grid B,
// block 1024: sorts the NP*K <= TOPK_SPAN keys and writes the first K as ids and values.
#define TOPK_SPAN 4096
#define TOPK_MAX 64
__device__ __forceinline__ u64 topk_key(float v, int i) {
    u32 u = __float_as_uint(v);
    u32 o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((u64)o << 32) | (u64)(0xFFFFFFFFu - (u32)i);
}
// Sort s[0..TOPK_SPAN) descending with blockDim.x threads (a power of two).
__device__ __forceinline__ void bitonic_desc(u64* s) {
    for (int k = 2; k <= TOPK_SPAN; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < TOPK_SPAN; i += blockDim.x) {
                int l = i ^ j;
                if (l > i) {
                    u64 a = s[i], b = s[l];
                    bool desc = (i & k) == 0;
                    if (desc ? a < b : a > b) { s[i] = b; s[l] = a; }
                }
            }
            __syncthreads();
        }
}
extern "C" __global__ void __launch_bounds__(512) topk_part(const float* __restrict__ x, int n, int K,
                                                            u64* __restrict__ part, int* __restrict__ nan) {
    __shared__ u64 s[TOPK_SPAN];
    pdl_wait();
    pdl_next();
    int b = blockIdx.y, np = gridDim.x, i0 = blockIdx.x * TOPK_SPAN;
    const float* r = x + (i64)b * n;
    int n_nan = 0;
    for (int i = threadIdx.x; i < TOPK_SPAN; i += blockDim.x) {
        int at = i0 + i;
        float v = at < n ? r[at] : 0.f;
        bool bad = at < n && v != v;
        n_nan += bad;
        s[i] = at < n && !bad ? topk_key(v, at) : 0ull;       // past the row, NaN: below every value
    }
    if (n_nan) atomicAdd(nan + b, n_nan);
    __syncthreads();
    bitonic_desc(s);
    for (int k = threadIdx.x; k < K; k += blockDim.x) part[((i64)b * np + blockIdx.x) * K + k] = s[k];
}
extern "C" __global__ void __launch_bounds__(1024) topk_final(const u64* __restrict__ part, int np, int K,
                                                              const float* __restrict__ x, int n,
                                                              int* __restrict__ ids, float* __restrict__ vals) {
    __shared__ u64 s[TOPK_SPAN];
    pdl_wait();
    pdl_next();
    int b = blockIdx.x, m = np * K;
    for (int i = threadIdx.x; i < TOPK_SPAN; i += blockDim.x) s[i] = i < m ? part[(i64)b * m + i] : 0ull;
    __syncthreads();
    bitonic_desc(s);
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        u64 key = s[k];
        int i = (int)(0xFFFFFFFFu - (u32)(key & 0xFFFFFFFFull));
        bool real = key != 0ull;                               // fewer than K values in the row
        ids[(i64)b * K + k] = real ? i : -1;
        vals[(i64)b * K + k] = real ? x[(i64)b * n + i] : -3.4e38f;
    }
}
