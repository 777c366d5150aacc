// Host experts: one MoE layer's routed experts computed on the host from their stored GGUF
// blocks (bloomery/engine/cpu/host_moe.py compiles this with -O3 -march=native -pthread and
// loads it). The cuda backend's decode steps hand their host part to the bell thread below
// ("the doorbell"), which calls host_moe() on a persistent args struct; tests and tools call it
// through ctypes (host_moe_layer).
//
// Weights are read in place as stored (Q4_K, Q5_K, Q6_K against 8-bit activations in blocks of
// 256 with sums per 16, Q8_0, Q5_0, Q4_0 against 8-bit activations in blocks of 32), never
// decoded into a copy: the host is memory bound and a copy would double the bytes read.
// Activations are quantized into a layout of our own (per row: the int8 quants, the f32 block
// scales, the block sums), so each weight type's unsigned quants meet them in one unsigned x
// signed product (x86 maddubs / VNNI dpbusd) and the weight's offset (Q6_K's 32, Q4_0's 8, Q4_K's
// mins) comes off through the activation's block sums.
//
// A call runs on the caller and n_threads - 1 workers of a pool kept between calls (below), in
// five phases of small units:
//   0. quantize the input rows                              (256 elements of a row)
//   1. gate and up rows of every distinct host expert, against each token routed to it, so an
//      expert's rows are read once for all its tokens        (an expert's 16 rows)
//   2. swiglu + quantize each (token, slot) hidden row       (256 elements of a row)
//   3. down rows into y [P, D]                               (an expert's 32 rows)
//   4. out = sum over the slots, in slot order, of wts * y  (512 outputs of a token)
// Each unit computes its outputs alone and in a fixed order, so the result has the same bits
// whatever the thread count, and whichever thread takes which unit.
//
// Legend: T = rows (tokens), A = experts per token, P = T * A (token, slot) pairs,
// D = hidden size, F = expert FFN width, E = experts, X = distinct host experts in this call.
#define _GNU_SOURCE
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HM_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define HM_ISA 1
#else
#define HM_ISA 0
#endif
#if HM_ISA
#include <immintrin.h>
#endif

#define HM_INLINE static inline __attribute__((always_inline))
#define NMAX 4        // tokens one weight row is decoded for at once

typedef struct {
    int32_t n_rows;
    int32_t n_used;
    int32_t d;
    int32_t f;
    int32_t gate_type, up_type, down_type;
    int32_t n_threads;
    int64_t gate_row_bytes, up_row_bytes, down_row_bytes;
    const int32_t *ids;
    const float *wts;
    const float *x;
    float *out;
    const uint8_t *const *gate;
    const uint8_t *const *up;
    const uint8_t *const *down;
    const uint8_t *skip;
    int64_t busy_ns;               // ADDED TO by every call: the nanoseconds it took (a step's wait on the host)
} host_moe_args;

enum { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

int host_moe_isa(void) { return HM_ISA; }
int64_t host_moe_args_size(void) { return (int64_t)sizeof(host_moe_args); }

// ---------------------------------------------------------------- block formats

static int block_elems(int type) {
    switch (type) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 0;
    }
}

static int block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q5_0: return 22;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if HM_ISA && defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 0x3ff, bits;
    if (e == 0) {
        float v = ldexpf((float)m, -24);
        return sign ? -v : v;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float v;
    memcpy(&v, &bits, 4);
    return v;
#endif
}

// Q4_K / Q5_K: 12 packed bytes -> u[0..1] the eight 6-bit scales, u[2..3] the eight 6-bit mins,
// one a byte (ggml's get_scale_min_k4, four at a time)
static inline void k4_scales(const uint8_t *s, uint32_t u[4]) {
    uint32_t a0, a1, a2;
    memcpy(&a0, s, 4);
    memcpy(&a1, s + 4, 4);
    memcpy(&a2, s + 8, 4);
    u[0] = a0 & 0x3f3f3f3fu;
    u[1] = (a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4);
    u[2] = a1 & 0x3f3f3f3fu;
    u[3] = ((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4);
}
#define K4_BYTE(u, i) ((int)(((u)[(i) >> 2] >> (8 * ((i) & 3))) & 0xFF))

// ---------------------------------------------------------------- activations
// A quantized activation row of length k: qs int8[k], then d f32[nb], then the block sums
// (int16[16 * nb] per 16 elements for the 256 family, int32[nb] for the 32 family), the row
// padded to 64 bytes. Layout L_KP (the 512-bit Q4_K / Q5_K kernels) stores each 256 block's
// 32-element sub-blocks in the order 0 2 1 3 4 6 5 7, the order one 64-byte load of the
// weight's nibbles yields them; the sums stay in natural order.

enum { L_32 = 0, L_KN = 1, L_KP = 2 };

static int layout_of(int type) {
    switch (type) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: return L_32;
    case T_Q6_K: return L_KN;
    case T_Q4_K: case T_Q5_K: return HM_ISA == 2 ? L_KP : L_KN;
    default: return -1;
    }
}

static inline int layout_block(int layout) { return layout == L_32 ? 32 : 256; }

static int64_t act_row_bytes(int layout, int64_t k) {
    int64_t nb = k / layout_block(layout);
    int64_t n = k + 4 * nb + (layout == L_32 ? 4 * nb : 32 * nb);
    return (n + 63) & ~(int64_t)63;
}

// silu(g) * u = g * u / (1 + exp(-g)) for 16 values at once, in GCC's vector types (AVX-512,
// two AVX2 halves, or four SSE quarters, as the build allows); exp as Cephes' expf: 2^n times a
// degree-7 polynomial in the rest, within 2 ulp, -g clamped to +-87.3 where expf over- or
// underflows (there the result is g * u, or 0, all the same).
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

// e clamped to [-87.3, 87.3], lane by lane, through its bits (C has no ?: on vectors)
#define VCLAMP(e)                                                                              \
    do {                                                                                       \
        const vf16 hi_ = (vf16){0} + 87.3f, lo_ = (vf16){0} - 87.3f;                           \
        vi16 ei_, hb_, lb_;                                                                    \
        const vi16 over_ = (e) > hi_, under_ = (e) < lo_;                                      \
        memcpy(&ei_, &(e), 64);                                                                \
        memcpy(&hb_, &hi_, 64);                                                                \
        memcpy(&lb_, &lo_, 64);                                                                \
        ei_ = (ei_ & ~(over_ | under_)) | (hb_ & over_) | (lb_ & under_);                      \
        memcpy(&(e), &ei_, 64);                                                                \
    } while (0)

HM_INLINE void swiglu16(const float *g, const float *u, float *out) {
    vf16 x, vu;
    memcpy(&x, g, 64);
    memcpy(&vu, u, 64);
    vf16 e = -x;
    VCLAMP(e);
    const vf16 magic = (vf16){0} + 12582912.0f;            // 1.5 * 2^23: adding it rounds to an integer
    vf16 t = e * 1.44269504088896341f + magic;
    const vf16 n = t - magic;
    vf16 r = e - n * 0.693359375f + n * 2.12194440e-4f;
    vf16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi16 ni, scale_bits;
    memcpy(&ni, &t, 64);
    scale_bits = ((ni - 0x4B400000) + 127) << 23;         // t's low bits are n; 2^n as a float's bits
    vf16 scale;
    memcpy(&scale, &scale_bits, 64);
    const vf16 y = x * vu / (1.0f + p * scale);
    memcpy(out, &y, 64);
}

// blocks b0..b1 of row x (length k) into the row dst; silu_u: if set, the values are
// silu(x) * silu_u (swiglu), computed here in f32
static void quantize_blocks(int layout, const float *x, const float *silu_u, int64_t k, uint8_t *dst,
                            int64_t b0, int64_t b1) {
    const int bl = layout_block(layout);
    const int64_t nb = k / bl;
    int8_t *qs = (int8_t *)dst;
    float *d = (float *)(dst + k);
    float v[256];
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + b * bl;
        if (silu_u) {
            const float *ub = silu_u + b * bl;
            for (int i = 0; i < bl; i += 16) swiglu16(xb + i, ub + i, v + i);
        } else {
            memcpy(v, xb, sizeof(float) * bl);
        }
        int32_t mb = 0;                 // max |v| by its bits (they order non-negative floats)
        for (int i = 0; i < bl; i++) {
            int32_t a;
            memcpy(&a, v + i, 4);
            a &= 0x7fffffff;
            mb = a > mb ? a : mb;
        }
        float amax;
        memcpy(&amax, &mb, 4);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        int8_t q[256];
        for (int i = 0; i < bl; i++) {  // to nearest even: + 1.5 * 2^23 leaves the integer in the low bits
            const float f = v[i] * id + 12582912.0f;
            int32_t qi;
            memcpy(&qi, &f, 4);
            q[i] = (int8_t)(qi - 0x4B400000);
        }
        int32_t sums[16];
        for (int g = 0; g < bl / 16; g++) {
            int32_t sg = 0;
            for (int l = 0; l < 16; l++) sg += q[16 * g + l];
            sums[g] = sg;
        }
        if (layout == L_32) {
            ((int32_t *)(d + nb))[b] = sums[0] + sums[1];
            memcpy(qs + b * 32, q, 32);
            continue;
        }
        int16_t *bs = (int16_t *)(d + nb) + 16 * b;
        for (int g = 0; g < 16; g++) bs[g] = (int16_t)sums[g];
        if (layout == L_KN) {
            memcpy(qs + b * 256, q, 256);
        } else {
            static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
            for (int i = 0; i < 8; i++) memcpy(qs + b * 256 + 32 * i, q + 32 * order[i], 32);
        }
    }
}

// ---------------------------------------------------------------- dot products
// dot_<type>(w, nb, a, n, k, out): out[j] = row w (nb blocks) . activation row a[j] (length k),
// j < n <= NMAX; the weight block is decoded once for the n rows.

typedef void (*dot_fn)(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out);

#define ACT_D(a, k) ((const float *)((a) + (k)))
#define ACT_S16(a, k, nb) ((const int16_t *)((a) + (k) + 4 * (int64_t)(nb)))
#define ACT_S32(a, k, nb) ((const int32_t *)((a) + (k) + 4 * (int64_t)(nb)))

// every ISA instantiates dot_<t>_n(w, nb, a, n, k, out) with n a constant through this switch
#define DISPATCH(t)                                                                           \
    static void dot_##t(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) { \
        switch (n) {                                                                          \
        case 1: dot_##t##_n(w, nb, a, 1, k, out); break;                                      \
        case 2: dot_##t##_n(w, nb, a, 2, k, out); break;                                      \
        case 3: dot_##t##_n(w, nb, a, 3, k, out); break;                                      \
        default: dot_##t##_n(w, nb, a, 4, k, out); break;                                     \
        }                                                                                     \
    }

#if HM_ISA == 0
// ---- portable C

// Q4_K (hbits 0) / Q5_K (hbits 1): sub-block s of 32 is nibble (s & 1) of bytes 32 (s / 2) ..,
// plus bit s of qh[0..31] as 16 for Q5_K
HM_INLINE void dot_k4_n(int hbits, const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    const int bb = hbits ? 176 : 144, qs_off = hbits ? 48 : 16;
    for (int j = 0; j < n; j++) {
        const int8_t *y = (const int8_t *)a[j];
        const float *ad = ACT_D(a[j], k);
        const int16_t *bs = ACT_S16(a[j], k, nb);
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *x = w + bb * b, *qh = x + 16, *qs = x + qs_off;
            const int8_t *yb = y + 256 * b;
            uint32_t u[4];
            k4_scales(x + 4, u);
            int32_t sumi = 0, summ = 0;
            for (int c = 0; c < 4; c++) {
                int32_t lo = 0, hi = 0;
                for (int l = 0; l < 32; l++) {
                    const int hl = hbits ? ((qh[l] >> (2 * c)) & 1) << 4 : 0;
                    const int hh = hbits ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
                    lo += ((qs[32 * c + l] & 15) | hl) * yb[64 * c + l];
                    hi += ((qs[32 * c + l] >> 4) | hh) * yb[64 * c + 32 + l];
                }
                sumi += K4_BYTE(u, 2 * c) * lo + K4_BYTE(u, 2 * c + 1) * hi;
            }
            for (int s = 0; s < 8; s++) summ += K4_BYTE(u, 8 + s) * (bs[16 * b + 2 * s] + bs[16 * b + 2 * s + 1]);
            acc += ad[b] * (f16(x) * (float)sumi - f16(x + 2) * (float)summ);
        }
        out[j] = acc;
    }
}

HM_INLINE void dot_q6_K_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    for (int j = 0; j < n; j++) {
        const int8_t *y = (const int8_t *)a[j];
        const float *ad = ACT_D(a[j], k);
        const int16_t *bs = ACT_S16(a[j], k, nb);
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *x = w + 210 * b, *ql = x, *qh = x + 128;
            const int8_t *sc = (const int8_t *)(x + 192);
            const int8_t *yb = y + 256 * b;
            int32_t sumi = 0;
            for (int s = 0; s < 16; s++) {      // element e = 16 s + i: half h, quarter c, lane l
                const int h = s / 8, c = (s / 2) % 4, l0 = 16 * (s % 2);
                const uint8_t *lo = ql + 64 * h + 32 * (c & 1) + l0, *hi = qh + 32 * h + l0;
                const int8_t *ye = yb + 16 * s;
                int32_t g = 0;
                for (int i = 0; i < 16; i++)
                    g += (((lo[i] >> (4 * (c >> 1))) & 15) | (((hi[i] >> (2 * c)) & 3) << 4)) * ye[i];
                sumi += sc[s] * (g - 32 * bs[16 * b + s]);
            }
            acc += ad[b] * f16(x + 208) * (float)sumi;
        }
        out[j] = acc;
    }
}

// the 32 family: w_q (the stored quant read unsigned) - off, against the int8 activations
HM_INLINE void dot32_n(int type, const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    const int bb = block_bytes(type);
    for (int j = 0; j < n; j++) {
        const int8_t *y = (const int8_t *)a[j];
        const float *ad = ACT_D(a[j], k);
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *x = w + bb * b;
            const int8_t *yb = y + 32 * b;
            int32_t sumi = 0;
            if (type == T_Q8_0) {
                for (int i = 0; i < 32; i++) sumi += (int8_t)x[2 + i] * yb[i];
            } else if (type == T_Q4_0) {
                for (int i = 0; i < 16; i++)
                    sumi += ((x[2 + i] & 15) - 8) * yb[i] + ((x[2 + i] >> 4) - 8) * yb[i + 16];
            } else {
                uint32_t qh;
                memcpy(&qh, x + 2, 4);
                for (int i = 0; i < 16; i++) {
                    const int lo = (x[6 + i] & 15) | (((qh >> i) << 4) & 0x10);
                    const int hi = (x[6 + i] >> 4) | ((qh >> (i + 12)) & 0x10);
                    sumi += (lo - 16) * yb[i] + (hi - 16) * yb[i + 16];
                }
            }
            acc += ad[b] * f16(x) * (float)sumi;
        }
        out[j] = acc;
    }
}

HM_INLINE void dot_q8_0_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    dot32_n(T_Q8_0, w, nb, a, n, k, out);
}
HM_INLINE void dot_q4_0_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    dot32_n(T_Q4_0, w, nb, a, n, k, out);
}
HM_INLINE void dot_q5_0_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    dot32_n(T_Q5_0, w, nb, a, n, k, out);
}

#else
// ---- x86: the 32 family on 256-bit vectors (AVX2, or AVX-512 VL + VNNI), K types below

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// unsigned x signed 8-bit products summed by fours into 8 int32 lanes
static inline __m256i dot_u8s8_256(__m256i u, __m256i s) {
#if HM_ISA == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// the stored quants of one 32 block as unsigned bytes (Q8_0: q + 128) and the offset to take off
static inline __m256i q32_unsigned(int type, const uint8_t *x, int *off) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (type == T_Q8_0) {
#if HM_ISA == 1     // maddubs would saturate at (q + 128) * a: the caller takes |q| against a with q's sign
        *off = 0;
        return _mm256_loadu_si256((const __m256i *)(x + 2));
#endif
        *off = 128;
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(x + 2)), _mm256_set1_epi8((char)0x80));
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(x + (type == T_Q4_0 ? 2 : 6)));
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
    if (type == T_Q4_0) {
        *off = 8;
        return v;
    }
    *off = 16;
    uint32_t qh;
    memcpy(&qh, x + 2, 4);
    // byte i takes bit i of qh: spread qh's bytes over 8 lanes each, test one bit per lane
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
    return _mm256_or_si256(v, hi);
}

HM_INLINE void dot32_n(int type, const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    const int bb = block_bytes(type);
    __m256 acc[NMAX];
    for (int j = 0; j < n; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *x = w + bb * b;
        int off;
        const __m256i wu = q32_unsigned(type, x, &off);
        const float dw = f16(x);
        for (int j = 0; j < n; j++) {
            const __m256i y = _mm256_loadu_si256((const __m256i *)(a[j] + 32 * b));
            const int32_t s = ACT_S32(a[j], k, nb)[b];
#if HM_ISA == 1
            __m256i p = type == T_Q8_0 ? dot_u8s8_256(_mm256_sign_epi8(wu, wu), _mm256_sign_epi8(y, wu)) : dot_u8s8_256(wu, y);
#else
            __m256i p = dot_u8s8_256(wu, y);
#endif
            p = _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(off * s)));
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ACT_D(a[j], k)[b]), _mm256_cvtepi32_ps(p), acc[j]);
        }
    }
    for (int j = 0; j < n; j++) out[j] = hsum256(acc[j]);
}

HM_INLINE void dot_q8_0_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    dot32_n(T_Q8_0, w, nb, a, n, k, out);
}
HM_INLINE void dot_q4_0_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    dot32_n(T_Q4_0, w, nb, a, n, k, out);
}
HM_INLINE void dot_q5_0_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    dot32_n(T_Q5_0, w, nb, a, n, k, out);
}

// Q4_K / Q5_K: the scales (bytes 0-7) and mins (8-15) of a block in a vector
static inline __m128i k4_scales_v(const uint8_t *s) {
    uint32_t u[4];
    k4_scales(s, u);
    return _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
}

// the mins as 16 int16 lanes, each repeated for the two per-16 activation sums of its sub-block
static inline __m256i k4_min_rep(__m128i scm) { return _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scm, scm)); }

// sum over sub-blocks of min * (activation sum of the sub-block), in 8 int32 lanes
static inline __m256i k4_min_sums(__m256i mrep, const int16_t *bs) {
    return _mm256_madd_epi16(mrep, _mm256_loadu_si256((const __m256i *)bs));
}

#if HM_ISA == 1
// ---- AVX2: llama.cpp's scheme (maddubs to int16 pairs, madd by the sub-block scale)

HM_INLINE void dot_k4_n(int hbits, const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    const int bb = hbits ? 176 : 144, qs_off = hbits ? 48 : 16;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[NMAX], accm[NMAX];
    for (int j = 0; j < n; j++) acc[j] = accm[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *x = w + bb * b;
        uint32_t u[4];
        k4_scales(x + 4, u);
        const __m256i mrep = k4_min_rep(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
        const float d = f16(x), dmin = f16(x + 2);
        __m256i wv[8];
        const __m256i qh = hbits ? _mm256_loadu_si256((const __m256i *)(x + 16)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x + qs_off + 32 * c));
            wv[2 * c] = _mm256_and_si256(q, m4);
            wv[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (hbits) {
                for (int h = 0; h < 2; h++) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << (2 * c + h)));
                    const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    wv[2 * c + h] = _mm256_or_si256(wv[2 * c + h], _mm256_and_si256(on, _mm256_set1_epi8(16)));
                }
            }
        }
        for (int j = 0; j < n; j++) {
            const int8_t *y = (const int8_t *)a[j] + 256 * b;
            __m256i sumi = _mm256_setzero_si256();
            for (int s = 0; s < 8; s++) {
                const __m256i p = _mm256_maddubs_epi16(wv[s], _mm256_loadu_si256((const __m256i *)(y + 32 * s)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16((short)K4_BYTE(u, s))));
            }
            const float ad = ACT_D(a[j], k)[b];
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * ad), _mm256_cvtepi32_ps(sumi), acc[j]);
            accm[j] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * ad),
                                      _mm256_cvtepi32_ps(k4_min_sums(mrep, ACT_S16(a[j], k, nb) + 16 * b)), accm[j]);
        }
    }
    for (int j = 0; j < n; j++) out[j] = hsum256(acc[j]) - hsum256(accm[j]);
}

HM_INLINE void dot_q6_K_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    __m256 acc[NMAX];
    for (int j = 0; j < n; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *x = w + 210 * b;
        const int8_t *sc = (const int8_t *)(x + 192);
        const float d = f16(x + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i sumi[NMAX];
        for (int j = 0; j < n; j++)          // the -32 offset: 32 * sum of scale * activation sum per 16
            sumi[j] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(ACT_S16(a[j], k, nb) + 16 * b))), 5));
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(x + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(x + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(x + 128 + 32 * h));
            __m256i wv[4], sv[4];
            wv[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            wv[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(12)), 2));
            wv[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, _mm256_set1_epi8(48)));
            wv[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                    _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8((char)0xC0)), 2));
            for (int c = 0; c < 4; c++)      // elements 128h + 32c .. +31: scales 8h + 2c, 8h + 2c + 1
                sv[c] = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * c + 1]), _mm_set1_epi16(sc[8 * h + 2 * c]));
            for (int j = 0; j < n; j++) {
                const int8_t *y = (const int8_t *)a[j] + 256 * b + 128 * h;
                __m256i s = sumi[j];
                for (int c = 0; c < 4; c++)
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(
                        _mm256_maddubs_epi16(wv[c], _mm256_loadu_si256((const __m256i *)(y + 32 * c))), sv[c]));
                sumi[j] = s;
            }
        }
        for (int j = 0; j < n; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * ACT_D(a[j], k)[b]), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
    }
    for (int j = 0; j < n; j++) out[j] = hsum256(acc[j]);
}

#else
// ---- AVX-512 VNNI: a 64-byte weight load per two sub-blocks, dpbusd per 4 elements, the
// sub-block scale applied by madd_epi16 (each dpbusd lane is |x| <= 4 * 63 * 127 < 2^15, so
// its low 16 bits are the whole value, and the scale lane's high 16 bits are 0)

static inline __m512i pair32(int lo, int hi) {       // int32 lanes 0-7 = lo, 8-15 = hi
    return _mm512_inserti64x4(_mm512_set1_epi32(lo), _mm256_set1_epi32(hi), 1);
}
static inline __m512i pair8(int lo, int hi) {        // bytes 0-31 = lo, 32-63 = hi
    return _mm512_inserti64x4(_mm512_set1_epi8((char)lo), _mm256_set1_epi8((char)hi), 1);
}
static inline __m512i pair16(int lo, int hi) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1);
}
static inline __m512i dot_u8s8_512(__m512i u, const int8_t *s) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512((const void *)s));
}

HM_INLINE void dot_k4_n(int hbits, const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    const int bb = hbits ? 176 : 144, qs_off = hbits ? 48 : 16;
    const __m512i m4 = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    const __m512i i0 = pair32(0, 2), i1 = pair32(1, 3), i2 = pair32(4, 6), i3 = pair32(5, 7);
    __m512 acc[NMAX];
    __m256 accm[NMAX];
    for (int j = 0; j < n; j++) {
        acc[j] = _mm512_setzero_ps();
        accm[j] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        const uint8_t *x = w + bb * b;
        const __m128i scm = k4_scales_v(x + 4);
        const __m256i mrep = k4_min_rep(scm);
        const float d = f16(x), dmin = f16(x + 2);
        const __m512i s32 = _mm512_cvtepu8_epi32(scm);
        const __m512i s0 = _mm512_permutexvar_epi32(i0, s32), s1 = _mm512_permutexvar_epi32(i1, s32);
        const __m512i s2 = _mm512_permutexvar_epi32(i2, s32), s3 = _mm512_permutexvar_epi32(i3, s32);
        const __m512i q01 = _mm512_loadu_si512((const void *)(x + qs_off));
        const __m512i q23 = _mm512_loadu_si512((const void *)(x + qs_off + 64));
        __m512i w0 = _mm512_and_si512(q01, m4), w1 = _mm512_and_si512(_mm512_srli_epi16(q01, 4), m4);
        __m512i w2 = _mm512_and_si512(q23, m4), w3 = _mm512_and_si512(_mm512_srli_epi16(q23, 4), m4);
        if (hbits) {      // sub-block s takes bit s of qh: w0 = (0 | 2), w1 = (1 | 3), w2 = (4 | 6), w3 = (5 | 7)
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + 16)));
            w0 = _mm512_or_si512(w0, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, pair8(1, 4)), sixteen));
            w1 = _mm512_or_si512(w1, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, pair8(2, 8)), sixteen));
            w2 = _mm512_or_si512(w2, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, pair8(16, 64)), sixteen));
            w3 = _mm512_or_si512(w3, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, pair8(32, 128)), sixteen));
        }
        for (int j = 0; j < n; j++) {
            const int8_t *y = (const int8_t *)a[j] + 256 * b;          // sub-blocks 0 2 1 3 4 6 5 7
            __m512i p = _mm512_madd_epi16(dot_u8s8_512(w0, y), s0);
            p = _mm512_add_epi32(p, _mm512_madd_epi16(dot_u8s8_512(w1, y + 64), s1));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(dot_u8s8_512(w2, y + 128), s2));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(dot_u8s8_512(w3, y + 192), s3));
            const float ad = ACT_D(a[j], k)[b];
            acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d * ad), _mm512_cvtepi32_ps(p), acc[j]);
            accm[j] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * ad),
                                      _mm256_cvtepi32_ps(k4_min_sums(mrep, ACT_S16(a[j], k, nb) + 16 * b)), accm[j]);
        }
    }
    for (int j = 0; j < n; j++) out[j] = _mm512_reduce_add_ps(acc[j]) - hsum256(accm[j]);
}

HM_INLINE void dot_q6_K_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = pair16(4, 2), shr = pair16(0, 2);
    const __m512i quarter = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
    __m512 acc[NMAX];
    for (int j = 0; j < n; j++) acc[j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *x = w + 210 * b;
        const float d = f16(x + 208);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(x + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        const __m512i s32 = _mm512_cvtepu16_epi32(sc16);             // int16 scale in the low half, 0 above
        __m512i wv[4], sv[4];
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(x + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + 128 + 32 * h)));
            // lo: elements 128h + 0..63 (ql low nibbles, qh bits 0-1 | 2-3), hi: 128h + 64..127
            wv[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30));
            wv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                            _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30));
            sv[2 * h] = _mm512_permutexvar_epi32(_mm512_add_epi32(quarter, _mm512_set1_epi32(8 * h)), s32);
            sv[2 * h + 1] = _mm512_permutexvar_epi32(_mm512_add_epi32(quarter, _mm512_set1_epi32(8 * h + 4)), s32);
        }
        for (int j = 0; j < n; j++) {
            const int8_t *y = (const int8_t *)a[j] + 256 * b;          // natural order
            __m512i p = _mm512_madd_epi16(dot_u8s8_512(wv[0], y), sv[0]);
            p = _mm512_add_epi32(p, _mm512_madd_epi16(dot_u8s8_512(wv[1], y + 64), sv[1]));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(dot_u8s8_512(wv[2], y + 128), sv[2]));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(dot_u8s8_512(wv[3], y + 192), sv[3]));
            const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(ACT_S16(a[j], k, nb) + 16 * b)));
            p = _mm512_sub_epi32(p, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
            acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d * ACT_D(a[j], k)[b]), _mm512_cvtepi32_ps(p), acc[j]);
        }
    }
    for (int j = 0; j < n; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}
#endif

#endif

HM_INLINE void dot_q4_K_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    dot_k4_n(0, w, nb, a, n, k, out);
}
HM_INLINE void dot_q5_K_n(const uint8_t *w, int nb, const uint8_t *const *a, int n, int64_t k, float *out) {
    dot_k4_n(1, w, nb, a, n, k, out);
}

DISPATCH(q4_K)
DISPATCH(q5_K)
DISPATCH(q6_K)
DISPATCH(q8_0)
DISPATCH(q4_0)
DISPATCH(q5_0)

static dot_fn dot_of(int type) {
    switch (type) {
    case T_Q4_0: return dot_q4_0;
    case T_Q5_0: return dot_q5_0;
    case T_Q8_0: return dot_q8_0;
    case T_Q4_K: return dot_q4_K;
    case T_Q5_K: return dot_q5_K;
    case T_Q6_K: return dot_q6_K;
    default: return 0;
    }
}

// ---------------------------------------------------------------- checks

static const char *const ERRORS[] = {
    "ok",
    "args is NULL",
    "n_rows < 1",
    "n_used < 1",
    "d or f < 1",
    "a weight type has no host kernel (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K have)",
    "d is not a whole number of the gate or up type's blocks",
    "f is not a whole number of the down type's blocks",
    "a row's byte count does not match its type and length",
    "a pointer (ids, wts, x, out, gate, up, down, skip) is NULL",
    "an expert id is negative",
    "no memory for the scratch buffers",
};

const char *host_moe_error(int code) {
    return code >= 0 && code < (int)(sizeof(ERRORS) / sizeof(ERRORS[0])) ? ERRORS[code] : "unknown error";
}

static int64_t row_bytes_of(int type, int64_t k) { return k / block_elems(type) * block_bytes(type); }

// 0 where the call is well formed, else an index into ERRORS (host_moe_error)
int host_moe_check(const void *vargs) {
    const host_moe_args *A = (const host_moe_args *)vargs;
    if (!A) return 1;
    if (A->n_rows < 1) return 2;
    if (A->n_used < 1) return 3;
    if (A->d < 1 || A->f < 1) return 4;
    if (!dot_of(A->gate_type) || !dot_of(A->up_type) || !dot_of(A->down_type)) return 5;
    if (A->d % block_elems(A->gate_type) || A->d % block_elems(A->up_type)) return 6;
    if (A->f % block_elems(A->down_type)) return 7;
    if (A->gate_row_bytes != row_bytes_of(A->gate_type, A->d) || A->up_row_bytes != row_bytes_of(A->up_type, A->d) ||
        A->down_row_bytes != row_bytes_of(A->down_type, A->f))
        return 8;
    if (!A->ids || !A->wts || !A->x || !A->out || !A->gate || !A->up || !A->down || !A->skip) return 9;
    return 0;
}

// a call that cannot be computed writes NaN: the bell's caller, a card kernel, has no way to take an error,
// and a wrong answer must not pass for a right one
static void fail(const host_moe_args *A) {
    if (A && A->out && A->n_rows > 0 && A->d > 0)
        for (int64_t i = 0; i < (int64_t)A->n_rows * A->d; i++) A->out[i] = NAN;
}

// ---------------------------------------------------------------- the thread pool
// Workers claim units of a job from one counter (several at a time while much is left); a unit
// of phase p starts once every unit of phase p - 1 is done. Nobody waits for a thread, only for
// units in progress: a worker the OS has not scheduled yet simply finds no units left, and the
// caller returns as soon as the last unit is done. The claim word holds the job's generation, unit count and next unit, so a late
// worker can never take a unit of a job other than the one it saw (compare-and-swap on all three).
// Idle workers spin for BLOOMERY_HOST_SPIN_US (default 2000) between calls, then sleep on a futex.

#define MAX_THREADS 512
#define MAX_PHASES 5
#define UNIT_BITS 20
#define MAX_UNITS ((1 << UNIT_BITS) - 1)

typedef struct {
    void (*run)(const void *ctx, int phase, int64_t unit);     // unit: its index within the phase
    const void *ctx;
    int n_phases;
    int64_t end[MAX_PHASES];                                    // units of phases 0..p: end[p]
} job;

static struct {
    pthread_mutex_t lock;                   // one job at a time (and its scratch)
    // the three words every thread touches, each on its own cache line
    _Alignas(64) _Atomic uint64_t claim;    // generation (24 bits) | total units | next unit
    _Alignas(64) _Atomic int64_t done;      // units finished in this job
    _Alignas(64) _Atomic uint32_t gen;      // the futex idle workers sleep on
    _Alignas(64) _Atomic int64_t ends[MAX_PHASES];   // the job's J.end, for claim() to size its takes
    _Atomic int n_sleeping;
    _Atomic int want;                       // workers taking part in the current job
    int n_workers;
    _Atomic int64_t spin_ns;
    job J;
    int64_t t_start, t_end[MAX_PHASES];     // when the last job started and each phase ended (ns)
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if HM_ISA
    _mm_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// Takes the next units of job g: returns the first and sets *n, or -1 when none is left. A take
// is about 1/(2 threads) of what remains of its phase (at least one unit, never past the phase's
// end), so a phase costs some tens of compare-and-swaps, not one per unit, and its last takes
// are single units that even out the threads' finish.
static int64_t claim(uint32_t g, int64_t *n) {
    uint64_t s = atomic_load(&pool.claim);
    for (;;) {
        if ((uint32_t)(s >> (2 * UNIT_BITS)) != g) return -1;
        const int64_t total = (int64_t)((s >> UNIT_BITS) & MAX_UNITS), next = (int64_t)(s & MAX_UNITS);
        if (next >= total) return -1;
        int64_t end = total;                          // if the job moved on meanwhile, the swap fails
        for (int p = 0; p < MAX_PHASES; p++) {
            const int64_t e = atomic_load_explicit(&pool.ends[p], memory_order_relaxed);
            if (e > next) {
                end = e < total ? e : total;
                break;
            }
        }
        int64_t k = (end - next) / (2 * (atomic_load_explicit(&pool.want, memory_order_relaxed) + 1));
        k = k < 1 ? 1 : k;
        if (atomic_compare_exchange_weak(&pool.claim, &s, s + (uint64_t)k)) {
            *n = k;
            return next;
        }
    }
}

static void wait_done(int64_t n) {
    for (int i = 1; atomic_load_explicit(&pool.done, memory_order_acquire) < n; i++) {
        cpu_relax();
        if ((i & 1023) == 0) sched_yield();         // a unit's owner may be waiting for a core
    }
}

static void run_units(uint32_t g) {
    int64_t u0, k;
    while ((u0 = claim(g, &k)) >= 0) {
        const job *J = &pool.J;                      // stable: the job cannot end before these units
        int p = 0;
        while (u0 >= J->end[p]) p++;
        const int64_t base = p ? J->end[p - 1] : 0, end = J->end[p];
        if (p > 0) wait_done(base);
        for (int64_t u = u0; u < u0 + k; u++) J->run(J->ctx, p, u - base);
        // the job may end (and the next one overwrite J) the moment done reaches its total
        const int64_t t = now_ns();
        if (atomic_fetch_add_explicit(&pool.done, k, memory_order_acq_rel) + k == end) pool.t_end[p] = t;
    }
}

static void *worker(void *arg) {
    const int idx = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&pool.gen);
    for (;;) {
        uint32_t g;
        int64_t until = now_ns() + pool.spin_ns;
        for (int i = 1; (g = atomic_load_explicit(&pool.gen, memory_order_acquire)) == seen; i++) {
            if (idx < atomic_load_explicit(&pool.want, memory_order_relaxed) && ((i & 255) || now_ns() < until)) {
                cpu_relax();
                continue;
            }
            atomic_fetch_add(&pool.n_sleeping, 1);
            if (atomic_load(&pool.gen) == seen) syscall(SYS_futex, &pool.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.n_sleeping, 1);
            until = now_ns() + pool.spin_ns;
        }
        seen = g;
        if (idx < atomic_load(&pool.want)) run_units(g);
    }
    return NULL;
}

static void pool_after_fork(void) {             // the child has none of the parent's workers
    pthread_mutex_init(&pool.lock, NULL);
    pool.n_workers = 0;
    atomic_store(&pool.n_sleeping, 0);
}

static _Atomic int spin_set;

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) {
    const char *s = getenv("BLOOMERY_HOST_SPIN_US");
    if (!atomic_load(&spin_set)) atomic_store(&pool.spin_ns, (s && *s ? atoll(s) : 2000) * 1000);
    pthread_atfork(NULL, NULL, pool_after_fork);
}

// How long idle workers spin for the next call before they sleep (default 2000 us, or
// BLOOMERY_HOST_SPIN_US): long for the cuda backend, whose calls come every layer while the card
// works; short where other threads need the cores between calls (the CPU backend's own work).
void host_moe_set_spin_us(int64_t us) {
    atomic_store(&spin_set, 1);
    atomic_store(&pool.spin_ns, (us > 0 ? us : 0) * 1000);
}

// the CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (a
// container limited to 16 CPUs of a 192-CPU host sees all 192 in its mask); read once
static int count_cpus(void) {
    cpu_set_t set;
    long n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    FILE *f = fopen("/sys/fs/cgroup/cpu.max", "r");
    if (f) {
        long long quota, period;
        if (fscanf(f, "%lld %lld", &quota, &period) == 2 && quota > 0 && period > 0) {
            const long q = (long)((quota + period - 1) / period);
            n = q < n ? q : n;
        }
        fclose(f);
    }
    return n > 0 ? (int)n : 1;
}

static int n_cpus(void) {
    static _Atomic int n;
    if (!atomic_load_explicit(&n, memory_order_relaxed)) atomic_store(&n, count_cpus());
    return atomic_load_explicit(&n, memory_order_relaxed);
}

int host_moe_max_threads(void) { return n_cpus(); }

// runs J on the caller and nt - 1 workers; call with pool.lock held
static void pool_run(const job *J, int nt) {
    pthread_once(&pool_once, pool_init);
    int nw = (nt > MAX_THREADS ? MAX_THREADS : nt) - 1;
    while (pool.n_workers < nw) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &at, worker, (void *)(intptr_t)pool.n_workers);
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        pthread_setname_np(t, "bloomery-hostk");
        pool.n_workers++;
    }
    if (nw > pool.n_workers) nw = pool.n_workers;
    pool.J = *J;
    pool.t_start = now_ns();
    const int64_t total = J->end[J->n_phases - 1];
    for (int p = 0; p < MAX_PHASES; p++) atomic_store_explicit(&pool.ends[p], p < J->n_phases ? J->end[p] : total,
                                                               memory_order_relaxed);
    const uint32_t g = (atomic_load(&pool.gen) + 1) & 0xFFFFFF;
    atomic_store(&pool.want, nw);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.claim, ((uint64_t)g << (2 * UNIT_BITS)) | ((uint64_t)total << UNIT_BITS));
    atomic_store(&pool.gen, g);
    if (nw > 0 && atomic_load(&pool.n_sleeping) > 0)
        syscall(SYS_futex, &pool.gen, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    run_units(g);
    wait_done(total);
    pool.t_end[J->n_phases - 1] = now_ns();
}

// The last call's phases: out[p] = microseconds from its start to the end of phase p (host_moe:
// 0 quantize, 1 gate/up, 2 swiglu, 3 down, 4 sum; a call with no host expert leaves them), for
// tools/bench_host_moe.py. Returns the number of phases.
int host_moe_last_phases(double *out) {
    pthread_mutex_lock(&pool.lock);
    const int n = pool.J.n_phases;
    for (int p = 0; p < n; p++) out[p] = (double)(pool.t_end[p] - pool.t_start) / 1e3;
    pthread_mutex_unlock(&pool.lock);
    return n;
}

// ---------------------------------------------------------------- scratch
// One buffer, used under pool.lock, grown when a call needs more and kept: no allocation in the
// steady state.

static uint8_t *scratch_p;
static size_t scratch_cap;

static uint8_t *scratch_get(size_t n) {
    if (scratch_cap < n) {
        free(scratch_p);
        const size_t cap = (n + n / 4 + 4096 + 63) & ~(size_t)63;
        scratch_p = (uint8_t *)aligned_alloc(64, cap);
        scratch_cap = scratch_p ? cap : 0;
    }
    return scratch_p;
}

static inline size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

// ---------------------------------------------------------------- the layer
// Phases (units): 0 quantize input rows (256 elements of a row), 1 gate + up (an expert's RC_GU
// rows), 2 swiglu + quantize (256 elements of a pair's hidden row), 3 down into y [P, D] (an
// expert's RC_DN rows), 4 out = sum over slots in order of wts * y (RC_OUT rows of a token).

#define RC_GU 16
#define RC_DN 32
#define RC_OUT 512

typedef struct {
    const host_moe_args *A;
    int NA, n_ex;
    int64_t D, F;
    int lg, lu, ld;
    int64_t xrow_g, xrow_u, hrow;
    int64_t x_units, gu_chunks, dn_chunks, out_chunks, h_units;  // per token / expert / expert / token / pair
    dot_fn dg, du, dd;
    int nbg, nbu, nbd;
    const int32_t *ex, *cnt, *start, *plist;
    uint8_t *xa_g, *xa_u, *ha;
    float *g, *u, *y;
} layer;

// rows r0..r1 of one expert's matrix against the activation rows of its pairs pl[0..cnt);
// pair p's activation row is act + (p / div) * act_row; result r of pair p goes to dst[p * ld + r]
static void expert_rows(dot_fn dot, const uint8_t *w, int64_t row_bytes, int nb, int64_t r0, int64_t r1,
                        const int32_t *pl, int cnt, int div, const uint8_t *act, int64_t act_row, int64_t k,
                        float *dst, int64_t ld) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * row_bytes;
        for (int c = 0; c < cnt; c += NMAX) {
            const int n = cnt - c < NMAX ? cnt - c : NMAX;
            const uint8_t *ap[NMAX];
            float o[NMAX];
            for (int j = 0; j < n; j++) ap[j] = act + (int64_t)(pl[c + j] / div) * act_row;
            dot(wr, nb, ap, n, k, o);
            for (int j = 0; j < n; j++) dst[(int64_t)pl[c + j] * ld + r] = o[j];
        }
    }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// elements 256 c .. 256 c + 255 of a row of length k (a 256 block, or eight 32 blocks)
static void quantize_span(int layout, const float *x, const float *silu_u, int64_t k, uint8_t *dst, int64_t c) {
    const int64_t per = 256 / layout_block(layout), b0 = c * per;
    quantize_blocks(layout, x, silu_u, k, dst, b0, min64(k / layout_block(layout), b0 + per));
}

static void layer_unit(const void *vctx, int phase, int64_t unit) {
    const layer *L = (const layer *)vctx;
    const host_moe_args *A = L->A;
    const int64_t D = L->D, F = L->F;
    if (phase == 0) {
        const int64_t t = unit / L->x_units, c = unit % L->x_units;
        quantize_span(L->lg, A->x + t * D, 0, D, L->xa_g + t * L->xrow_g, c);
        if (L->xrow_u) quantize_span(L->lu, A->x + t * D, 0, D, L->xa_u + t * L->xrow_u, c);
    } else if (phase == 1) {
        const int64_t ei = unit / L->gu_chunks, r0 = unit % L->gu_chunks * RC_GU, r1 = min64(F, r0 + RC_GU);
        const int32_t e = L->ex[ei], *pl = L->plist + L->start[ei];
        expert_rows(L->dg, A->gate[e], A->gate_row_bytes, L->nbg, r0, r1, pl, L->cnt[ei], L->NA, L->xa_g, L->xrow_g,
                    D, L->g, F);
        expert_rows(L->du, A->up[e], A->up_row_bytes, L->nbu, r0, r1, pl, L->cnt[ei], L->NA, L->xa_u,
                    L->xrow_u ? L->xrow_u : L->xrow_g, D, L->u, F);
    } else if (phase == 2) {
        const int64_t p = L->plist[unit / L->h_units];
        quantize_span(L->ld, L->g + p * F, L->u + p * F, F, L->ha + p * L->hrow, unit % L->h_units);
    } else if (phase == 3) {
        const int64_t ei = unit / L->dn_chunks, r0 = unit % L->dn_chunks * RC_DN, r1 = min64(D, r0 + RC_DN);
        expert_rows(L->dd, A->down[L->ex[ei]], A->down_row_bytes, L->nbd, r0, r1, L->plist + L->start[ei],
                    L->cnt[ei], 1, L->ha, L->hrow, F, L->y, D);
    } else {
        const int64_t t = unit / L->out_chunks, r0 = unit % L->out_chunks * RC_OUT, r1 = min64(D, r0 + RC_OUT);
        float *o = A->out + t * D;
        memset(o + r0, 0, sizeof(float) * (size_t)(r1 - r0));
        for (int a = 0; a < L->NA; a++) {
            const int64_t p = t * L->NA + a;
            if (A->skip[A->ids[p]]) continue;
            const float w = A->wts[p], *y = L->y + p * D;
            for (int64_t r = r0; r < r1; r++) o[r] += w * y[r];
        }
    }
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static void host_moe_run(const host_moe_args *A) {
    if (host_moe_check(A) != 0) {
        fail(A);
        return;
    }
    const int T = A->n_rows, NA = A->n_used, P = T * NA;
    const int64_t D = A->d, F = A->f;
    int32_t max_id = 0;
    for (int p = 0; p < P; p++) {
        if (A->ids[p] < 0) {
            fail(A);
            return;
        }
        if (A->ids[p] > max_id) max_id = A->ids[p];
    }
    layer L = {.A = A, .NA = NA, .D = D, .F = F, .lg = layout_of(A->gate_type), .lu = layout_of(A->up_type),
               .ld = layout_of(A->down_type), .dg = dot_of(A->gate_type), .du = dot_of(A->up_type),
               .dd = dot_of(A->down_type), .nbg = (int)(D / block_elems(A->gate_type)),
               .nbu = (int)(D / block_elems(A->up_type)), .nbd = (int)(F / block_elems(A->down_type))};
    L.xrow_g = act_row_bytes(L.lg, D);
    L.xrow_u = L.lu == L.lg ? 0 : act_row_bytes(L.lu, D);
    L.hrow = act_row_bytes(L.ld, F);
    const size_t n_int = up64(sizeof(int32_t) * (5 * (size_t)P + max_id + 1));
    const size_t n_xa = up64((size_t)T * (L.xrow_g + L.xrow_u)), n_gu = up64(sizeof(float) * (size_t)P * F);
    const size_t n_ha = up64((size_t)P * L.hrow), n_y = up64(sizeof(float) * (size_t)P * D);
    pthread_mutex_lock(&pool.lock);
    uint8_t *base = scratch_get(n_int + n_xa + 2 * n_gu + n_ha + n_y);
    if (!base) {
        pthread_mutex_unlock(&pool.lock);
        fail(A);
        return;
    }
    // X distinct host experts in order of first use, each with its pairs in order: ex [X],
    // cnt [X], start [X], plist [P]; slot [max_id + 1] maps an expert to its index in ex
    int32_t *ex = (int32_t *)base, *cnt = ex + P, *start = cnt + P, *plist = start + P, *fill = plist + P;
    int32_t *slot = fill + P;
    L.xa_g = base + n_int;
    L.xa_u = L.xrow_u ? L.xa_g + (size_t)T * L.xrow_g : L.xa_g;
    L.g = (float *)(base + n_int + n_xa);
    L.u = (float *)(base + n_int + n_xa + n_gu);
    L.ha = base + n_int + n_xa + 2 * n_gu;
    L.y = (float *)(L.ha + n_ha);
    int n_ex = 0;
    for (int p = 0; p < P; p++) slot[A->ids[p]] = -1;
    for (int p = 0; p < P; p++) {
        const int32_t e = A->ids[p];
        if (A->skip[e]) continue;
        if (slot[e] < 0) {
            slot[e] = n_ex;
            ex[n_ex] = e;
            cnt[n_ex++] = 0;
        }
        cnt[slot[e]]++;
    }
    if (n_ex == 0) {
        pthread_mutex_unlock(&pool.lock);
        memset(A->out, 0, sizeof(float) * (size_t)T * D);
        return;
    }
    for (int i = 0, s = 0; i < n_ex; s += cnt[i++]) start[i] = fill[i] = s;
    for (int p = 0; p < P; p++)
        if (!A->skip[A->ids[p]]) plist[fill[slot[A->ids[p]]]++] = p;
    const int n_hp = start[n_ex - 1] + cnt[n_ex - 1];
    L.n_ex = n_ex;
    L.ex = ex, L.cnt = cnt, L.start = start, L.plist = plist;
    L.gu_chunks = ceil_div(F, RC_GU);
    L.dn_chunks = ceil_div(D, RC_DN);
    L.out_chunks = ceil_div(D, RC_OUT);
    L.h_units = ceil_div(F, 256);
    L.x_units = ceil_div(D, 256);
    job J = {.run = layer_unit, .ctx = &L, .n_phases = 5};
    J.end[0] = T * L.x_units;
    J.end[1] = J.end[0] + (int64_t)n_ex * L.gu_chunks;
    J.end[2] = J.end[1] + (int64_t)n_hp * L.h_units;
    J.end[3] = J.end[2] + (int64_t)n_ex * L.dn_chunks;
    J.end[4] = J.end[3] + (int64_t)T * L.out_chunks;
    if (J.end[4] > MAX_UNITS) {             // some 10^5 rows in one call: refused, not truncated
        pthread_mutex_unlock(&pool.lock);
        fail(A);
        return;
    }
    pool_run(&J, A->n_threads > 0 ? A->n_threads : n_cpus());
    pthread_mutex_unlock(&pool.lock);
}

void host_moe(void *vargs) {
    host_moe_args *A = (host_moe_args *)vargs;
    const int64_t t0 = now_ns();
    host_moe_run(A);
    A->busy_ns += now_ns() - t0;
}

// ---------------------------------------------------------------- the doorbell
// The card hands a decode step's host part over through two words a layer in pinned host RAM that
// both sides map. (A host node a layer, cuLaunchHostFunc, with three copies out and one back, took
// some 50 us more a layer: a driver thread wakes for each; docs/performance.md, run N.) The card's
// host_post kernel (kernels/moe.cu) writes the layer's rows, ids and weights into the layer's
// pinned buffers, then `post[l]` = BELL_WORD * n + T (n counts the layer's jobs, T < BELL_WORD the rows); this
// file's bell thread, which spins while jobs are due, sees the word change, runs host_moe on the
// args of (l, T) and stores the same word in `done[l]`; the card's host_take kernel waits for it
// and adds the sum. Python arms the bell with the number of jobs a step will post before it
// launches the step, so the thread sleeps (a futex) when no step is in flight: it wakes on an
// arm, and sleeps again once every armed job is served and BLOOMERY_HOST_SPIN_US has passed,
// or after BELL_IDLE_NS with nothing posted whatever the count says.

#define BELL_IDLE_NS 10000000000LL
#define BELL_WORD 64                 // the job word's T in its low 6 bits (kernels/moe.cu, host_moe.py)

typedef struct {
    int max_layers, rows;                     // args is [max_layers][rows + 1]
    host_moe_args *const *args;
    volatile int64_t *post, *done;            // [max_layers] each, written by the card / by this thread
    int64_t *seen;                            // [max_layers] the last word served
    _Atomic int n_layers;                     // layers in use (Python adds them as the model meets them)
    _Alignas(64) _Atomic int64_t armed;       // jobs announced and not yet served
    _Alignas(64) _Atomic uint32_t wake;       // the futex the idle thread sleeps on
    _Atomic int stop;
    _Atomic int64_t served;
    pthread_t thread;
} bell;

static void *bell_main(void *vb) {
    bell *B = (bell *)vb;
    int64_t last = now_ns();
    pthread_once(&pool_once, pool_init);
    while (!atomic_load_explicit(&B->stop, memory_order_acquire)) {
        int found = 0;
        const int n = atomic_load_explicit(&B->n_layers, memory_order_acquire);
        for (int l = 0; l < n; l++) {
            const int64_t w = __atomic_load_n(&B->post[l], __ATOMIC_ACQUIRE);
            if (w == B->seen[l]) continue;
            B->seen[l] = w;
            const int t = (int)(w & (BELL_WORD - 1));
            host_moe_args *A = t >= 1 && t <= B->rows ? B->args[(int64_t)l * (B->rows + 1) + t] : NULL;
            if (A) host_moe(A);              // a word with no args: the card gets its sum as it was (none posts one)
            atomic_fetch_sub(&B->armed, 1);
            atomic_fetch_add(&B->served, 1);   // counted before the answer: whoever waits on it sees the count
            __atomic_store_n(&B->done[l], w, __ATOMIC_RELEASE);
            found = 1;
        }
        if (found) {
            last = now_ns();
            continue;
        }
        cpu_relax();
        const int64_t idle = now_ns() - last;
        const int64_t armed = atomic_load(&B->armed);
        if ((armed <= 0 && idle > atomic_load(&pool.spin_ns)) || idle > BELL_IDLE_NS) {
            const uint32_t w = atomic_load(&B->wake);
            if (idle > BELL_IDLE_NS) atomic_store(&B->armed, 0);      // a step that never posted its jobs
            if (atomic_load(&B->armed) <= 0 && !atomic_load(&B->stop))
                syscall(SYS_futex, &B->wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
            last = now_ns();
        }
    }
    return NULL;
}

// A bell over these arrays (each stays valid until host_moe_bell_close); NULL when the thread
// cannot be made or the sizes are wrong.
void *host_moe_bell_open(int max_layers, int rows, host_moe_args *const *args, int64_t *post, int64_t *done) {
    if (max_layers < 1 || rows < 1 || rows >= BELL_WORD || !args || !post || !done) return NULL;
    bell *B = (bell *)calloc(1, sizeof(bell));
    int64_t *seen = (int64_t *)calloc((size_t)max_layers, sizeof(int64_t));
    if (!B || !seen) {
        free(B);
        free(seen);
        return NULL;
    }
    B->max_layers = max_layers, B->rows = rows, B->args = args, B->post = post, B->done = done, B->seen = seen;
    for (int l = 0; l < max_layers; l++) seen[l] = post[l];
    if (pthread_create(&B->thread, NULL, bell_main, B) != 0) {
        free(seen);
        free(B);
        return NULL;
    }
    pthread_setname_np(B->thread, "bloomery-bell");
    return B;
}

// Layers 0 .. n - 1 may post from now on (their args entries are set). Returns 0, or -1 for n out of range.
int host_moe_bell_layers(void *vb, int n) {
    bell *B = (bell *)vb;
    if (n < 0 || n > B->max_layers) return -1;
    atomic_store_explicit(&B->n_layers, n, memory_order_release);
    return 0;
}

// `jobs` more posts are coming (a step about to be launched): wake the thread if it sleeps.
void host_moe_bell_arm(void *vb, int64_t jobs) {
    bell *B = (bell *)vb;
    atomic_fetch_add(&B->armed, jobs);
    atomic_fetch_add(&B->wake, 1);
    syscall(SYS_futex, &B->wake, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

// Jobs served since the bell opened.
int64_t host_moe_bell_served(void *vb) { return atomic_load(&((bell *)vb)->served); }

// Stop the thread (after the job it is in) and free the bell.
void host_moe_bell_close(void *vb) {
    bell *B = (bell *)vb;
    if (!B) return;
    atomic_store(&B->stop, 1);
    atomic_fetch_add(&B->wake, 1);
    syscall(SYS_futex, &B->wake, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    pthread_join(B->thread, NULL);
    free(B->seen);
    free(B);
}

// ---------------------------------------------------------------- the floor

typedef struct {
    const uint64_t *buf;
    int64_t n, chunk;
    _Atomic uint64_t *total;
    int init;
} read_job;

static void read_unit(const void *vctx, int phase, int64_t unit) {
    (void)phase;
    const read_job *R = (const read_job *)vctx;
    uint64_t *b = (uint64_t *)R->buf;
    const int64_t i0 = unit * R->chunk, i1 = min64(R->n, i0 + R->chunk);
    if (R->init) {
        for (int64_t i = i0; i < i1; i++) b[i] = (uint64_t)i;
        return;
    }
    uint64_t s[8] = {0};                            // independent sums: loads, not adds, set the pace
    for (int64_t i = i0; i < i1; i += 8)
        for (int j = 0; j < 8; j++) s[j] += R->buf[i + j];
    atomic_fetch_add(R->total, s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7]);
}

volatile uint64_t host_read_sink;

// The host's memory read bandwidth in GB/s (best of reps): the pool's n_threads threads (<= 0:
// all) sum a buffer of `bytes` in 1 MiB units, as host_moe spreads its units.
double host_read_bw(int64_t bytes, int n_threads, int reps) {
    const int nt = n_threads > 0 ? n_threads : n_cpus();
    const int64_t n = bytes / 64 * 8, chunk = (1 << 20) / 8;        // whole 64-byte lines
    uint64_t *buf = (uint64_t *)aligned_alloc(64, up64((size_t)n * 8));
    if (!buf || n < 1 || ceil_div(n, chunk) > MAX_UNITS) {
        free(buf);
        return -1.0;
    }
    _Atomic uint64_t total = 0;
    read_job R = {.buf = buf, .n = n, .chunk = chunk, .total = &total, .init = 1};
    job J = {.run = read_unit, .ctx = &R, .n_phases = 1, .end = {ceil_div(n, chunk)}};
    double best = 0.0;
    pthread_mutex_lock(&pool.lock);
    pool_run(&J, nt);
    R.init = 0;
    for (int r = 0; r < (reps > 0 ? reps : 1); r++) {
        const int64_t t0 = now_ns();
        pool_run(&J, nt);
        const double gbs = (double)n * 8 / (double)(now_ns() - t0);
        if (gbs > best) best = gbs;
    }
    pthread_mutex_unlock(&pool.lock);
    host_read_sink = atomic_load(&total);
    free(buf);
    return best;
}
