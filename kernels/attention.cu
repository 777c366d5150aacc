// Attention over the per-slot F16 KV cache, laid out [layer][slot][kv head][position][Dh].
// rope_store: per-head RMSNorm (optional), NEOX RoPE, K/V written at each row's (slot, pos).
// attn_dec + attn_merge: decode-style attention, each row its own slot and position,
// the keys cut into pieces that follow the depth (flash-decoding), merged in a second pass.
// softmax_causal: the prompt path's masked softmax between its two GEMMs.
// attn_prompt: a captured prompt pass's rows over their slot's keys at any depth, on the tensor cores.
#include "common.cuh"
#include "f16x2.cuh"

// grid (T, H + Hkv), block Dh/2 threads (a multiple of 32, Dh <= ROPE_MAX_DH). q, k, v: [T, H*Dh], [T, Hkv*Dh] x2.
// kr, vr (or null): the pass's rotated K and V again, [Hkv, T, Dh] f16, for a pass whose rows attend only to
// each other (a captured prompt from position 0, whose slot is known only on the card). q16 (or null): the
// rotated queries times q16_scale as f16 [Hkv, T, G, Dh], the prompt path's GEMM operand.
// NEOX pairs (d, d + n_rot/2) for d < n_rot/2 turn by pos * base^(-2d/n_rot); dims n_rot.. pass as they are
// (ggml's rope with n_dims < ne0). sec_total > 0: IMRoPE at a text position [p, p, p, 0] (ggml's
// GGML_ROPE_TYPE_IMROPE, cpu/backend.imrope_text_pairs): pair d's sector d % sec_total turns when it
// falls to one of the first three sections (sectors 0, 1, 2 mod 3 under 3 * sec0, sec1, sec2), else it
// is left as it is (the fourth section's position is 0).
#define ROPE_MAX_DH 512
extern "C" __global__ void rope_store(const float* __restrict__ q, const float* __restrict__ k,
                                      const float* __restrict__ v, const float* __restrict__ q_norm,
                                      const float* __restrict__ k_norm, float eps,
                                      const int* __restrict__ slots, const int* __restrict__ pos,
                                      int H, int Hkv, int Dh, int n_rot, float log2_base,
                                      int sec_total, int sec0, int sec1, int sec2,
                                      i64 layer_off, i64 slot_stride, int C,
                                      u16* __restrict__ kc, u16* __restrict__ vc, float* __restrict__ q_out,
                                      u16* __restrict__ kr, u16* __restrict__ vr, u16* __restrict__ q16,
                                      float q16_scale) {
    __shared__ float sh[32];
    __shared__ float xs[ROPE_MAX_DH];
    pdl_wait();
    pdl_next();
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
    xs[i] = x0;
    xs[i + half] = x1;
    __syncthreads();
    int p = pos[t], r = n_rot / 2;
    float y[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        int d = i + e * half;
        if (d >= n_rot) { y[e] = xs[d]; continue; }
        int pr = d < r ? d : d - r;                   // the pair (pr, pr + r) this dim belongs to
        bool turns = true;
        if (sec_total > 0) {
            int sector = pr % sec_total, m3 = sector % 3;
            turns = (m3 == 0 && sector < 3 * sec0) || (m3 == 1 && sector < 3 * sec1) || (m3 == 2 && sector < 3 * sec2);
        }
        if (!turns) { y[e] = xs[d]; continue; }
        float theta = (float)p * exp2f(-2.f * (float)pr / (float)n_rot * log2_base);
        float s_, c_;
        sincosf(theta, &s_, &c_);
        y[e] = d < r ? xs[d] * c_ - xs[d + r] * s_ : xs[d - r] * s_ + xs[d] * c_;
    }
    if (is_q) {
        float* o = q_out + ((i64)t * H + head) * Dh;
        o[i] = y[0]; o[i + half] = y[1];
        if (q16) {
            int G = H / Hkv;
            u16* o16 = q16 + (((i64)(head / G) * gridDim.x + t) * G + head % G) * Dh;
            o16[i] = f2h(y[0] * q16_scale); o16[i + half] = f2h(y[1] * q16_scale);
        }
    } else {
        i64 at = layer_off + (i64)slots[t] * slot_stride + ((i64)head * C + p) * Dh;
        kc[at + i] = f2h(y[0]); kc[at + i + half] = f2h(y[1]);
        const float* vs = v + ((i64)t * Hkv + head) * Dh;
        vc[at + i] = f2h(vs[i]); vc[at + i + half] = f2h(vs[i + half]);
        if (kr) {
            i64 own = ((i64)head * gridDim.x + t) * Dh;
            kr[own + i] = f2h(y[0]); kr[own + i + half] = f2h(y[1]);
            vr[own + i] = f2h(vs[i]); vr[own + i + half] = f2h(vs[i + half]);
        }
    }
}

// Decode-style attention in two passes (flash-decoding). attn_dec: grid (NS, Hkv, T), block
// 4 warps. Row t's n_kv = pos[t] + 1 keys are cut into at most NS pieces of attn_piece()
// positions (a multiple of 32, so the grid is fixed at capture and the work follows the
// depth); block s takes piece s for one kv head and all its G query heads, 32 positions at
// a time: each warp scores PW = 32 / MAXG positions per step, a lane holding DH / 32 dims of
// each position's K and V (coalesced rows) and of every head's q, the PW x MAXG partial dots
// summed across the warp in 31 shuffles (a transposing butterfly: lane l ends with the sum
// for position l / MAXG, head l % MAXG); then an online softmax per head over the chunks
// and P x V from the V rows still in registers, the four warps' parts added at the end.
// part_m/part_l [T, H, NS], part_o [T, H, NS, Dh]; only the pieces a row reaches are written.
// (The first kernel here, one thread per position and 16 blocks at depth 512, measured
// 1.23 ms per token over 48 layers on the H200; docs/performance.md.)
__device__ __forceinline__ int attn_piece(int n_kv, int NS) {
    int per = (n_kv + NS - 1) / NS;
    return (per + 31) & ~31;
}

// The sum over the warp of each of v[0..32); lane l returns the sum of v[l].
__device__ __forceinline__ float xreduce32(float (&v)[32]) {
    int lane = threadIdx.x % WARP;
#pragma unroll
    for (int o = 16, n = 16; o > 0; o >>= 1, n >>= 1) {
        bool hi = lane & o;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            if (i < n) {
                float send = hi ? v[i] : v[i + n];
                float keep = hi ? v[i + n] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
    }
    return v[0];
}

// VPL consecutive f16 values (VPL = 2, 4 or 8) as VPL / 2 words.
template <int VPL>
__device__ __forceinline__ void ld_f16s(const u16* p, u32* w) {
    if constexpr (VPL == 2) { w[0] = *(const u32*)p; }
    else if constexpr (VPL == 4) { uint2 u = *(const uint2*)p; w[0] = u.x; w[1] = u.y; }
    else { uint4 u = *(const uint4*)p; w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w; }
}
__device__ __forceinline__ float lo_f(u32 w) { return h2f((u16)(w & 0xffff)); }
__device__ __forceinline__ float hi_f(u32 w) { return h2f((u16)(w >> 16)); }

#define ATT_NW 4
template <int DH, int MAXG>
__device__ __forceinline__ void attn_dec_body(const float* __restrict__ q, const u16* __restrict__ kc,
                                              const u16* __restrict__ vc, const int* __restrict__ slots,
                                              const int* __restrict__ pos, int H, int Hkv,
                                              i64 layer_off, i64 slot_stride, int C, float scale,
                                              float* __restrict__ part_m, float* __restrict__ part_l,
                                              float* __restrict__ part_o) {
    constexpr int VPL = DH / WARP;            // dims per lane
    constexpr int PW = WARP / MAXG;           // positions per warp step
    constexpr int IT = 32 / (ATT_NW * PW);    // steps per 32-position chunk
    __shared__ float ss[MAXG][32];            // a chunk's scores, then its probabilities
    __shared__ float sM[MAXG], sL[MAXG], sF[MAXG];
    __shared__ __align__(16) float red[ATT_NW][MAXG * DH];
    int split = blockIdx.x, kv = blockIdx.y, t = blockIdx.z, NS = gridDim.x;
    int G = H / Hkv, tid = threadIdx.x, lane = tid % WARP, w = tid / WARP;
    int n_kv = pos[t] + 1;
    int piece = attn_piece(n_kv, NS);
    int b0 = split * piece, b1 = min(b0 + piece, n_kv);
    i64 base = layer_off + (i64)slots[t] * slot_stride + (i64)kv * C * DH;
    {   // before the wait: the piece's K and V rows from earlier steps into L1 (this step's row,
        // position n_kv - 1, is being written by rope_store; slots and positions are the step's
        // inputs, copied in before the graph runs)
        constexpr int LPP = DH * 2 / 128;         // 128-byte lines a position's row holds
        int n_old = max(0, min(b1, n_kv - 1) - b0);
        for (int i = tid; i < 2 * n_old * LPP; i += ATT_NW * WARP) {
            int r = i >> 1, pp = b0 + r / LPP;
            prefetch_l1(((i & 1) ? vc : kc) + base + (i64)pp * DH + (r % LPP) * 64);
        }
    }
    pdl_wait();
    pdl_next();
    if (b0 >= n_kv) return;                   // attn_merge reads only the pieces reached
    i64 pbase = ((i64)t * H + kv * G) * NS + split;          // head g at pbase + g * NS
    float qr[MAXG][VPL], acc[MAXG][VPL];
#pragma unroll
    for (int g = 0; g < MAXG; g++)
#pragma unroll
        for (int j = 0; j < VPL; j++) {
            qr[g][j] = g < G ? q[((i64)t * H + kv * G + g) * DH + lane * VPL + j] * scale : 0.f;
            acc[g][j] = 0.f;
        }
    if (tid < MAXG) { sM[tid] = -3.0e38f; sL[tid] = 0.f; }
    const u16* kb = kc + base + lane * VPL;
    const u16* vb = vc + base + lane * VPL;
    for (int c0 = b0; c0 < b1; c0 += 32) {
        u32 kw[IT][PW][VPL / 2], vw[IT][PW][VPL / 2];
#pragma unroll
        for (int it = 0; it < IT; it++)
#pragma unroll
            for (int p = 0; p < PW; p++) {
                int pp = c0 + (it * ATT_NW + w) * PW + p;
                if (pp < b1) {
                    ld_f16s<VPL>(kb + (i64)pp * DH, kw[it][p]);
                    ld_f16s<VPL>(vb + (i64)pp * DH, vw[it][p]);
                } else {
#pragma unroll
                    for (int j = 0; j < VPL / 2; j++) { kw[it][p][j] = 0u; vw[it][p][j] = 0u; }
                }
            }
#pragma unroll
        for (int it = 0; it < IT; it++) {
            float part[32];
#pragma unroll
            for (int p = 0; p < PW; p++)
#pragma unroll
                for (int g = 0; g < MAXG; g++) {
                    float a = 0.f;
#pragma unroll
                    for (int j = 0; j < VPL / 2; j++)
                        a += qr[g][2 * j] * lo_f(kw[it][p][j]) + qr[g][2 * j + 1] * hi_f(kw[it][p][j]);
                    part[p * MAXG + g] = a;
                }
            float s = xreduce32(part);
            int pl = (it * ATT_NW + w) * PW + lane / MAXG;
            ss[lane % MAXG][pl] = c0 + pl < b1 ? s : -3.0e38f;
        }
        __syncthreads();
        for (int g = w; g < MAXG; g += ATT_NW) {        // the chunk's softmax piece, one warp per head
            float s = ss[g][lane];
            float mo = sM[g];
            float mn = fmaxf(mo, warp_max(s));
            float e = c0 + lane < b1 ? __expf(s - mn) : 0.f;
            float sum = warp_sum(e);
            ss[g][lane] = e;
            if (lane == 0) { float f = __expf(mo - mn); sF[g] = f; sL[g] = sL[g] * f + sum; sM[g] = mn; }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            float f = sF[g];
#pragma unroll
            for (int j = 0; j < VPL; j++) acc[g][j] *= f;
        }
#pragma unroll
        for (int it = 0; it < IT; it++)
#pragma unroll
            for (int p = 0; p < PW; p++) {
                int pl = (it * ATT_NW + w) * PW + p;
#pragma unroll
                for (int g = 0; g < MAXG; g++) {
                    float pr = ss[g][pl];
#pragma unroll
                    for (int j = 0; j < VPL / 2; j++) {
                        acc[g][2 * j] += pr * lo_f(vw[it][p][j]);
                        acc[g][2 * j + 1] += pr * hi_f(vw[it][p][j]);
                    }
                }
            }
        __syncthreads();                                 // ss and sF are the next chunk's
    }
#pragma unroll
    for (int g = 0; g < MAXG; g++)
#pragma unroll
        for (int j = 0; j < VPL; j++) red[w][g * DH + lane * VPL + j] = acc[g][j];
    __syncthreads();
    for (int i = tid; i < G * DH; i += ATT_NW * WARP) {
        int g = i / DH, d = i % DH;
        part_o[(pbase + (i64)g * NS) * DH + d] = (red[0][i] + red[1][i]) + (red[2][i] + red[3][i]);
    }
    if (tid < G) { part_m[pbase + (i64)tid * NS] = sM[tid]; part_l[pbase + (i64)tid * NS] = sL[tid]; }
}

// One kernel per head size and bound on query heads per kv head (each its own registers).
#define ATTN_DEC(DH, MAXG) extern "C" __global__ void attn_dec_##DH##_##MAXG( \
    const float* q, const u16* kc, const u16* vc, const int* slots, const int* pos, int H, int Hkv, i64 layer_off, \
    i64 slot_stride, int C, float scale, float* part_m, float* part_l, float* part_o) { \
    attn_dec_body<DH, MAXG>(q, kc, vc, slots, pos, H, Hkv, layer_off, slot_stride, C, scale, part_m, part_l, part_o); }
ATTN_DEC(64, 4)
ATTN_DEC(64, 8)
ATTN_DEC(64, 16)
ATTN_DEC(128, 4)
ATTN_DEC(128, 8)
ATTN_DEC(128, 16)
ATTN_DEC(256, 4)
ATTN_DEC(256, 8)

// grid (T, H), block MERGE_THREADS = R groups of Dh threads (R = MERGE_THREADS / Dh): out [T, H*Dh]
// float, and (oq != 0) its int8-per-32 form. Only the pieces row t reached are read (attn_piece
// positions each, of n_split); group y adds pieces y, y + R, ... (eight loads in flight a thread),
// then group 0 adds the R sums in order. (One group of Dh threads walking every piece took about
// 25 us a layer at 128 pieces: a chain of dependent rounds in 16 blocks.)
#define MERGE_THREADS 1024
extern "C" __global__ void __launch_bounds__(MERGE_THREADS)
attn_merge(const float* __restrict__ part_m, const float* __restrict__ part_l,
           const float* __restrict__ part_o, const int* __restrict__ pos,
           int n_split, int H, int Dh,
           float* __restrict__ out, i8* __restrict__ oq, float* __restrict__ od,
           float* __restrict__ os) {
    __shared__ float sh[32];
    __shared__ float red[MERGE_THREADS];
    extern __shared__ float f[];        // [n_used] weight of each split
    pdl_wait();
    pdl_next();
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int R = blockDim.x / Dh, i = tid % Dh, y = tid / Dh;
    int n_kv = pos[t] + 1;
    int piece = attn_piece(n_kv, n_split);
    int n_used = (n_kv + piece - 1) / piece;
    i64 base = ((i64)t * H + h) * n_split;
    float M = -3.0e38f;
    for (int s = tid; s < n_used; s += blockDim.x) M = fmaxf(M, part_m[base + s]);
    M = block_max(M, sh);
    float L = 0.f;
    for (int s = tid; s < n_used; s += blockDim.x) {
        float e = __expf(part_m[base + s] - M);
        f[s] = e;
        L += part_l[base + s] * e;
    }
    L = block_sum(L, sh);      // its barriers also publish f[]
    float acc = 0.f;
#pragma unroll 8
    for (int s = y; s < n_used; s += R) acc += part_o[(base + s) * Dh + i] * f[s];
    red[tid] = acc;
    __syncthreads();
    if (y) return;
    for (int r = 1; r < R; r++) acc += red[r * Dh + i];
    float v = acc / L;
    i64 at = ((i64)t * H + h) * Dh + i;
    out[at] = v;
    if (oq) store_q8(v, at, oq, od, os);
}

// Prompt path: a chunk's P x V, o [Hkv, n*G, Dh] (row t*G + g: row t of query head kv*G + g), into the rows'
// output out [n, Hkv*G*Dh] (rows ld floats apart). grid (n, Hkv*G), block Dh.
extern "C" __global__ void attn_unpack(const float* __restrict__ o, int n, int G, float* __restrict__ out, i64 ld) {
    pdl_wait();
    pdl_next();
    int t = blockIdx.x, h = blockIdx.y, Dh = blockDim.x, kv = h / G, g = h % G;
    out[(i64)t * ld + (i64)h * Dh + threadIdx.x] = o[(((i64)kv * n + t) * G + g) * Dh + threadIdx.x];
}

// Prompt path: s [R, n_kv] float scores (already scaled) -> p [R, n_kv] f16 probabilities,
// row r may see keys 0 .. limit0 + r / G (causal within the chunk). One block per row.
extern "C" __global__ void softmax_causal(const float* __restrict__ s, int n_kv, int limit0, int G,
                                          int rows_per_head, u16* __restrict__ p) {
    __shared__ float sh[32];
    pdl_wait();
    pdl_next();
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

// A captured prompt pass at any depth (BLOOMERY_CUDA_PROMPT_ATTN=tc; cuda/attention.py): 16 rows a block, all
// of one slot (slots[t0]), each attending to the keys up to its own position (pos[t]), for one kv head and
// its G query heads, warp g taking query head kv*G + g. On the tensor cores (mma.m16n8k16: f16 in, f32
// accumulate): Q (q16 [Hkv, T, G, Dh], scaled by rope_store) held as A fragments; the keys in chunks of
// PA_KEYS through shared memory (rows padded to PA_LD, no bank conflicts on the B loads), S = Q K^T, an
// online softmax per row (as flash attention: the running max and sum, O rescaled when the max moves),
// P as the A operand of P V (S's accumulators are laid out as A's fragments, two n-tiles a k-step).
// Keys past the tile's last position, or the slot's end, are zero in shared memory and masked.
// grid (T / 16, Hkv, S), block 32 * G (G <= 8), Dh = PA_DH. S = 1: out [T, H*Dh] f32; S > 1: split z takes the
// z-th run of a block's key chunks and leaves its share in part_m, part_l [T, H, S], part_o [T, H, S, Dh]
// (attn_prompt_merge adds them into out).
#define PA_DH 128
#define PA_KEYS 64
#define PA_LD (PA_DH + 8)
extern "C" __global__ void __launch_bounds__(256) attn_prompt(
        const u16* __restrict__ q16, const u16* __restrict__ kc, const u16* __restrict__ vc,
        const int* __restrict__ slots, const int* __restrict__ pos, int T, int G, i64 layer_off,
        i64 slot_stride, int C, float* __restrict__ out, float* __restrict__ part_m,
        float* __restrict__ part_l, float* __restrict__ part_o) {
    __shared__ __align__(16) u16 ks[PA_KEYS * PA_LD];
    __shared__ __align__(16) u16 vs[PA_KEYS * PA_LD];
    pdl_wait();
    pdl_next();
    const int t0 = blockIdx.x * 16, kv = blockIdx.y, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gq = lane >> 2, t4 = lane & 3, H = gridDim.y * G;
    const int p_lo = pos[t0 + gq], p_hi = pos[t0 + gq + 8];          // this thread's two rows
    int pm = pos[t0 + (lane & 15)];                                  // the tile's last position
    for (int o = 8; o > 0; o >>= 1) pm = max(pm, __shfl_xor_sync(0xffffffffu, pm, o));
    const i64 base = layer_off + (i64)slots[t0] * slot_stride + (i64)kv * C * PA_DH;
    const u16* kb = kc + base;
    const u16* vb = vc + base;
    u32 a[PA_DH / 16][4];                                            // Q's A fragments, every k-step
    {
        const u16* q_lo = q16 + (((i64)kv * T + t0 + gq) * G + w) * PA_DH;
        const u16* q_hi = q16 + (((i64)kv * T + t0 + gq + 8) * G + w) * PA_DH;
#pragma unroll
        for (int k = 0; k < PA_DH / 16; k++) {
            a[k][0] = *(const u32*)(q_lo + k * 16 + 2 * t4);
            a[k][1] = *(const u32*)(q_hi + k * 16 + 2 * t4);
            a[k][2] = *(const u32*)(q_lo + k * 16 + 8 + 2 * t4);
            a[k][3] = *(const u32*)(q_hi + k * 16 + 8 + 2 * t4);
        }
    }
    float o[PA_DH / 8][4];
#pragma unroll
    for (int n = 0; n < PA_DH / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_lo = -3.0e38f, m_hi = -3.0e38f, l_lo = 0.f, l_hi = 0.f;
    const int n_vec = PA_KEYS * PA_DH / 8;                          // 16-byte pieces of a chunk
    const int S = gridDim.z, n_ch = pm / PA_KEYS + 1, per = (n_ch + S - 1) / S;   // this split's key chunks
    const int k_end = min(n_ch, (blockIdx.z + 1) * per) * PA_KEYS;
    for (int k0 = blockIdx.z * per * PA_KEYS; k0 < k_end; k0 += PA_KEYS) {
        __syncthreads();                                             // the last chunk's reads are done
        for (int i = threadIdx.x; i < n_vec; i += blockDim.x) {
            int key = i / (PA_DH / 8), c8 = i % (PA_DH / 8), kp = k0 + key;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
            if (kp <= pm && kp < C) {
                kx = ((const uint4*)(kb + (i64)kp * PA_DH))[c8];
                vx = ((const uint4*)(vb + (i64)kp * PA_DH))[c8];
            }
            *(uint4*)(ks + key * PA_LD + c8 * 8) = kx;
            *(uint4*)(vs + key * PA_LD + c8 * 8) = vx;
        }
        __syncthreads();
        float s[PA_KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < PA_KEYS / 8; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            const u16* kr = ks + (n * 8 + gq) * PA_LD + 2 * t4;      // B: key n*8 + gq, dims k*16 + 2*t4 (+8)
#pragma unroll
            for (int k = 0; k < PA_DH / 16; k++)
                mma16816(s[n], a[k], *(const u32*)(kr + k * 16), *(const u32*)(kr + k * 16 + 8));
        }
        float mx_lo = -3.0e38f, mx_hi = -3.0e38f;
#pragma unroll
        for (int n = 0; n < PA_KEYS / 8; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int key = k0 + n * 8 + 2 * t4 + e;
                s[n][e] = key <= p_lo ? s[n][e] : -3.0e38f;
                s[n][2 + e] = key <= p_hi ? s[n][2 + e] : -3.0e38f;
                mx_lo = fmaxf(mx_lo, s[n][e]);
                mx_hi = fmaxf(mx_hi, s[n][2 + e]);
            }
        for (int x = 1; x <= 2; x <<= 1) {                            // the quad holds a row's 64 keys
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, x));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, x));
        }
        float nm_lo = fmaxf(m_lo, mx_lo), nm_hi = fmaxf(m_hi, mx_hi);
        float c_lo = __expf(m_lo - nm_lo), c_hi = __expf(m_hi - nm_hi);
        m_lo = nm_lo, m_hi = nm_hi;
        l_lo *= c_lo, l_hi *= c_hi;
#pragma unroll
        for (int n = 0; n < PA_DH / 8; n++) o[n][0] *= c_lo, o[n][1] *= c_lo, o[n][2] *= c_hi, o[n][3] *= c_hi;
        u32 p[PA_KEYS / 8][2];                                       // P as f16 pairs: row gq, row gq + 8
#pragma unroll
        for (int n = 0; n < PA_KEYS / 8; n++) {
            // a masked key counts nothing, also where every key so far was masked (a split past the row)
            float e0 = s[n][0] > -1.0e38f ? __expf(s[n][0] - m_lo) : 0.f;
            float e1 = s[n][1] > -1.0e38f ? __expf(s[n][1] - m_lo) : 0.f;
            float e2 = s[n][2] > -1.0e38f ? __expf(s[n][2] - m_hi) : 0.f;
            float e3 = s[n][3] > -1.0e38f ? __expf(s[n][3] - m_hi) : 0.f;
            l_lo += e0 + e1, l_hi += e2 + e3;
            p[n][0] = pack2(e0, e1), p[n][1] = pack2(e2, e3);
        }
#pragma unroll
        for (int kk = 0; kk < PA_KEYS / 16; kk++) {
            u32 pa[4] = {p[2 * kk][0], p[2 * kk][1], p[2 * kk + 1][0], p[2 * kk + 1][1]};
            const u16* v0 = vs + (kk * 16 + 2 * t4) * PA_LD + gq;  // B: keys kk*16 + 2*t4 (+1, +8, +9), dim n*8 + gq
#pragma unroll
            for (int n = 0; n < PA_DH / 8; n++) {
                const u16* vp = v0 + n * 8;
                u32 b0 = (u32)vp[0] | ((u32)vp[PA_LD] << 16);
                u32 b1 = (u32)vp[8 * PA_LD] | ((u32)vp[9 * PA_LD] << 16);
                mma16816(o[n], pa, b0, b1);
            }
        }
    }
    for (int x = 1; x <= 2; x <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, x);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, x);
    }
    const int h = kv * G + w;
    if (S > 1) {                  // this split's share, unscaled, with its max and sum (attn_prompt_merge adds them)
        const i64 b_lo = ((i64)(t0 + gq) * H + h) * S + blockIdx.z, b_hi = b_lo + (i64)8 * H * S;
        float* r_lo = part_o + b_lo * PA_DH + 2 * t4;
        float* r_hi = part_o + b_hi * PA_DH + 2 * t4;
#pragma unroll
        for (int n = 0; n < PA_DH / 8; n++) {
            r_lo[n * 8] = o[n][0], r_lo[n * 8 + 1] = o[n][1];
            r_hi[n * 8] = o[n][2], r_hi[n * 8 + 1] = o[n][3];
        }
        if (t4 == 0) part_m[b_lo] = m_lo, part_l[b_lo] = l_lo, part_m[b_hi] = m_hi, part_l[b_hi] = l_hi;
        return;
    }
    float i_lo = 1.f / l_lo, i_hi = 1.f / l_hi;
    float* r_lo = out + (i64)(t0 + gq) * H * PA_DH + (i64)h * PA_DH + 2 * t4;
    float* r_hi = r_lo + (i64)8 * H * PA_DH;
#pragma unroll
    for (int n = 0; n < PA_DH / 8; n++) {
        r_lo[n * 8] = o[n][0] * i_lo, r_lo[n * 8 + 1] = o[n][1] * i_lo;
        r_hi[n * 8] = o[n][2] * i_hi, r_hi[n * 8 + 1] = o[n][3] * i_hi;
    }
}

// attn_prompt's splits (gridDim.z = S > 1: each block's keys cut into S runs of chunks, so a pass of few rows at
// a depth fills the card) added up: per row and query head, the shares weighted by exp(m_s - M), over the sum
// of the l_s likewise. A split that saw none of a row's keys left l = 0 and adds nothing.
// grid (T, H), block Dh. part_m, part_l [T, H, S]; part_o [T, H, S, Dh]; out [T, H*Dh] f32.
extern "C" __global__ void attn_prompt_merge(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                             const float* __restrict__ part_o, int S, float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    const int t = blockIdx.x, h = blockIdx.y, H = gridDim.y, Dh = blockDim.x, d = threadIdx.x;
    const i64 base = ((i64)t * H + h) * S;
    float M = -3.0e38f;
    for (int z = 0; z < S; z++) M = part_l[base + z] > 0.f ? fmaxf(M, part_m[base + z]) : M;
    float L = 0.f, acc = 0.f;
    for (int z = 0; z < S; z++) {
        float l = part_l[base + z];
        if (l > 0.f) {
            float e = __expf(part_m[base + z] - M);
            L += l * e;
            acc += part_o[(base + z) * Dh + d] * e;
        }
    }
    out[((i64)t * H + h) * Dh + d] = acc / L;
}
