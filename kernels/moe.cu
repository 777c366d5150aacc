// The MoE router and the grouped expert FFN for decode-sized batches. Expert e of a
// stacked tensor lives at table[e] (a device pointer per expert), so experts can move
// between card memory and mapped host memory without recapturing a decode graph.
#include "common.cuh"
#include "blocks.cuh"


// softmax over E logits, top-A (ties: lower index first), optional renormalisation of the
// chosen weights (divided by max(sum, 2^-14), as llama.cpp's qwen3moe graph). One block per token.
extern "C" __global__ void moe_route(const float* __restrict__ logits, int E, int A, int norm,
                                     int* __restrict__ ids, float* __restrict__ wts) {
    pdl_wait();
    pdl_next();
    extern __shared__ float p[];          // [E]
    __shared__ float sh[32];
    __shared__ int shi[32];
    const float* z = logits + (i64)blockIdx.x * E;
    float m = -3.4e38f;
    for (int i = threadIdx.x; i < E; i += blockDim.x) m = fmaxf(m, z[i]);
    m = block_max(m, sh);
    float s = 0.f;
    for (int i = threadIdx.x; i < E; i += blockDim.x) { float e = __expf(z[i] - m); p[i] = e; s += e; }
    s = block_sum(s, sh);
    float inv = 1.f / s;
    for (int i = threadIdx.x; i < E; i += blockDim.x) p[i] *= inv;
    __syncthreads();
    float total = 0.f;
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    for (int a = 0; a < A; a++) {
        float best = -1.f; int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < E; i += blockDim.x)
            if (p[i] > best) { best = p[i]; bi = i; }
        warp_argmax(best, bi);
        if (lane == 0) { sh[w] = best; shi[w] = bi; }
        __syncthreads();
        if (w == 0) {
            best = lane < nw ? sh[lane] : -1.f;
            bi = lane < nw ? shi[lane] : 0x7fffffff;
            warp_argmax(best, bi);
            if (lane == 0) {
                ids[(i64)blockIdx.x * A + a] = bi;
                wts[(i64)blockIdx.x * A + a] = best;
                p[bi] = -2.f;     // taken
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && norm) {
        for (int a = 0; a < A; a++) total += wts[(i64)blockIdx.x * A + a];
        total = fmaxf(total, 6.103515625e-5f);
        for (int a = 0; a < A; a++) wts[(i64)blockIdx.x * A + a] /= total;
    }
}

// The same router in one warp per token (E <= 32 * VPL, A <= 32): no block barriers.
template <int VPL>
__device__ __forceinline__ void route_warp(const float* __restrict__ logits, int E, int A, int norm,
                                           int* __restrict__ ids, float* __restrict__ wts) {
    pdl_wait();
    pdl_next();
    int t = blockIdx.x, lane = threadIdx.x % WARP;
    const float* z = logits + (i64)t * E;
    float p[VPL];
    float m = -3.4e38f;
#pragma unroll
    for (int j = 0; j < VPL; j++) {
        int i = lane + WARP * j;
        p[j] = i < E ? z[i] : -3.4e38f;
        m = fmaxf(m, p[j]);
    }
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VPL; j++) {
        p[j] = lane + WARP * j < E ? __expf(p[j] - m) : 0.f;
        s += p[j];
    }
    float inv = 1.f / warp_sum(s);
#pragma unroll
    for (int j = 0; j < VPL; j++) p[j] = lane + WARP * j < E ? p[j] * inv : -1.f;
    float mine_w = 0.f;
    int mine_id = 0;
    for (int a = 0; a < A; a++) {
        float best = -1.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < VPL; j++)
            if (p[j] > best) { best = p[j]; bi = lane + WARP * j; }   // j ascending: lower index on ties
        warp_argmax(best, bi);
#pragma unroll
        for (int j = 0; j < VPL; j++) if (lane + WARP * j == bi) p[j] = -2.f;      // taken
        if (lane == a) { mine_w = best; mine_id = bi; }
    }
    float total = warp_sum(lane < A ? mine_w : 0.f);
    if (lane < A) {
        ids[(i64)t * A + lane] = mine_id;
        wts[(i64)t * A + lane] = norm ? mine_w / fmaxf(total, 6.103515625e-5f) : mine_w;
    }
}
#define MOE_ROUTE_W(VPL) extern "C" __global__ void moe_route_w##VPL(const float* logits, int E, int A, int norm, \
    int* ids, float* wts) { route_warp<VPL>(logits, E, A, norm, ids, wts); }
MOE_ROUTE_W(4)
MOE_ROUTE_W(8)
MOE_ROUTE_W(16)
MOE_ROUTE_W(32)

template <class T>
__device__ __forceinline__ float item_loop(const u8* row, int n_items, const i8* xq, const float* xd, const float* xs) {
    float acc = 0.f;
    for (int it = threadIdx.x % WARP; it < n_items; it += WARP) {
        T w;
        w.load(row, it);
        acc += w.dot(xq, xd, xs, it);
    }
    return acc;
}

// R consecutive rows from row0 (row_bytes apart), their dots added into acc[r] times wt;
// all R rows' loads go out before any is used.
template <class T, int R>
__device__ __forceinline__ void item_rows(const u8* row0, i64 row_bytes, int n_items, const i8* xq, const float* xd,
                                          const float* xs, float wt, float* acc) {
    for (int it = threadIdx.x % WARP; it < n_items; it += WARP) {
        T w[R];
#pragma unroll
        for (int r = 0; r < R; r++) w[r].load(row0 + r * row_bytes, it);
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] += wt * w[r].dot(xq, xd, xs, it);
    }
}
template <int R>
__device__ __forceinline__ void qdot_rows(int type, const u8* row0, i64 row_bytes, int K, const i8* xq, const float* xd,
                                          const float* xs, float wt, float* acc) {
    switch (type) {
        case T_Q4_K: item_rows<Q4K, R>(row0, row_bytes, K / 64, xq, xd, xs, wt, acc); break;
        case T_Q5_K: item_rows<Q5K, R>(row0, row_bytes, K / 64, xq, xd, xs, wt, acc); break;
        case T_Q6_K: item_rows<Q6K, R>(row0, row_bytes, K / 32, xq, xd, xs, wt, acc); break;
        case T_Q8_0: item_rows<Q8_0, R>(row0, row_bytes, K / 32, xq, xd, xs, wt, acc); break;
        case T_Q5_0: item_rows<Q5_0, R>(row0, row_bytes, K / 32, xq, xd, xs, wt, acc); break;
        case T_Q4_0: item_rows<Q4_0, R>(row0, row_bytes, K / 32, xq, xd, xs, wt, acc); break;
    }
}

__device__ __forceinline__ float qdot(int type, const u8* row, int K, const i8* xq, const float* xd, const float* xs) {
    switch (type) {
        case T_Q4_K: return item_loop<Q4K>(row, K / 64, xq, xd, xs);
        case T_Q5_K: return item_loop<Q5K>(row, K / 64, xq, xd, xs);
        case T_Q6_K: return item_loop<Q6K>(row, K / 32, xq, xd, xs);
        case T_Q8_0: return item_loop<Q8_0>(row, K / 32, xq, xd, xs);
        case T_Q5_0: return item_loop<Q5_0>(row, K / 32, xq, xd, xs);
        case T_Q4_0: return item_loop<Q4_0>(row, K / 32, xq, xd, xs);
    }
    return 0.f;
}

// gate and up for each (token, chosen expert): act = silu(x.Wg[e]) * (x.Wu[e]), written
// quantized (int8 per 32) for the down projection. Block = 8 warps of 4 rows, so the block
// holds one whole q8 group; each warp takes its rows two at a time, the four items (gate and
// up of both rows) loaded together. grid (F/32, B*A), block 256. F % 32 == 0.
template <class T>
__device__ __forceinline__ void gate_up_pair(const u8* g0, const u8* u0, const u8* g1, const u8* u1, int n_items,
                                             const i8* xq, const float* xd, const float* xs, float* acc /* [4] */) {
    for (int it = threadIdx.x % WARP; it < n_items; it += WARP) {
        T a, b, c, d;
        a.load(g0, it); b.load(u0, it); c.load(g1, it); d.load(u1, it);
        acc[0] += a.dot(xq, xd, xs, it);
        acc[1] += b.dot(xq, xd, xs, it);
        acc[2] += c.dot(xq, xd, xs, it);
        acc[3] += d.dot(xq, xd, xs, it);
    }
}
__device__ __forceinline__ void gate_up_any(int type, const u8* g0, const u8* u0, const u8* g1, const u8* u1, int K,
                                            const i8* xq, const float* xd, const float* xs, float* acc) {
    switch (type) {
        case T_Q4_K: gate_up_pair<Q4K>(g0, u0, g1, u1, K / 64, xq, xd, xs, acc); break;
        case T_Q5_K: gate_up_pair<Q5K>(g0, u0, g1, u1, K / 64, xq, xd, xs, acc); break;
        case T_Q6_K: gate_up_pair<Q6K>(g0, u0, g1, u1, K / 32, xq, xd, xs, acc); break;
        case T_Q8_0: gate_up_pair<Q8_0>(g0, u0, g1, u1, K / 32, xq, xd, xs, acc); break;
        case T_Q5_0: gate_up_pair<Q5_0>(g0, u0, g1, u1, K / 32, xq, xd, xs, acc); break;
        case T_Q4_0: gate_up_pair<Q4_0>(g0, u0, g1, u1, K / 32, xq, xd, xs, acc); break;
    }
}

// The block's 32 rows of gate and up (g, u: the block's first row of each, in global or shared
// memory): warp w takes rows 4w..4w+3, two at a time; act = silu(gate) * up, then its int8 form.
__device__ __forceinline__ void gate_up_block(const u8* g, const u8* u, int type_g, int type_u, i64 row_bytes_g,
                                              i64 row_bytes_u, int F, int K, const i8* x, const float* d,
                                              const float* s, int ba, i8* __restrict__ aq, float* __restrict__ ad,
                                              float* __restrict__ as_, float* act /* shared [32] */) {
    int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    for (int r = w * 4; r < w * 4 + 4; r += 2) {
        const u8* g0 = g + (i64)r * row_bytes_g;
        const u8* u0 = u + (i64)r * row_bytes_u;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (type_g == type_u) {
            gate_up_any(type_g, g0, u0, g0 + row_bytes_g, u0 + row_bytes_u, K, x, d, s, acc);
        } else {
            acc[0] = qdot(type_g, g0, K, x, d, s);
            acc[1] = qdot(type_u, u0, K, x, d, s);
            acc[2] = qdot(type_g, g0 + row_bytes_g, K, x, d, s);
            acc[3] = qdot(type_u, u0 + row_bytes_u, K, x, d, s);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) acc[j] = warp_sum(acc[j]);
        if (lane == 0) { act[r] = silu(acc[0]) * acc[1]; act[r + 1] = silu(acc[2]) * acc[3]; }
    }
    __syncthreads();
    if (w == 0) {
        float v = act[lane];
        float amax = warp_max(fabsf(v));
        float dd = amax / 127.f;
        int qv = amax == 0.f ? 0 : __float2int_rn(v / dd);
        float sum = warp_sum((float)qv) * dd;
        i64 at = (i64)ba * F + blockIdx.x * 32 + lane;
        aq[at] = (i8)qv;
        if (lane == 0) { ad[at / 32] = dd; as_[at / 32] = sum; }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up(const u64* __restrict__ tab_g, const u64* __restrict__ tab_u,
                                       int type_g, int type_u, i64 row_bytes_g, i64 row_bytes_u, int F, int K,
                                       const i8* __restrict__ xq, const float* __restrict__ xd,
                                       const float* __restrict__ xs, const int* __restrict__ ids, int A,
                                       i8* __restrict__ aq, float* __restrict__ ad, float* __restrict__ as_) {
    __shared__ float act[32];
    pdl_wait();
    pdl_next();
    int ba = blockIdx.y, b = ba / A;
    int e = ids[ba];
    const i8* x = xq + (i64)b * K;
    const float* d = xd + (i64)b * (K / 32);
    const float* s = xs + (i64)b * (K / 32);
    i64 row0 = (i64)blockIdx.x * 32;
    gate_up_block((const u8*)tab_g[e] + row0 * row_bytes_g, (const u8*)tab_u[e] + row0 * row_bytes_u, type_g, type_u,
                  row_bytes_g, row_bytes_u, F, K, x, d, s, ba, aq, ad, as_, act);
}

// down for each token: out[b, row] = (res[b, row]) + sum_a w[b, a] * act[b, a] . Wd[ids[b, a]][row]
// grid (D/DOWN_R, B), block 32*min(A, 8) threads: warp a takes expert slots a, a+8, ... for
// DOWN_R consecutive rows (their loads together); the experts' parts are then added in rank
// order through shared memory (the same order as the numpy backend).
#define DOWN_R 8
// The experts' parts of the block's DOWN_R rows added in rank order (as the numpy backend), plus
// the residual.
__device__ __forceinline__ void down_sum(const float (*part)[DOWN_R], int A, int b, int D, int row,
                                         const float* __restrict__ res, float* __restrict__ out) {
    if (threadIdx.x < DOWN_R) {
        int r = threadIdx.x;
        float total = part[0][r];
        for (int a = 1; a < A; a++) total += part[a][r];
        out[(i64)b * D + row + r] = (res ? res[(i64)b * D + row + r] : 0.f) + total;
    }
}
extern "C" __global__ void __launch_bounds__(256) moe_down(const u64* __restrict__ tab_d, int type_d, i64 row_bytes_d, int D, int F,
                                    const i8* __restrict__ aq, const float* __restrict__ ad,
                                    const float* __restrict__ as_, const int* __restrict__ ids,
                                    const float* __restrict__ wts, int A, const float* __restrict__ res,
                                    float* __restrict__ out) {
    __shared__ float part[32][DOWN_R];     // [expert slot][row], A <= 32
    pdl_wait();
    pdl_next();
    int b = blockIdx.y, w = threadIdx.x / WARP, lane = threadIdx.x % WARP, nw = blockDim.x / WARP;
    int row = blockIdx.x * DOWN_R;
    for (int a = w; a < A; a += nw) {
        i64 ba = (i64)b * A + a;
        const u8* base = (const u8*)tab_d[ids[ba]] + (i64)row * row_bytes_d;
        float acc[DOWN_R];
#pragma unroll
        for (int r = 0; r < DOWN_R; r++) acc[r] = 0.f;
        qdot_rows<DOWN_R>(type_d, base, row_bytes_d, F, aq + ba * F, ad + ba * (F / 32), as_ + ba * (F / 32),
                          wts[ba], acc);
#pragma unroll
        for (int r = 0; r < DOWN_R; r++) {
            float v = warp_sum(acc[r]);
            if (lane == 0) part[a][r] = v;
        }
    }
    __syncthreads();
    down_sum(part, A, b, D, row, res, out);
}

// The same two steps with each block's bytes staged in shared memory first: every weight row
// the block reads (contiguous in the expert's tensor) and the token's int8 activation go out
// as 16-byte cp.async copies at once, so the block waits for memory once, holding no
// registers for it, and then computes from shared memory. Each sum is formed in the same
// order as moe_gate_up / moe_down, so the results are the same bits.
// moe_gate_up_s: grid (F/32, B*A), block 256; dynamic shared memory
//   STAGE_CAP(32 rbg) + STAGE_CAP(32 rbu) + STAGE_CAP(K) + 2 STAGE_CAP(K/8)   (cuda_moe.py)
extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up_s(const u64* __restrict__ tab_g, const u64* __restrict__ tab_u,
                                       int type_g, int type_u, i64 row_bytes_g, i64 row_bytes_u, int F, int K,
                                       const i8* __restrict__ xq, const float* __restrict__ xd,
                                       const float* __restrict__ xs, const int* __restrict__ ids, int A,
                                       i8* __restrict__ aq, float* __restrict__ ad, float* __restrict__ as_) {
    extern __shared__ __align__(16) u8 sm[];
    __shared__ float act[32];
    pdl_wait();
    int ba = blockIdx.y, b = ba / A, tid = threadIdx.x, nt = blockDim.x;
    int e = ids[ba];
    int ng = 32 * (int)row_bytes_g, nu = 32 * (int)row_bytes_u, nf = K / 32 * 4;
    i64 row0 = (i64)blockIdx.x * 32;
    u8* p = sm;
    const u8* gs = stage_async((const u8*)tab_g[e] + row0 * row_bytes_g, ng, p, tid, nt); p += STAGE_CAP(ng);
    const u8* us = stage_async((const u8*)tab_u[e] + row0 * row_bytes_u, nu, p, tid, nt); p += STAGE_CAP(nu);
    const i8* x = (const i8*)stage_async((const u8*)(xq + (i64)b * K), K, p, tid, nt); p += STAGE_CAP(K);
    const float* d = (const float*)stage_async((const u8*)(xd + (i64)b * (K / 32)), nf, p, tid, nt); p += STAGE_CAP(nf);
    const float* s = (const float*)stage_async((const u8*)(xs + (i64)b * (K / 32)), nf, p, tid, nt);
    cp_async_wait_all();
    __syncthreads();
    pdl_next();
    gate_up_block(gs, us, type_g, type_u, row_bytes_g, row_bytes_u, F, K, x, d, s, ba, aq, ad, as_, act);
}

// moe_down_s: grid (D/DOWN_R, B), block 32*min(A, 8); warp a stages its expert's DOWN_R rows and
// activation into its own part of the dynamic shared memory,
//   per warp STAGE_CAP(DOWN_R rbd) + STAGE_CAP(F) + 2 STAGE_CAP(F/8)   (cuda_moe.py),
// then takes the rows two at a time from there.
extern "C" __global__ void __launch_bounds__(256) moe_down_s(const u64* __restrict__ tab_d, int type_d, i64 row_bytes_d, int D, int F,
                                    const i8* __restrict__ aq, const float* __restrict__ ad,
                                    const float* __restrict__ as_, const int* __restrict__ ids,
                                    const float* __restrict__ wts, int A, const float* __restrict__ res,
                                    float* __restrict__ out) {
    extern __shared__ __align__(16) u8 sm[];
    __shared__ float part[32][DOWN_R];     // [expert slot][row], A <= 32
    pdl_wait();
    int b = blockIdx.y, w = threadIdx.x / WARP, lane = threadIdx.x % WARP, nw = blockDim.x / WARP;
    int row = blockIdx.x * DOWN_R;
    int nr = DOWN_R * (int)row_bytes_d, nf = F / 32 * 4;
    u8* mine = sm + (i64)w * (STAGE_CAP(nr) + STAGE_CAP(F) + 2 * STAGE_CAP(nf));
    for (int a = w; a < A; a += nw) {
        i64 ba = (i64)b * A + a;
        u8* p = mine;
        const u8* ws = stage_async((const u8*)tab_d[ids[ba]] + (i64)row * row_bytes_d, nr, p, lane, WARP); p += STAGE_CAP(nr);
        const i8* x = (const i8*)stage_async((const u8*)(aq + ba * F), F, p, lane, WARP); p += STAGE_CAP(F);
        const float* d = (const float*)stage_async((const u8*)(ad + ba * (F / 32)), nf, p, lane, WARP); p += STAGE_CAP(nf);
        const float* s = (const float*)stage_async((const u8*)(as_ + ba * (F / 32)), nf, p, lane, WARP);
        float wt = wts[ba];
        cp_async_wait_all();
        __syncwarp();
        if (a == w) pdl_next();
        float acc[DOWN_R];
#pragma unroll
        for (int r = 0; r < DOWN_R; r++) acc[r] = 0.f;
#pragma unroll
        for (int r = 0; r < DOWN_R; r += 2) qdot_rows<2>(type_d, ws + (i64)r * row_bytes_d, row_bytes_d, F, x, d, s, wt, acc + r);
#pragma unroll
        for (int r = 0; r < DOWN_R; r++) {
            float v = warp_sum(acc[r]);
            if (lane == 0) part[a][r] = v;
        }
        __syncwarp();                      // the next pass stages into the same bytes
    }
    __syncthreads();
    down_sum(part, A, b, D, row, res, out);
}

// Prompt path: rows of x placed in expert order (out[dst[j]] = x[src[j]]), and the expert
// outputs scattered back, weighted and summed per token in rank order.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const int* __restrict__ src,
                                       const int* __restrict__ dst, int n, int D, u16* __restrict__ out_f16) {
    pdl_wait();
    pdl_next();
    int j = blockIdx.x;
    if (j >= n) return;
    const float* r = x + (i64)src[j] * D;
    u16* o = out_f16 + (i64)dst[j] * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = f2h(r[i]);
}
// pos_of[t*A + a] = row of (token t, rank a) in the expert-ordered output y [n, D]; null: y's rows are
// the pairs themselves (row t*A + a).
extern "C" __global__ void combine_rows(const float* __restrict__ y, const int* __restrict__ pos_of,
                                        const float* __restrict__ wts, int A, int D,
                                        const float* __restrict__ res, float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    int t = blockIdx.x;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float acc = 0.f;
        for (int a = 0; a < A; a++) {
            i64 r = pos_of ? pos_of[(i64)t * A + a] : (i64)t * A + a;
            acc += wts[(i64)t * A + a] * y[r * D + i];
        }
        out[(i64)t * D + i] = (res ? res[(i64)t * D + i] : 0.f) + acc;
    }
}

// Decode's streamed lane (engine/cuda/experts.py): a picked host expert the card computes itself is
// copied from pinned host RAM (mapped into the card's address space) into its staging slot over the
// bus, before the layer's expert kernels read it there. src [3, E]: each stack's host address of
// expert e; dst [E]: e's staging slot (0: not streamed); seg0..2: the stacks' bytes per expert (the
// slot holds them back to back). grid (chunks, T*A), block 256: 16-byte loads, four in flight.
extern "C" __global__ void __launch_bounds__(256) moe_stream_in(const u64* __restrict__ src, const u64* __restrict__ dst,
                                                                int E, const int* __restrict__ ids, int n_pairs,
                                                                i64 seg0, i64 seg1, i64 seg2) {
    pdl_wait();
    pdl_next();
    int p = blockIdx.y;
    if (p >= n_pairs) return;
    int e = ids[p];
    u64 to = dst[e];
    if (!to) return;
    for (int q = 0; q < p; q++)
        if (ids[q] == e) return;                       // copied by the first pair that picked it
    const i64 seg[3] = {seg0, seg1, seg2};
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 off = 0;
    for (int k = 0; k < 3; k++) {
        const uint4* s = (const uint4*)src[(i64)k * E + e];
        uint4* d = (uint4*)(to + off);
        const i64 n = seg[k] / 16;
        i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
        for (; i + 3 * stride < n; i += 4 * stride) {
            uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], f = s[i + 3 * stride];
            d[i] = a; d[i + stride] = b; d[i + 2 * stride] = c; d[i + 3 * stride] = f;
        }
        for (; i < n; i += stride) d[i] = s[i];
        off += seg[k];
    }
}


// The doorbell (kernels/host_moe.c, "the doorbell"; engine/cuda/experts.py): a decode step's host
// part handed over through pinned host RAM the card maps. host_post (one block) first splits the
// step's host picks in two lanes: of the m distinct host experts the ids pick (host[e] != 0: the
// staging buffer's address, rewritten when it moves), the first min(floor(m * share + 1/2), n_slots)
// in pick order go over the bus, the i-th of them into staging slot i (its table entries point at the slot, dst_step[e] = the slot for moe_stream_in,
// skip[e] = 1 for the host), and the rest stay with the host (entries at the zero block, dst_step
// 0, skip 0). Slots go by a step's bus rank, not by expert, so the staging buffer's n_slots bound
// the lane whatever residency moves are in flight. ids holds at most 512 picks (16 rows of 32). Then
// it writes the rows, ids and weights into the layer's pinned buffers and, once all of that is
// visible to the host, the job word post[layer] = 64 n + T (n the layer's job count, kept in
// seq[layer] on the card).
#define POST_PICKS 512
#define BELL_WORD 64                 // T < BELL_WORD in the job word (host_moe.c, host_moe.py)
extern "C" __global__ void __launch_bounds__(512) host_post(
        const float* __restrict__ x, const int* __restrict__ ids, const float* __restrict__ wts, int n_x, int n_a,
        float* hx, int* hids, float* hwts, i64* seq, i64* post, int layer, int t,
        const u64* __restrict__ host, float share, i64 slot_bytes, int n_slots, u64* tab_g, u64* tab_u,
        u64* tab_d, u64 zero, i64 off_u, i64 off_d, u8* skip, u64* dst_step) {
    pdl_wait();
    pdl_next();
    __shared__ int first[POST_PICKS], rank[POST_PICKS];
    __shared__ int n_host;
    for (int p = threadIdx.x; p < n_a; p += blockDim.x) {
        const int e = ids[p];
        int f = host[e] != 0;
        for (int q = 0; f && q < p; q++)
            if (ids[q] == e) f = 0;                    // counted at its first pick
        first[p] = f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int m = 0;
        for (int p = 0; p < n_a; p++) { rank[p] = m; m += first[p]; }
        n_host = m;
    }
    __syncthreads();
    const int n_bus = min((int)floorf((float)n_host * share + 0.5f), n_slots);
    for (int p = threadIdx.x; p < n_a; p += blockDim.x) {
        if (!first[p]) continue;
        const int e = ids[p];
        const u64 to = host[e] + (u64)rank[p] * (u64)slot_bytes;
        const bool bus = rank[p] < n_bus;
        tab_g[e] = bus ? to : zero;
        tab_u[e] = bus ? to + (u64)off_u : zero;
        tab_d[e] = bus ? to + (u64)off_d : zero;
        dst_step[e] = bus ? to : 0;
        skip[e] = bus ? 1 : 0;
    }
    for (int i = threadIdx.x; i < n_x; i += blockDim.x) hx[i] = x[i];
    for (int i = threadIdx.x; i < n_a; i += blockDim.x) { hids[i] = ids[i]; hwts[i] = wts[i]; }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const i64 s = seq[layer] + 1;
        seq[layer] = s;
        *(volatile i64*)(post + layer) = s * BELL_WORD + t;
        __threadfence_system();
    }
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// out [T, D] += the host's sum, once done[layer] holds this step's job word. One block a row; each
// block's first thread waits (a host that answers nothing for 60 s is dead: the kernel traps, so
// the step fails loudly instead of adding a sum that is not there).
extern "C" __global__ void __launch_bounds__(256) host_take(float* __restrict__ out, const float* hout, int d,
                                                          const i64* __restrict__ seq, const i64* done,
                                                          int layer, int t) {
    pdl_wait();
    pdl_next();
    if (threadIdx.x == 0) {
        const i64 want = seq[layer] * BELL_WORD + t;
        const u64 t0 = global_ns();
        while (__ldcv(done + layer) != want) {
            __nanosleep(200);
            if (global_ns() - t0 > 60000000000ull) __trap();
        }
        __threadfence_system();
    }
    __syncthreads();
    const i64 row = (i64)blockIdx.x * d;
    const float4* h4 = (const float4*)(hout + row);
    float4* o4 = (float4*)(out + row);
    for (int i = threadIdx.x; i < d / 4; i += blockDim.x) {
        const float4 h = __ldcv(h4 + i);
        float4 o = o4[i];
        o.x += h.x; o.y += h.y; o.z += h.z; o.w += h.w;
        o4[i] = o;
    }
}
