// The decode step of a linear-attention layer's recurrent state (the qwen35 family's Gated DeltaNet),
// B rows each one step of its own slot: the state gathered by slot, stepped and written back in one
// kernel each, where the array code (engine/cuda/recurrent.py, kept for prompt spans) takes some
// thirty launches a layer. Also the L2 norm of q and k rows in one launch.
#include "common.cuh"

// The counts of positions a part of a layer holds per slot (RecurrentState.held[part, layer]): the row's
// slot now holds position + 1, or -1 where the position was neither 0 nor what it held (the next span
// that would carry on from it is then refused by name). held null: the host checked and counted already.
__device__ __forceinline__ void claim(int* held, int slot, int pos) {
    if (held == nullptr) return;
    int old = held[slot];
    held[slot] = (pos == 0 || pos == old) ? pos + 1 : -1;
}

// The causal depthwise conv (recurrent.conv_decode): win [n_slots, K-1, C] the layer's windows, x [B, C]
// rows x_stride apart, w [C, K] f32, slots and positions [B]; a row at position 0 starts from zeros.
// out[b, c] = sum_j full[j, c] w[c, j] over the window then the row, in j order, each product rounded
// before its add (the array code's bits); the window becomes the last K-1 of them.
// grid (ceil(C / 256), B), block 256. K <= 8.
extern "C" __global__ void conv_dec(float* __restrict__ win, const float* __restrict__ x, long long x_stride,
                                    const float* __restrict__ w, int C, int K, const int* __restrict__ slots,
                                    const int* __restrict__ positions, int* __restrict__ held,
                                    float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    int b = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    int slot = slots[b], pos = positions[b];
    if (blockIdx.x == 0 && threadIdx.x == 0) claim(held, slot, pos);
    if (c >= C) return;
    float* wn = win + (long long)slot * (K - 1) * C + c;
    float full[8];
    for (int j = 0; j < K - 1; j++) full[j] = pos == 0 ? 0.f : wn[(long long)j * C];
    full[K - 1] = x[(long long)b * x_stride + c];
    float acc = 0.f;
    for (int j = 0; j < K; j++) acc = __fadd_rn(acc, __fmul_rn(full[j], w[(long long)c * K + j]));
    for (int j = 0; j < K - 1; j++) wn[(long long)j * C] = full[j + 1];
    out[(long long)b * C + c] = acc;
}

// The gated delta rule's step (recurrent.delta_decode): state [n_slots, H, S, S] the layer's, with
// state[s, h, j, i] = S[i][j] of head h; q, k [B, Hk, S] and v [B, H, S] (rows q_stride, k_stride,
// v_stride apart; value head h reads key head h % Hk), g, beta [B, H]; out [B, H, S]. Per head:
// S <- S exp(g); d = (v - S^T k) beta; S <- S + k d^T; out = S^T q scale. Column j of S (a row of
// state, S values) is one warp's, S / 32 values a lane, so each state value is read and written once.
// grid (H, B), block 128 (a warp takes j = warp, warp + 4, ...). S % 32 == 0 or S < 32; S <= 256.
#define DN_MAXV 8
extern "C" __global__ void __launch_bounds__(128) delta_dec(
        float* __restrict__ state, const float* __restrict__ q, long long q_stride, const float* __restrict__ k,
        long long k_stride, const float* __restrict__ v, long long v_stride, const float* __restrict__ g,
        const float* __restrict__ beta, int H, int Hk, int S, float scale, const int* __restrict__ slots,
        const int* __restrict__ positions, int* __restrict__ held, float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    int h = blockIdx.x, b = blockIdx.y, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int nw = blockDim.x / WARP, slot = slots[b], pos = positions[b], hk = h % Hk;
    if (h == 0 && threadIdx.x == 0) claim(held, slot, pos);
    const float* qr = q + (long long)b * q_stride + (long long)hk * S;
    const float* kr = k + (long long)b * k_stride + (long long)hk * S;
    float qv[DN_MAXV], kv[DN_MAXV];
#pragma unroll
    for (int t = 0; t < DN_MAXV; t++) {
        int i = lane + WARP * t;
        qv[t] = i < S ? qr[i] : 0.f;
        kv[t] = i < S ? kr[i] : 0.f;
    }
    float eg = expf(g[(long long)b * H + h]), bt = beta[(long long)b * H + h];
    float* st = state + ((long long)slot * H + h) * S * S;
    const float* vr = v + (long long)b * v_stride + (long long)h * S;
    float* o = out + ((long long)b * H + h) * S;
    for (int j = warp; j < S; j += nw) {
        float m[DN_MAXV], sk = 0.f;
#pragma unroll
        for (int t = 0; t < DN_MAXV; t++) {
            int i = lane + WARP * t;
            m[t] = (i < S && pos != 0) ? st[(long long)j * S + i] * eg : 0.f;
            sk += m[t] * kv[t];
        }
        sk = warp_sum(sk);
        float d = (vr[j] - sk) * bt, oq = 0.f;
#pragma unroll
        for (int t = 0; t < DN_MAXV; t++) {
            m[t] += d * kv[t];
            oq += m[t] * qv[t];
            int i = lane + WARP * t;
            if (i < S) st[(long long)j * S + i] = m[t];
        }
        oq = warp_sum(oq);
        if (lane == 0) o[j] = oq * scale;
    }
}

// x / sqrt(sum x^2 + eps) over rows of n (the l2_norm op, as llama.cpp builds it for the delta rule:
// rms_norm with eps / n, then times 1 / sqrt(n)): x [R, n] rows x_stride apart -> out [R, n]. eps_n is
// eps / n and inv_sqrt_n 1 / sqrt(n), both rounded to f32 on the host. grid (R), block 32.
extern "C" __global__ void l2_norm_rows(const float* __restrict__ x, long long x_stride, int n, float eps_n,
                                        float inv_sqrt_n, float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    const float* xr = x + (long long)blockIdx.x * x_stride;
    float* yr = out + (long long)blockIdx.x * n;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += WARP) s += xr[i] * xr[i];
    s = warp_sum(s);
    float scale = 1.f / sqrtf(s / (float)n + eps_n);
    for (int i = threadIdx.x; i < n; i += WARP) yr[i] = (xr[i] * scale) * inv_sqrt_n;
}
