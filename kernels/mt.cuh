// Decode rows on the tensor cores: a weight's GGUF blocks expanded to f16 in registers, straight into
// the B operand of mma.m16n8k16 against up to 16 rows of an f16 input (matvec.cu's mmt for dense
// weights, moe_mm.cu's moe_mt_* for a decode step's experts). No shared memory holds the weights and
// no int8 form of the input is made; each weight byte is read once for all rows.
//
// The sum over k does not care which k sits in which slot of an mma step, as long as x's and W's
// fragments agree. Lane (g, c) (g = lane / 4, c = lane % 4) holds, in each step, the B slots 2c, 2c+1,
// 2c+8, 2c+9 of weight row g and the A slots of the same numbers for x rows g and g + 8. The formats
// below put there four consecutive values of the 64 a super-block gives that lane, so a lane reads
// whole words of W and, for two steps at once, 16 bytes of each x row.
#include "common.cuh"
#include "blocks.cuh"
#include "f16x2.cuh"

#define MT_ROWS 16                    // input rows an mma takes
#define MT_KS 4                       // warps a block at most: each takes every MT_KS-th super-block

// Q4_K: lane c takes chunk c of each super-block (values 64c .. 64c + 63: low nibbles of its 32
// bytes, then high). Pair p of steps (0..7) holds values 64c + 8p .. + 7: low nibbles of words
// 2p and 2p + 1 (p < 4), else the high nibbles of words 2p - 8 and 2p - 7.
struct MtQ4K {
    uint4 h, q0, q1;                              // d, dmin and the scales; the chunk's 32 bytes
    u32 s[2], m[2];                               // values 0-31, 32-63 of the chunk: scale, -min (f16x2)
    __device__ __forceinline__ void load(const u8* row, int sb, int c) {
        const u8* b = row + (i64)sb * Q4K::BYTES;  // 16-aligned (144-byte blocks, rows of whole ones)
        h = *(const uint4*)b;
        const uint4* p = (const uint4*)(b + 16 + 32 * c);
        q0 = p[0];
        q1 = p[1];
    }
    __device__ __forceinline__ void prep(int c) {  // after the loads: the loads of the next stay in flight
        int sc0, m0, sc1, m1;
        kscale(h.y, h.z, h.w, 2 * c, sc0, m0);
        kscale(h.y, h.z, h.w, 2 * c + 1, sc1, m1);
        float d = h2f((u16)(h.x & 0xffff)), dmin = h2f((u16)(h.x >> 16));
        s[0] = splat(d * (float)sc0); s[1] = splat(d * (float)sc1);
        m[0] = splat(-dmin * (float)m0); m[1] = splat(-dmin * (float)m1);
    }
    __device__ __forceinline__ static int xoff(int p, int c) { return 64 * c + 8 * p; }
    __device__ __forceinline__ u32 word(int k) const {
        return k == 0 ? q0.x : k == 1 ? q0.y : k == 2 ? q0.z : k == 3 ? q0.w : k == 4 ? q1.x : k == 5 ? q1.y
             : k == 6 ? q1.z : q1.w;
    }
    // the B fragments of pair p's two steps: (b[0], b[1]), (b[2], b[3])
    __device__ __forceinline__ void frag(int p, u32* b) const {
        int hi = p >> 2, k = 2 * (p & 3);
#pragma unroll
        for (int t = 0; t < 2; t++) {
            u32 w = (word(k + t) >> (4 * hi)) & 0x0F0F0F0Fu;
            b[2 * t] = hfma2(hsub2(BYTES_AS_F16(w, 0x4140), H1024), s[hi], m[hi]);
            b[2 * t + 1] = hfma2(hsub2(BYTES_AS_F16(w, 0x4342), H1024), s[hi], m[hi]);
        }
    }
};

// Q6_K: lane c takes, of each half h and quarter j, the values 128h + 32j + 8c .. + 7 (the format's
// l = 8c .. 8c + 7: ql bytes 64h + l (j = 0, 2: low, high nibble) and 64h + 32 + l (j = 1, 3), two
// bits each of qh byte 32h + l, the scale 8h + 2j + l / 16). Pair p = 4h + j. Blocks are 210 bytes,
// 2-aligned: each 8-byte piece is three aligned words, shifted into place in prep().
struct MtQ6K {
    u32 raw[6][3], sr[5], sh;                     // pieces ql(h, lo), ql(h, hi), qh(h) for h = 0, 1; scales
    u16 dh;
    u32 w[6][2], s[2][4];                         // prep: the pieces' words; d times the scales (f16x2)
    __device__ __forceinline__ void load(const u8* row, int sb, int c) {
        const u8* b = row + (i64)sb * Q6K::BYTES;
        const u32* a = (const u32*)((u64)b & ~(u64)3);
        sh = ((u32)(u64)b & 2u) * 8u;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int o[3] = {64 * h + 8 * c, 64 * h + 32 + 8 * c, 128 + 32 * h + 8 * c};
#pragma unroll
            for (int i = 0; i < 3; i++)
#pragma unroll
                for (int k = 0; k < 3; k++) raw[3 * h + i][k] = a[o[i] / 4 + k];
        }
#pragma unroll
        for (int k = 0; k < 4; k++) sr[k] = a[192 / 4 + k];
        sr[4] = sh ? a[192 / 4 + 4] : 0u;         // aligned, that word would pass the block's end
        dh = ld_h(b + 208);
    }
    __device__ __forceinline__ void prep(int c) {
#pragma unroll
        for (int i = 0; i < 6; i++) {
            w[i][0] = __funnelshift_r(raw[i][0], raw[i][1], sh);
            w[i][1] = __funnelshift_r(raw[i][1], raw[i][2], sh);
        }
        u32 sc[4];
#pragma unroll
        for (int k = 0; k < 4; k++) sc[k] = __funnelshift_r(sr[k], sr[k + 1], sh);
        float d = h2f(dh);
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int at = 8 * h + 2 * j + (c >> 1);          // the scale's byte of 16
                s[h][j] = splat(d * (float)(int)(i8)((sc[at >> 2] >> (8 * (at & 3))) & 0xff));
            }
    }
    __device__ __forceinline__ static int xoff(int p, int c) { return 128 * (p >> 2) + 32 * (p & 3) + 8 * c; }
    __device__ __forceinline__ void frag(int p, u32* b) const {
        int h = p >> 2, j = p & 3, sl = (j >> 1) * 4;
        const u32 bias = 0x64206420u;                        // (1056, 1056): 1024 + the format's offset 32
#pragma unroll
        for (int t = 0; t < 2; t++) {
            u32 lw = w[3 * h + (j & 1)][t], hw = w[3 * h + 2][t];
            u32 q = ((lw >> sl) & 0x0F0F0F0Fu) | (((hw >> (2 * j)) & 0x03030303u) << 4);
            b[2 * t] = hmul2(hsub2(BYTES_AS_F16(q, 0x4140), bias), s[h][j]);
            b[2 * t + 1] = hmul2(hsub2(BYTES_AS_F16(q, 0x4342), bias), s[h][j]);
        }
    }
};

// acc[nt][4] += (x rows g: xa, g + 8: xb; null: zeros) . (this lane's weight row of n-tile nt: rows[nt])
// over the super-blocks sb0, sb0 + MT_KS, ... < nsb, in fragment layout (c[0..1]: row g, columns 2c,
// 2c + 1 of the n-tile; c[2..3]: row g + 8). The first super-block's weights are loaded before
// pdl_wait() when `wait` is set (the caller has not waited yet, and the weights are not a step's output).
template <class T, int NT>
__device__ __forceinline__ void mt_sum(const u8* const* rows, int sb0, int nsb, const u16* __restrict__ xa,
                                       const u16* __restrict__ xb, float (*acc)[4], bool wait) {
    int c = threadIdx.x & 3;
    T cur[NT], nxt[NT];
    int sb = sb0;
    if (sb < nsb) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) cur[nt].load(rows[nt], sb, c);
    }
    if (wait) {
        pdl_wait();
        pdl_next();
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[nt][j] = 0.f;
    for (; sb < nsb; sb += MT_KS) {
        if (sb + MT_KS < nsb) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) nxt[nt].load(rows[nt], sb + MT_KS, c);
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) cur[nt].prep(c);
#pragma unroll
        for (int p = 0; p < 8; p++) {
            int k0 = sb * 256 + T::xoff(p, c);
            uint4 X = xa ? *(const uint4*)(xa + k0) : make_uint4(0u, 0u, 0u, 0u);
            uint4 Y = xb ? *(const uint4*)(xb + k0) : make_uint4(0u, 0u, 0u, 0u);
            u32 a0[4] = {X.x, Y.x, X.y, Y.y}, a1[4] = {X.z, Y.z, X.w, Y.w};
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                u32 b[4];
                cur[nt].frag(p, b);
                mma16816(acc[nt], a0, b[0], b[1]);
                mma16816(acc[nt], a1, b[2], b[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) cur[nt] = nxt[nt];
    }
}

// The block's warps' sums added in warp order (red: [MT_KS][NT][4][WARP] floats), so a result depends
// neither on timing nor on the other rows. Then fn(nt, j, lane, v) once for each of the NT * 4 * WARP
// sums, spread over the block's threads: v is row (lane >> 2) + (j >> 1) * 8 of the input, column
// 2 (lane & 3) + (j & 1) of n-tile nt.
template <int NT, class Fn>
__device__ __forceinline__ void mt_reduce(const float (*acc)[4], float* __restrict__ red, Fn fn) {
    int lane = threadIdx.x % WARP, wp = threadIdx.x / WARP, nw = blockDim.x / WARP;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j = 0; j < 4; j++) red[((wp * NT + nt) * 4 + j) * WARP + lane] = acc[nt][j];
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 4 * WARP; i += blockDim.x) {
        float v = 0.f;
        for (int k = 0; k < nw; k++) v += red[k * NT * 4 * WARP + i];
        fn(i / (4 * WARP), (i / WARP) % 4, i % WARP, v);
    }
}
