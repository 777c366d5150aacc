// Attention over the per-slot F16 KV cache, laid out [layer][slot][kv head][position][Dh].
// rope_store: per-head RMSNorm (optional), NEOX RoPE, K/V written at each row's (slot, pos).
// attn_split + attn_merge: decode-style attention, each row its own slot and position,
// the context cut into CH-position pieces (flash-decoding), merged in a second pass.
// softmax_causal: the prompt path's masked softmax between its two GEMMs.
#include "common.cuh"

// grid (T, H + Hkv), block Dh/2 threads (a multiple of 32). q, k, v: [T, H*Dh], [T, Hkv*Dh] x2.
extern "C" __global__ void rope_store(const float* __restrict__ q, const float* __restrict__ k,
                                      const float* __restrict__ v, const float* __restrict__ q_norm,
                                      const float* __restrict__ k_norm, float eps,
                                      const int* __restrict__ slots, const int* __restrict__ pos,
                                      int H, int Hkv, int Dh, int n_rot, float log2_base,
                                      i64 layer_off, i64 slot_stride, int C,
                                      u16* __restrict__ kc, u16* __restrict__ vc, float* __restrict__ q_out) {
    __shared__ float sh[32];
    int t = blockIdx.x, hh = blockIdx.y, i = threadIdx.x, half = Dh / 2;
    bool is_q = hh < H;
    int head = is_q ? hh : hh - H;
    const float* src = is_q ? q + ((i64)t * H + head) * Dh : k + ((i64)t * Hkv + head) * Dh;
    float x0 = src[i], x1 = src[i + half];
    const float* nw = is_q ? q_norm : k_norm;
    if (nw) {
        float ss = block_sum(x0 * x0 + x1 * x1, sh);
        float sc = rsqrtf(ss / (float)Dh + eps);
        x0 = x0 * sc * nw[i];
        x1 = x1 * sc * nw[i + half];
    }
    // NEOX pairs (i, i + Dh/2): the backend requires n_rot == Dh (Qwen2/3 and their MoE)
    float theta = (float)pos[t] * exp2f(-2.f * (float)i / (float)n_rot * log2_base);
    float s_, c_;
    sincosf(theta, &s_, &c_);
    float y0 = x0 * c_ - x1 * s_;
    float y1 = x0 * s_ + x1 * c_;
    int p = pos[t];
    if (is_q) {
        float* o = q_out + ((i64)t * H + head) * Dh;
        o[i] = y0; o[i + half] = y1;
    } else {
        i64 at = layer_off + (i64)slots[t] * slot_stride + ((i64)head * C + p) * Dh;
        kc[at + i] = f2h(y0); kc[at + i + half] = f2h(y1);
        const float* vs = v + ((i64)t * Hkv + head) * Dh;
        vc[at + i] = f2h(vs[i]); vc[at + i + half] = f2h(vs[i + half]);
    }
}

// Decode-style attention in two passes. attn_split: grid (n_split, Hkv, T), block CH threads;
// split `s` covers positions [s*CH, (s+1)*CH) of row t's slot, thread i one position: it
// loads its whole K and V rows at once (16-byte loads, V into shared memory) and scores K
// for all G query heads of the kv head (q in shared memory); then one warp per head takes
// the softmax pieces, and thread d sums P[g] x V[., d] for every head.
// part_m/part_l [T, H, n_split], part_o [T, H, n_split, Dh]. G <= MAXG.
// (Measured on the H200: 1.23 ms per token over 48 layers at depth 512; a variant with four
// threads per position measured 3.2 ms. docs/performance.md.)
#define MAXG 16
template <int DH>
__device__ __forceinline__ void attn_split_body(const float* __restrict__ q, const u16* __restrict__ kc,
                                                const u16* __restrict__ vc, const int* __restrict__ slots,
                                                const int* __restrict__ pos, int H, int Hkv,
                                                i64 layer_off, i64 slot_stride, int C, float scale,
                                                float* __restrict__ part_m, float* __restrict__ part_l,
                                                float* __restrict__ part_o) {
    extern __shared__ float sm[];
    const int CH = blockDim.x;
    int split = blockIdx.x, kv = blockIdx.y, t = blockIdx.z, n_split = gridDim.x;
    int G = H / Hkv, tid = threadIdx.x, lane = tid % WARP, w = tid / WARP, nw = blockDim.x / WARP;
    float* sq = sm;                    // [G][DH]
    float* ss = sm + G * DH;           // [G][CH]
    float* sml = ss + G * CH;          // [2][MAXG]
    u16* sv = (u16*)(sml + 2 * MAXG);  // [CH][DH] this split's V rows
    int n_kv = pos[t] + 1;
    int p0 = split * CH;
    i64 pbase = ((i64)t * H + kv * G) * n_split + split;     // head g at pbase + g * n_split
    if (p0 >= n_kv) {
        if (tid < G) { part_m[pbase + (i64)tid * n_split] = -3.0e38f; part_l[pbase + (i64)tid * n_split] = 0.f; }
        return;
    }
    for (int i = tid; i < G * DH; i += blockDim.x) sq[i] = q[((i64)t * H + kv * G) * DH + i] * scale;
    __syncthreads();
    i64 base = layer_off + (i64)slots[t] * slot_stride + (i64)kv * C * DH;
    int p = p0 + tid;
    float s[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; g++) s[g] = 0.f;
    if (p < n_kv) {
        // all of this position's K and V loads go out before the first use
        const uint4* kr = (const uint4*)(kc + base + (i64)p * DH);
        const uint4* vr = (const uint4*)(vc + base + (i64)p * DH);
        uint4 kb[DH / 8];
#pragma unroll
        for (int c = 0; c < DH / 8; c++) kb[c] = kr[c];
        uint4* svr = (uint4*)(sv + tid * DH);
#pragma unroll
        for (int c = 0; c < DH / 8; c++) svr[c] = vr[c];
#pragma unroll
        for (int c = 0; c < DH / 8; c++) {
            uint4 u = kb[c];
            float k8[8] = {h2f((u16)(u.x & 0xffff)), h2f((u16)(u.x >> 16)), h2f((u16)(u.y & 0xffff)), h2f((u16)(u.y >> 16)),
                           h2f((u16)(u.z & 0xffff)), h2f((u16)(u.z >> 16)), h2f((u16)(u.w & 0xffff)), h2f((u16)(u.w >> 16))};
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                if (g < G) {
                    const float4* qg = (const float4*)(sq + g * DH + c * 8);
                    float4 a = qg[0], b = qg[1];
                    s[g] += a.x * k8[0] + a.y * k8[1] + a.z * k8[2] + a.w * k8[3]
                          + b.x * k8[4] + b.y * k8[5] + b.z * k8[6] + b.w * k8[7];
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < MAXG; g++) if (g < G) ss[g * CH + tid] = p < n_kv ? s[g] : -3.0e38f;
    __syncthreads();
    for (int g = w; g < G; g += nw) {          // softmax pieces, one warp per head
        float m = -3.0e38f;
        for (int i = lane; i < CH; i += WARP) m = fmaxf(m, ss[g * CH + i]);
        m = warp_max(m);
        float l = 0.f;
        for (int i = lane; i < CH; i += WARP) {
            float e = p0 + i < n_kv ? __expf(ss[g * CH + i] - m) : 0.f;
            ss[g * CH + i] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) { sml[g] = m; sml[MAXG + g] = l; }
    }
    __syncthreads();
    int np = min(CH, n_kv - p0);
    for (int d = tid; d < DH; d += blockDim.x) {
        float acc[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; g++) acc[g] = 0.f;
#pragma unroll 4
        for (int i = 0; i < np; i++) {
            float v = h2f(sv[i * DH + d]);
#pragma unroll
            for (int g = 0; g < MAXG; g++) if (g < G) acc[g] += ss[g * CH + i] * v;
        }
#pragma unroll
        for (int g = 0; g < MAXG; g++)
            if (g < G) part_o[(pbase + (i64)g * n_split) * DH + d] = acc[g];
    }
    if (tid < G) { part_m[pbase + (i64)tid * n_split] = sml[tid]; part_l[pbase + (i64)tid * n_split] = sml[MAXG + tid]; }
}

// One kernel per head size, so each gets its own register count.
#define ATTN_SPLIT(DH) extern "C" __global__ void attn_split_##DH(const float* q, const u16* kc, const u16* vc, \
    const int* slots, const int* pos, int H, int Hkv, i64 layer_off, i64 slot_stride, int C, float scale, \
    float* part_m, float* part_l, float* part_o) { \
    attn_split_body<DH>(q, kc, vc, slots, pos, H, Hkv, layer_off, slot_stride, C, scale, part_m, part_l, part_o); }
ATTN_SPLIT(64)
ATTN_SPLIT(128)
ATTN_SPLIT(256)

// grid (T, H), block Dh threads: out [T, H*Dh] float, and (oq != 0) its int8-per-32 form.
// Only the splits row t reached are read (CH positions each).
extern "C" __global__ void attn_merge(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                      const float* __restrict__ part_o, const int* __restrict__ pos, int CH,
                                      int n_split, int H, int Dh,
                                      float* __restrict__ out, i8* __restrict__ oq, float* __restrict__ od,
                                      float* __restrict__ os) {
    __shared__ float sh[32];
    extern __shared__ float f[];        // [n_used] weight of each split
    int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    int n_used = min(n_split, pos[t] / CH + 1);
    i64 base = ((i64)t * H + h) * n_split;
    float M = -3.0e38f;
    for (int s = i; s < n_used; s += blockDim.x) M = fmaxf(M, part_m[base + s]);
    M = block_max(M, sh);
    float L = 0.f;
    for (int s = i; s < n_used; s += blockDim.x) {
        float e = __expf(part_m[base + s] - M);
        f[s] = e;
        L += part_l[base + s] * e;
    }
    L = block_sum(L, sh);      // its barriers also publish f[]
    float acc = 0.f;
#pragma unroll 4
    for (int s = 0; s < n_used; s++) acc += part_o[(base + s) * Dh + i] * f[s];
    float v = acc / L;
    i64 at = ((i64)t * H + h) * Dh + i;
    out[at] = v;
    if (oq) {
        int lane = i % WARP;
        float amax = warp_max(fabsf(v));
        float d = amax / 127.f;
        int qv = amax == 0.f ? 0 : __float2int_rn(v / d);
        float sum = warp_sum((float)qv) * d;
        oq[at] = (i8)qv;
        if (lane == 0) { od[at / 32] = d; os[at / 32] = sum; }
    }
}

// Prompt path: s [R, n_kv] float scores (already scaled) -> p [R, n_kv] f16 probabilities,
// row r may see keys 0 .. limit0 + r / G (causal within the chunk). One block per row.
extern "C" __global__ void softmax_causal(const float* __restrict__ s, int n_kv, int limit0, int G,
                                          int rows_per_head, u16* __restrict__ p) {
    __shared__ float sh[32];
    int r = blockIdx.x;
    int limit = limit0 + (r % rows_per_head) / G;   // last visible key
    const float* sr = s + (i64)r * n_kv;
    float m = -3.0e38f;
    for (int j = threadIdx.x; j <= limit && j < n_kv; j += blockDim.x) m = fmaxf(m, sr[j]);
    m = block_max(m, sh);
    float sum = 0.f;
    for (int j = threadIdx.x; j <= limit && j < n_kv; j += blockDim.x) sum += __expf(sr[j] - m);
    sum = block_sum(sum, sh);
    float inv = 1.f / sum;
    for (int j = threadIdx.x; j < n_kv; j += blockDim.x)
        p[(i64)r * n_kv + j] = f2h(j <= limit ? __expf(sr[j] - m) * inv : 0.f);
}
