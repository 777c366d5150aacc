// GGUF block formats read in place. Each type is a struct with
//   QK (values per block), BYTES (bytes per block), IV (values per work item: 32 or 64),
//   load(row, item)        the item's weights into registers,
//   dot(xq, xd, xs, item)  their dot product with an activation row quantized to int8 per 32
//                          (xq int8 values, xd the per-32 scale, xs the per-32 sum of the floats),
//   deq(row, item, out)    the item's IV values as floats (load, then expand(out) from the registers).
// Layouts as ggml's block_q4_K etc.; value order as its dequantize_row_* functions.

// ggml type codes (gguf.GGMLQuantizationType)
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q5_0 6
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30

__device__ __forceinline__ void load_x32(const i8* p, int* u) {   // 32 int8, p 16-byte aligned
    const int4* v = (const int4*)p;
    int4 a = v[0], b = v[1];
    u[0] = a.x; u[1] = a.y; u[2] = a.z; u[3] = a.w; u[4] = b.x; u[5] = b.y; u[6] = b.z; u[7] = b.w;
}

// Byte i (0..11) of the K-quants' packed scales, held as three words.
__device__ __forceinline__ int kbyte(u32 s0, u32 s1, u32 s2, int i) {
    u32 w = i < 4 ? s0 : (i < 8 ? s1 : s2);
    return (int)((w >> (8 * (i & 3))) & 0xffu);
}
__device__ __forceinline__ void kscale(u32 s0, u32 s1, u32 s2, int j, int& sc, int& m) {
    if (j < 4) {
        sc = kbyte(s0, s1, s2, j) & 63;
        m = kbyte(s0, s1, s2, j + 4) & 63;
    } else {
        sc = (kbyte(s0, s1, s2, j + 4) & 0xF) | ((kbyte(s0, s1, s2, j - 4) >> 6) << 4);
        m = (kbyte(s0, s1, s2, j + 4) >> 4) | ((kbyte(s0, s1, s2, j) >> 6) << 4);
    }
}

struct Q4K {
    enum { QK = 256, BYTES = 144, IV = 64 };
    int q[8]; float d, dmin; int sc0, sc1, m0, m1;
    __device__ __forceinline__ void load(const u8* row, int item) {
        const u8* b = row + (i64)(item >> 2) * BYTES;
        int g = item & 3;
        u32 dm = *(const u32*)b;
        d = h2f((u16)(dm & 0xffff)); dmin = h2f((u16)(dm >> 16));
        u32 s0 = *(const u32*)(b + 4), s1 = *(const u32*)(b + 8), s2 = *(const u32*)(b + 12);
        kscale(s0, s1, s2, 2 * g, sc0, m0);
        kscale(s0, s1, s2, 2 * g + 1, sc1, m1);
        const int4* p = (const int4*)(b + 16 + 32 * g);
        int4 x = p[0], y = p[1];
        q[0] = x.x; q[1] = x.y; q[2] = x.z; q[3] = x.w; q[4] = y.x; q[5] = y.y; q[6] = y.z; q[7] = y.w;
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd, const float* xs, int item) const {
        int v0 = item * IV, u[8], w[8];
        load_x32(xq + v0, u); load_x32(xq + v0 + 32, w);
        int lo = 0, hi = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            lo = dp4a(q[k] & 0x0F0F0F0F, u[k], lo);
            hi = dp4a((q[k] >> 4) & 0x0F0F0F0F, w[k], hi);
        }
        int i = v0 / 32;
        return d * ((float)(sc0 * lo) * xd[i] + (float)(sc1 * hi) * xd[i + 1])
             - dmin * ((float)m0 * xs[i] + (float)m1 * xs[i + 1]);
    }
    __device__ __forceinline__ void deq(const u8* row, int item, float* out) { load(row, item); expand(out); }
    __device__ __forceinline__ void expand(float* out) const {
        float a = d * sc0, b = dmin * m0, c = d * sc1, e = dmin * m1;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int byte = (q[l >> 2] >> (8 * (l & 3))) & 0xff;
            out[l] = a * (float)(byte & 0xF) - b;
            out[32 + l] = c * (float)(byte >> 4) - e;
        }
    }
};

struct Q5K {
    enum { QK = 256, BYTES = 176, IV = 64 };
    int lo_q[8], hi_q[8]; float d, dmin; int sc0, sc1, m0, m1;
    __device__ __forceinline__ void load(const u8* row, int item) {
        const u8* b = row + (i64)(item >> 2) * BYTES;
        int g = item & 3;
        u32 dm = *(const u32*)b;
        d = h2f((u16)(dm & 0xffff)); dmin = h2f((u16)(dm >> 16));
        u32 s0 = *(const u32*)(b + 4), s1 = *(const u32*)(b + 8), s2 = *(const u32*)(b + 12);
        kscale(s0, s1, s2, 2 * g, sc0, m0);
        kscale(s0, s1, s2, 2 * g + 1, sc1, m1);
        const int4* ph = (const int4*)(b + 16);
        const int4* pq = (const int4*)(b + 48 + 32 * g);
        int4 h0 = ph[0], h1 = ph[1], x = pq[0], y = pq[1];
        int h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        int q[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
#pragma unroll
        for (int k = 0; k < 8; k++) {
            lo_q[k] = (q[k] & 0x0F0F0F0F) | ((((u32)h[k] >> (2 * g)) & 0x01010101u) << 4);
            hi_q[k] = ((q[k] >> 4) & 0x0F0F0F0F) | ((((u32)h[k] >> (2 * g + 1)) & 0x01010101u) << 4);
        }
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd, const float* xs, int item) const {
        int v0 = item * IV, u[8], w[8];
        load_x32(xq + v0, u); load_x32(xq + v0 + 32, w);
        int lo = 0, hi = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) { lo = dp4a(lo_q[k], u[k], lo); hi = dp4a(hi_q[k], w[k], hi); }
        int i = v0 / 32;
        return d * ((float)(sc0 * lo) * xd[i] + (float)(sc1 * hi) * xd[i + 1])
             - dmin * ((float)m0 * xs[i] + (float)m1 * xs[i + 1]);
    }
    __device__ __forceinline__ void deq(const u8* row, int item, float* out) { load(row, item); expand(out); }
    __device__ __forceinline__ void expand(float* out) const {
        float a = d * sc0, b = dmin * m0, c = d * sc1, e = dmin * m1;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            out[l] = a * (float)((lo_q[l >> 2] >> (8 * (l & 3))) & 0xff) - b;
            out[32 + l] = c * (float)((hi_q[l >> 2] >> (8 * (l & 3))) & 0xff) - e;
        }
    }
};

// N words from 2-byte-aligned p as N + 1 aligned word loads (not 2N halfword loads), each
// word the funnel shift of two neighbours. Reads up to 4 bytes past the N words: callers keep
// that inside the block.
template <int N>
__device__ __forceinline__ void ld_words_b2(const u8* p, u32* out) {
    const u32* a = (const u32*)((u64)p & ~(u64)3);
    u32 sh = ((u32)(u64)p & 2u) * 8u;
    u32 w[N + 1];
#pragma unroll
    for (int k = 0; k <= N; k++) w[k] = a[k];
#pragma unroll
    for (int k = 0; k < N; k++) out[k] = __funnelshift_r(w[k], w[k + 1], sh);
}

struct Q6K {
    enum { QK = 256, BYTES = 210, IV = 32 };
    int q[8]; float d; int sc_lo, sc_hi;
    __device__ __forceinline__ void load(const u8* row, int item) {
        const u8* b = row + (i64)(item >> 3) * BYTES;
        int h = (item >> 2) & 1, j = item & 3;
        const u8* ql = b + 64 * h + (j & 1) * 32;
        const u8* qh = b + 128 + 32 * h;
        int sl = (j >> 1) * 4, sh = 2 * j;
        sc_lo = (int)(i8)b[192 + 8 * h + 2 * j];
        sc_hi = (int)(i8)b[192 + 8 * h + 2 * j + 1];
        d = h2f(ld_h(b + 208));
        u32 lw[8], hw[8];
        ld_words_b2<8>(ql, lw);
        ld_words_b2<8>(qh, hw);
#pragma unroll
        for (int k = 0; k < 8; k++)
            q[k] = (int)(((lw[k] >> sl) & 0x0F0F0F0Fu) | (((hw[k] >> sh) & 0x03030303u) << 4));
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd, const float* xs, int item) const {
        int v0 = item * IV, u[8];
        load_x32(xq + v0, u);
        int dl = 0, dh = 0, sl = 0, sh = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            dl = dp4a(q[k], u[k], dl); sl = dp4a(0x01010101, u[k], sl);
            dh = dp4a(q[k + 4], u[k + 4], dh); sh = dp4a(0x01010101, u[k + 4], sh);
        }
        return d * xd[v0 / 32] * (float)(sc_lo * (dl - 32 * sl) + sc_hi * (dh - 32 * sh));
    }
    __device__ __forceinline__ void deq(const u8* row, int item, float* out) { load(row, item); expand(out); }
    __device__ __forceinline__ void expand(float* out) const {
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int v = ((q[l >> 2] >> (8 * (l & 3))) & 0xff) - 32;
            out[l] = d * (float)((l < 16 ? sc_lo : sc_hi) * v);
        }
    }
};

struct Q8_0 {
    enum { QK = 32, BYTES = 34, IV = 32 };
    int q[8]; float d;
    __device__ __forceinline__ void load(const u8* row, int item) {
        const u8* b = row + (i64)item * BYTES;
        d = h2f(ld_h(b));
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = ld_b2(b + 2 + 4 * k);
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd, const float* xs, int item) const {
        int u[8], s = 0;
        load_x32(xq + item * IV, u);
#pragma unroll
        for (int k = 0; k < 8; k++) s = dp4a(q[k], u[k], s);
        return d * xd[item] * (float)s;
    }
    __device__ __forceinline__ void deq(const u8* row, int item, float* out) { load(row, item); expand(out); }
    __device__ __forceinline__ void expand(float* out) const {
#pragma unroll
        for (int l = 0; l < 32; l++) out[l] = d * (float)(i8)((q[l >> 2] >> (8 * (l & 3))) & 0xff);
    }
};

struct Q4_0 {
    enum { QK = 32, BYTES = 18, IV = 32 };
    int q[8]; float d;
    __device__ __forceinline__ void load(const u8* row, int item) {
        const u8* b = row + (i64)item * BYTES;
        d = h2f(ld_h(b));
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int w = ld_b2(b + 2 + 4 * k);
            q[k] = w & 0x0F0F0F0F;
            q[k + 4] = (w >> 4) & 0x0F0F0F0F;
        }
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd, const float* xs, int item) const {
        int u[8], s = 0;
        load_x32(xq + item * IV, u);
#pragma unroll
        for (int k = 0; k < 8; k++) s = dp4a(q[k], u[k], s);
        return d * (xd[item] * (float)s - 8.f * xs[item]);
    }
    __device__ __forceinline__ void deq(const u8* row, int item, float* out) { load(row, item); expand(out); }
    __device__ __forceinline__ void expand(float* out) const {
#pragma unroll
        for (int l = 0; l < 32; l++) out[l] = d * (float)(((q[l >> 2] >> (8 * (l & 3))) & 0xff) - 8);
    }
};

__device__ __forceinline__ u32 spread4(u32 h) {   // bits 0..3 of h -> bit 4 of bytes 0..3
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

struct Q5_0 {
    enum { QK = 32, BYTES = 22, IV = 32 };
    int q[8]; float d;
    __device__ __forceinline__ void load(const u8* row, int item) {
        const u8* b = row + (i64)item * BYTES;
        d = h2f(ld_h(b));
        u32 qh = (u32)ld_b2(b + 2);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 w = (u32)ld_b2(b + 6 + 4 * k);
            q[k] = (int)((w & 0x0F0F0F0Fu) | spread4(qh >> (4 * k)));
            q[k + 4] = (int)(((w >> 4) & 0x0F0F0F0Fu) | spread4(qh >> (16 + 4 * k)));
        }
    }
    __device__ __forceinline__ float dot(const i8* xq, const float* xd, const float* xs, int item) const {
        int u[8], s = 0;
        load_x32(xq + item * IV, u);
#pragma unroll
        for (int k = 0; k < 8; k++) s = dp4a(q[k], u[k], s);
        return d * (xd[item] * (float)s - 16.f * xs[item]);
    }
    __device__ __forceinline__ void deq(const u8* row, int item, float* out) { load(row, item); expand(out); }
    __device__ __forceinline__ void expand(float* out) const {
#pragma unroll
        for (int l = 0; l < 32; l++) out[l] = d * (float)(((q[l >> 2] >> (8 * (l & 3))) & 0xff) - 16);
    }
};

// Float formats: read as floats (the activation stays float for these). get4: values i..i+3
// in one load (i % 4 == 0; rows of K % 4 == 0 values keep it aligned).
struct F32W { enum { QK = 1, BYTES = 4 };
    __device__ __forceinline__ static float get(const u8* row, int i) { return ((const float*)row)[i]; }
    __device__ __forceinline__ static float4 get4(const u8* row, int i) { return *(const float4*)(row + 4 * (i64)i); } };
struct F16W { enum { QK = 1, BYTES = 2 };
    __device__ __forceinline__ static float get(const u8* row, int i) { return h2f(((const u16*)row)[i]); }
    __device__ __forceinline__ static float4 get4(const u8* row, int i) {
        uint2 u = *(const uint2*)(row + 2 * (i64)i);
        return make_float4(h2f((u16)(u.x & 0xffff)), h2f((u16)(u.x >> 16)), h2f((u16)(u.y & 0xffff)), h2f((u16)(u.y >> 16)));
    } };
struct BF16W { enum { QK = 1, BYTES = 2 };
    __device__ __forceinline__ static float get(const u8* row, int i) { return bf2f(((const u16*)row)[i]); }
    __device__ __forceinline__ static float4 get4(const u8* row, int i) {
        uint2 u = *(const uint2*)(row + 2 * (i64)i);
        return make_float4(bf2f((u16)(u.x & 0xffff)), bf2f((u16)(u.x >> 16)), bf2f((u16)(u.y & 0xffff)), bf2f((u16)(u.y >> 16)));
    } };
