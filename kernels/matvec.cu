// Matrix-vector products for decode and small batches, reading GGUF blocks in place.
// The activation is quantized to int8 per 32 values first (quantize_q8), as
// llama.cpp's CUDA mmvq does, so the inner loop is dp4a on packed nibbles.
#include "common.cuh"
#include "blocks.cuh"


// x [rows, K] float -> xq int8 [rows, K], xd [rows, K/32] scale, xs [rows, K/32] = xd * sum(xq).
// One warp per 32 values; optional y = x * rsqrt(mean(x^2)+eps) * w first (fused RMSNorm:
// then one block per row). Plain version: grid (rows*K/32/8), block 256.
extern "C" __global__ void quantize_q8(const float* __restrict__ x, int K, int n_blocks,
                                       i8* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs) {
    int blk = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (blk >= n_blocks) return;
    float v = x[(i64)blk * 32 + lane];
    float amax = warp_max(fabsf(v));
    float d = amax / 127.f;
    int q = amax == 0.f ? 0 : __float2int_rn(v / d);
    float sum = warp_sum((float)q) * d;      // the sum of the values as quantized: offsets cancel exactly
    xq[(i64)blk * 32 + lane] = (i8)q;
    if (lane == 0) { xd[blk] = d; xs[blk] = sum; }
}

// RMSNorm then quantize: one block per row (blockDim a multiple of 32, K <= 8 * blockDim);
// writes y (float) and, when yq is set (K % 32 == 0), its int8-per-32 form.
extern "C" __global__ void rms_norm_q8(const float* __restrict__ x, const float* __restrict__ w, int K, float eps,
                                       float* __restrict__ y, i8* __restrict__ yq, float* __restrict__ yd,
                                       float* __restrict__ ys) {
    __shared__ float sh[32];
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

template <class T, int MAXB, int R>
__device__ __forceinline__ void rows_f(const u8* __restrict__ row, i64 row_bytes, int n_rows_left,
                                       const float* __restrict__ x, int K, int B, float (*acc)[MAXB]) {
    int lane = threadIdx.x % WARP;
    for (int i = lane * 4; i < K; i += WARP * 4) {      // K % 4 == 0: four values per lane per step
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r >= n_rows_left) break;
            const u8* rr = row + r * row_bytes;
            float w0 = T::get(rr, i), w1 = T::get(rr, i + 1), w2 = T::get(rr, i + 2), w3 = T::get(rr, i + 3);
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
                                        const float* xs, const float* xf, int B, float (*acc)[MAXB]) {
    switch (type) {
        case T_Q4_K: rows_q<Q4K, MAXB, R>(row, rb, nr, K / 64, xq, xd, xs, K, B, acc); break;
        case T_Q5_K: rows_q<Q5K, MAXB, R>(row, rb, nr, K / 64, xq, xd, xs, K, B, acc); break;
        case T_Q6_K: rows_q<Q6K, MAXB, R>(row, rb, nr, K / 32, xq, xd, xs, K, B, acc); break;
        case T_Q8_0: rows_q<Q8_0, MAXB, R>(row, rb, nr, K / 32, xq, xd, xs, K, B, acc); break;
        case T_Q5_0: rows_q<Q5_0, MAXB, R>(row, rb, nr, K / 32, xq, xd, xs, K, B, acc); break;
        case T_Q4_0: rows_q<Q4_0, MAXB, R>(row, rb, nr, K / 32, xq, xd, xs, K, B, acc); break;
        case T_F32: rows_f<F32W, MAXB, R>(row, rb, nr, xf, K, B, acc); break;
        case T_F16: rows_f<F16W, MAXB, R>(row, rb, nr, xf, K, B, acc); break;
        case T_BF16: rows_f<BF16W, MAXB, R>(row, rb, nr, xf, K, B, acc); break;
    }
}

// Up to three weights over one activation in one launch (Q, K and V; or a single matrix).
// Rows [0, n0) belong to weight 0, [n0, n0+n1) to weight 1, the rest to weight 2. One warp per
// row, all B tokens per warp so each weight byte is read once. out_i[b, row] = x_b . W_i[row]
// (+ bias_i[row]) (+ res_i[b, row]).
struct MatDesc {
    const u8* w; i64 row_bytes; int type; int n_rows;
    float* out; const float* bias; const float* res;
};
#define MAT_PARAMS(i) const u8* w##i, i64 rb##i, int t##i, int n##i, float* o##i, const float* b##i, const float* r##i
// Rows go to warps R at a time: rows [0, n0) are weight 0's, then weight 1's, then 2's; a
// group of R rows never straddles two weights (each weight's rows start a new group).
template <int MAXB, int R>
__device__ __forceinline__ void mmv3_body(MAT_PARAMS(0), MAT_PARAMS(1), MAT_PARAMS(2), int n_mats, int K,
                                          const i8* __restrict__ xq, const float* __restrict__ xd,
                                          const float* __restrict__ xs, const float* __restrict__ xf, int B) {
    MatDesc m0 = {w0, rb0, t0, n0, o0, b0, r0}, m1 = {w1, rb1, t1, n1, o1, b1, r1}, m2 = {w2, rb2, t2, n2, o2, b2, r2};
    int group = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int g0 = (m0.n_rows + R - 1) / R, g1 = (m1.n_rows + R - 1) / R, g2 = (m2.n_rows + R - 1) / R;
    MatDesc m = m0;
    if (group >= g0) {
        group -= g0;
        m = m1;
        if (n_mats < 2) return;
        if (group >= g1) {
            group -= g1;
            m = m2;
            if (n_mats < 3 || group >= g2) return;
        }
    }
    int row = group * R;
    int nr = min(R, m.n_rows - row);
    float acc[R][MAXB];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < MAXB; b++) acc[r][b] = 0.f;
    row_dot<MAXB, R>(m.type, m.w + (i64)row * m.row_bytes, m.row_bytes, nr, K, xq, xd, xs, xf, B, acc);
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < MAXB; b++) acc[r][b] = warp_sum(acc[r][b]);
    if (threadIdx.x % WARP == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r >= nr) break;
            for (int b = 0; b < B; b++) {
                float v = acc[r][b];
                if (m.bias) v += m.bias[row + r];
                if (m.res) v += m.res[(i64)b * m.n_rows + row + r];
                m.out[(i64)b * m.n_rows + row + r] = v;
            }
        }
    }
}

#define MMV_R(NB) 1     // rows per warp (more measured slower on the H200: registers cut occupancy)
#define MMV3(NB) extern "C" __global__ void mmv3_b##NB(MAT_PARAMS(0), MAT_PARAMS(1), MAT_PARAMS(2), int n_mats, \
    int K, const i8* xq, const float* xd, const float* xs, const float* xf, int B) { \
    mmv3_body<NB, MMV_R(NB)>(w0, rb0, t0, n0, o0, b0, r0, w1, rb1, t1, n1, o1, b1, r1, w2, rb2, t2, n2, o2, b2, r2, n_mats, K, \
                  xq, xd, xs, xf, B); }
MMV3(1)
MMV3(2)
MMV3(4)
MMV3(8)

// Greedy pick: the first index of the largest logit per row (numpy's argmax tie rule).
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int n, int* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* r = x + (i64)blockIdx.x * n;
    float best = -3.4e38f;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = r[i];
        if (v > best) { best = v; bi = i; }
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
        if (lane == 0) out[blockIdx.x] = bi;
    }
}
