// The recurrent state of a linear-attention layer (the qwen35 family's Gated DeltaNet) on the card: the
// conv window's decode step (B rows each one step of its own slot) and the delta rule over prompt spans
// and decode rows, each one kernel that gathers a slot's state, steps it and writes it back, where the
// array code of engine/cuda/recurrent.py (kept for comparison, and the conv's prompt spans) takes some
// thirty launches a layer, and a Python loop over 64-row chunks in a prompt. Also the L2 norm of q and k
// rows in one launch.
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
// before its add (the array code's bits), then SiLU where asked (x / (1 + e^-x), as the silu op); the
// window becomes the last K-1 of them.
// grid (ceil(C / 256), B), block 256. K <= 8.
extern "C" __global__ void conv_dec(float* __restrict__ win, const float* __restrict__ x, long long x_stride,
                                    const float* __restrict__ w, int C, int K, const int* __restrict__ slots,
                                    const int* __restrict__ positions, int* __restrict__ held, int silu,
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
    out[(long long)b * C + c] = silu ? acc / (1.0f + expf(-acc)) : acc;
}

// The gated delta rule over segments of rows, each segment one slot's consecutive rows (a prompt span, or
// one decode row): state [n_slots, H, S, S] the layer's, with state[s, h, j, i] = S[i][j] of head h; q, k
// [T, Hk, S] and v [T, H, S] (rows q_stride, k_stride, v_stride apart; value head h reads key head h % Hk),
// the gates' projections alpha and b [T, H] with dt_bias and a [H]: g = softplus(alpha + dt_bias) * a and
// beta = sigmoid(b), as the elementwise ops make them (delta_gates); out [T, H, S]. Per row, per head
// (ggml_gated_delta_net's step, row after row as ggml's CPU kernel): S <- S exp(g); d = (v - S^T k) beta; S <- S + k d^T; out = S^T q scale. Column j of S (a
// row of `state`, S values) evolves on its own given k, q, v[j]: a warp holds DS_R of them in registers,
// S / 32 values a lane, over the segment's rows, so each state value is read and written once a call.
// Segment z: its slot and first position seg_slot[z], seg_pos[z] (0: from zeros), its rows seg_row0[z] ..
// + seg_len[z] (both null: row z alone). Segments are distinct slots.
// grid (H, ceil(S / (4 * DS_R)), segments), block 128. S % 32 == 0 or S < 32; S <= 256.
#define DS_R 2
template <int NV>
__device__ __forceinline__ void delta_scan_body(
        float* __restrict__ state, const float* __restrict__ q, long long q_stride, const float* __restrict__ k,
        long long k_stride, const float* __restrict__ v, long long v_stride, const float* __restrict__ alpha,
        const float* __restrict__ braw, const float* __restrict__ dt_bias, const float* __restrict__ a, int H,
        int Hk, int S, float scale, int slot, int pos, int r0, int n, float* __restrict__ out) {
    int h = blockIdx.x, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, hk = h % Hk;
    int j0 = (blockIdx.y * (blockDim.x / WARP) + warp) * DS_R;
    if (j0 >= S) return;
    float* st = state + ((long long)slot * H + h) * S * S;
    float m[DS_R][NV];
#pragma unroll
    for (int r = 0; r < DS_R; r++)
#pragma unroll
        for (int t = 0; t < NV; t++) {
            int i = lane + WARP * t, j = j0 + r;
            m[r][t] = (pos != 0 && i < S && j < S) ? st[(long long)j * S + i] : 0.f;
        }
    for (int row = r0; row < r0 + n; row++) {
        const float* qr = q + (long long)row * q_stride + (long long)hk * S;
        const float* kr = k + (long long)row * k_stride + (long long)hk * S;
        const float* vr = v + (long long)row * v_stride + (long long)h * S;
        float qv[NV], kv[NV], vj[DS_R];
#pragma unroll
        for (int t = 0; t < NV; t++) {
            int i = lane + WARP * t;
            qv[t] = i < S ? qr[i] : 0.f;
            kv[t] = i < S ? kr[i] : 0.f;
        }
#pragma unroll
        for (int r = 0; r < DS_R; r++) vj[r] = j0 + r < S ? vr[j0 + r] : 0.f;
        float x = alpha[(long long)row * H + h] + dt_bias[h];
        float g = (x > 20.0f ? x : logf(1.0f + expf(x))) * a[h];              // softplus(alpha + dt_bias) * a
        float eg = expf(g), bt = 1.0f / (1.0f + expf(-braw[(long long)row * H + h]));   // beta = sigmoid(b)
        float sk[DS_R], oq[DS_R];
#pragma unroll
        for (int r = 0; r < DS_R; r++) {
            sk[r] = 0.f;
#pragma unroll
            for (int t = 0; t < NV; t++) {
                m[r][t] *= eg;
                sk[r] += m[r][t] * kv[t];
            }
        }
#pragma unroll
        for (int r = 0; r < DS_R; r++) sk[r] = warp_sum(sk[r]);
#pragma unroll
        for (int r = 0; r < DS_R; r++) {
            float d = (vj[r] - sk[r]) * bt;
            oq[r] = 0.f;
#pragma unroll
            for (int t = 0; t < NV; t++) {
                m[r][t] += d * kv[t];
                oq[r] += m[r][t] * qv[t];
            }
        }
#pragma unroll
        for (int r = 0; r < DS_R; r++) oq[r] = warp_sum(oq[r]);
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < DS_R; r++)
                if (j0 + r < S) out[((long long)row * H + h) * S + j0 + r] = oq[r] * scale;
    }
#pragma unroll
    for (int r = 0; r < DS_R; r++)
#pragma unroll
        for (int t = 0; t < NV; t++) {
            int i = lane + WARP * t, j = j0 + r;
            if (i < S && j < S) st[(long long)j * S + i] = m[r][t];
        }
}
extern "C" __global__ void __launch_bounds__(128) delta_scan(
        float* __restrict__ state, const float* __restrict__ q, long long q_stride, const float* __restrict__ k,
        long long k_stride, const float* __restrict__ v, long long v_stride, const float* __restrict__ alpha,
        const float* __restrict__ braw, const float* __restrict__ dt_bias, const float* __restrict__ a, int H,
        int Hk, int S, float scale, const int* __restrict__ seg_slot,
        const int* __restrict__ seg_pos, const int* __restrict__ seg_row0, const int* __restrict__ seg_len,
        int* __restrict__ held, float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    int z = blockIdx.z, slot = seg_slot[z], pos = seg_pos[z];
    int r0 = seg_row0 ? seg_row0[z] : z, n = seg_len ? seg_len[z] : 1;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) claim(held, slot, pos);
    int nv = (S + WARP - 1) / WARP;
    if (nv <= 1) delta_scan_body<1>(state, q, q_stride, k, k_stride, v, v_stride, alpha, braw, dt_bias, a, H, Hk, S, scale, slot, pos, r0, n, out);
    else if (nv <= 2) delta_scan_body<2>(state, q, q_stride, k, k_stride, v, v_stride, alpha, braw, dt_bias, a, H, Hk, S, scale, slot, pos, r0, n, out);
    else if (nv <= 4) delta_scan_body<4>(state, q, q_stride, k, k_stride, v, v_stride, alpha, braw, dt_bias, a, H, Hk, S, scale, slot, pos, r0, n, out);
    else delta_scan_body<8>(state, q, q_stride, k, k_stride, v, v_stride, alpha, braw, dt_bias, a, H, Hk, S, scale, slot, pos, r0, n, out);
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
