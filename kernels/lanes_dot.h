// The host's quantized products, once for both host kernel sets: kernels/cpu_lanes.c (the CPU
// backend, bloomery/engine/cpu/kernels.py) and kernels/host_moe.c (the cuda backend's host
// experts, bloomery/engine/cpu/host_moe.py) include this file, so the CPU backend and the host
// tier round activations and sum products with the same code and get the same bits.
//
// What is here, each in llama.cpp's CPU float order (x86 build; the numpy forms in
// bloomery/engine/quant/q8_0.py and k_quants.py are held to llama.cpp's goldens, and
// tests/test_cpu_kernels.py holds these to the numpy forms bit for bit):
//   - the activations' rounding: quantize_row_q8_0 (lanes_q8_0_block) and quantize_row_q8_K
//     (lanes_q8_K_block, with the repacked gemm's tie rule where pos_wins is set);
//   - swiglu with ggml_v_expf (lanes_swiglu);
//   - the product of ONE weight row with up to LANES_NMAX quantized activation rows, per type:
//     lanes_dot_q80 (Q8_0, Q5_0, Q4_0: vec_dot's eight lanes of 4-sums, acc = fma(d_w * d_a,
//     lane, acc) block after block, hsum_float_8), lanes_dot_q6k and lanes_dot_q5k (the AVX2
//     vec_dot's lanes, or ggml's tiled matmul's order from 8 columns: `tiled`), lanes_dot_q4k
//     (the repacked q4_K_8x8 gemv, once per super-block, or its gemm, once per 64: `gemm`).
// Every integer sum is exact whatever the instructions, and the float steps are spelled out, so
// the AVX-512 VNNI, AVX2 and portable C paths below give the same bits. Build with
// -ffp-contract=off: the compiler must add no fma of its own.
//
// Legend: K = row length, nb = blocks of the weight row (32 or 256 elements), n = activation rows.
#ifndef BLOOMERY_LANES_DOT_H
#define BLOOMERY_LANES_DOT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LANES_AVX2 1
#else
#define LANES_AVX2 0
#endif

// AVX-512 with VNNI: 64 elements a vector, dpbusd / dpwssd; the same integers, so the same bits
#if LANES_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LANES_512 1
#else
#define LANES_512 0
#endif

#define LANES_INLINE static inline __attribute__((always_inline))
#define LANES_NMAX 4                                   // activation rows one call of a dot takes

#define Q4_0_BYTES 18                                  // f16 d, 16 nibble pairs
#define Q5_0_BYTES 22                                  // f16 d, u32 high bits, 16 nibble pairs
#define Q8_0_BYTES 34                                  // f16 d, 32 int8
#define Q4_K_BYTES 144                                 // f16 d, f16 dmin, 12 scale bytes, 128 nibble pairs
#define Q5_K_BYTES 176                                 // f16 d, f16 dmin, 12 scale bytes, 32 high bits, 128 nibbles
#define Q6_K_BYTES 210                                 // 128 low nibbles, 64 high pairs, 16 int8 scales, f16 d

static inline float hsum8(const float a[8]) {          // hsum_float_8's order
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static inline float f16_at(const uint8_t *p) {         // a stored f16 scale, exactly as f32
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

// get_scale_min_k4: the 8 six-bit scales and mins of a Q4_K / Q5_K super-block
static inline void q4k_scales(const uint8_t *s, int32_t sc[8], int32_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

// the Q8_0 family by qtype: 0 Q8_0, 1 Q5_0, 2 Q4_0
static inline int64_t q80_bytes(int qtype) { return qtype == 0 ? Q8_0_BYTES : qtype == 1 ? Q5_0_BYTES : Q4_0_BYTES; }

// the 32 signed quants of a Q8_0 (qtype 0), Q5_0 (1) or Q4_0 (2) block
static inline void q80_ints(const uint8_t *blk, int qtype, int8_t q[32]) {
    if (qtype == 0) {
        memcpy(q, blk + 2, 32);
        return;
    }
    if (qtype == 2) {
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((blk[2 + j] & 0xF) - 8);
            q[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
        }
        return;
    }
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const uint8_t *qs = blk + 6;
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}

static inline void q6k_ints(const uint8_t *blk, uint8_t q[256]) {   // the unsigned quants, in order
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        uint8_t *o = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            o[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

static inline void q5k_ints(const uint8_t *blk, uint8_t q[256]) {   // the unsigned quants, in order
    const uint8_t *qh = blk + 16, *qs = blk + 48;
    for (int j = 0; j < 4; j++)                        // sub-blocks 2j (low nibbles, bit 2j), 2j + 1 (high, bit 2j + 1)
        for (int l = 0; l < 32; l++) {
            q[64 * j + l] = (uint8_t)((qs[32 * j + l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4));
            q[64 * j + 32 + l] = (uint8_t)((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
        }
}

#if LANES_AVX2
static inline float hsum8_ps(__m256 v) {               // hsum8's adds, in registers
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));   // a0 + a4, a1 + a5, ..
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           // (a0 + a4) + (a2 + a6), ..
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t hsum_epi32(__m256i v) {          // integer: any order is exact
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

// the 8 lane sums of one block: |w| * (a with w's sign), pairs to int16 (no saturation: |w| <=
// 128 here, |a| <= 127), pairs again to int32; with VNNI one dpbusd, the same integers
static inline __m256i block_lanes_i(__m256i w_abs, __m256i w, __m256i a) {
    const __m256i s = _mm256_sign_epi8(a, w);
#if LANES_512
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, s), _mm256_set1_epi16(1));
#endif
}

// 32 bits -> 32 bytes, 0xFF where the bit is set
static inline __m256i bits_to_bytes(uint32_t x) {
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                            0x0202020202020202, 0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf), bit);
    return _mm256_cmpeq_epi8(b, bit);
}

// the 32 signed quants of a Q8_0 / Q5_0 / Q4_0 block (qtype 0 / 1 / 2), in order
static inline __m256i q80_vec(const uint8_t *blk, int qtype) {
    if (qtype == 0)
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m128i lo4 = _mm_set1_epi8(0xF);
    if (qtype == 2) {
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), lo4), _mm_and_si128(qs, lo4));
        return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    }
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 6));
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), lo4), _mm_and_si128(qs, lo4));
#if LANES_512
    q = _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(0x10));     // bit i of qh: 16 to quant i
#else
    q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
#endif
    return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
}

static inline void q6k_vecs(const uint8_t *blk, __m256i q[8]) {    // the unsigned quants, 32 a vector, in order
    const __m256i lo4 = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, lo4), _mm256_slli_epi16(_mm256_and_si256(hb, three), 4));
        q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, lo4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4));
        q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), three), 4));
        q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), three), 4));
    }
}

static inline void q5k_vecs(const uint8_t *blk, __m256i q[8]) {    // sub-block c's 32 quants, c = 2j + h
    const __m256i lo4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 16));
    for (int j = 0; j < 4; j++) {
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * j));
        q[2 * j] = _mm256_or_si256(_mm256_and_si256(qs, lo4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
        q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 4), lo4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
    }
}

// Q4_K / Q5_K: a super-block's 8 scales (bytes 0-7) and 8 mins (bytes 8-15) from its 12 scale
// bytes at s (16 read), get_scale_min_k4 four at a time in the four int32 lanes, no trip through
// memory: [a0 & 0x3f.., (a2 & 0x0f..) | (a0 >> 6 & 3..) << 4, a1 & 0x3f.., (a2 >> 4 & 0x0f..) | (a1 >> 6 & 3..) << 4]
static inline __m128i k4_scales_v(const uint8_t *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    const __m128i a = _mm_shuffle_epi32(v, 0x50);                          // a0 a0 a1 a1
    const __m128i b = _mm_srlv_epi32(_mm_shuffle_epi32(v, 0xAA), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i lo = _mm_and_si128(a, _mm_set1_epi32(0x3f3f3f3f));
    const __m128i hi = _mm_or_si128(_mm_and_si128(b, _mm_set1_epi32(0x0f0f0f0f)),
                                    _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(a, 6), _mm_set1_epi32(0x03030303)), 4));
    return _mm_blend_epi32(lo, hi, 0xA);
}

// int16 lanes all byte i of v (zero-extended; v in both 128-bit halves): pshufb by [i, 0x80]
static inline __m256i lanes_bcast_u8(__m256i v, int i) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x8000 | i)));
}

#endif

#if LANES_512
static inline __m512i lanes_pair16(int lo, int hi) {   // int16 lanes: the low 256 bits lo, the high hi
    return _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1);
}
static inline __m512i lanes_pair8(int lo, int hi) {    // bytes: the low 256 bits lo, the high hi
    return _mm512_inserti64x4(_mm512_set1_epi8((char)lo), _mm256_set1_epi8((char)hi), 1);
}
static inline __m256i lanes_fold(__m512i v) {          // int32 lanes i and i + 8 added: exact
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
static inline __m512i lanes_pick_halves(int c) {       // int32 indices: 2c in the low 256 bits, 2c + 1 in the high
    return _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
}

// the 32 quants of a Q8_0 / Q5_0 / Q4_0 block (qtype 0 / 1 / 2) plus the type's offset: w + 128,
// w + 16, w + 8, unsigned
static inline __m256i q80_unsigned(const uint8_t *blk, int qtype) {
    if (qtype == 0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8((char)0x80));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (qtype == 2 ? 2 : 6))), lo4 = _mm_set1_epi8(0xF);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), lo4), _mm_and_si128(qs, lo4));
    if (qtype == 2)
        return q;
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    return _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(16));
}

// the 64 quants of sub-blocks 2c, 2c + 1 of a Q4_K / Q5_K super-block in order (vector c of 4):
// the 32 bytes at qs + 32c in both halves, the high half's shifted down a nibble
static inline __m512i k4_nibbles64(const uint8_t *qs, int c) {
    const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
    return _mm512_and_si512(_mm512_mask_srli_epi16(q, (__mmask32)0xFFFF0000u, q, 4), _mm512_set1_epi8(0xF));
}
#endif

// ---- activations, as ggml-cpu's x86 build rounds them (quant/q8_0.py and k_quants.py hold the numpy form)

// quantize_row_q8_0, one block of 32: d = f16(amax / 127), the multiplier 127 / amax in f32, round
// half to even
LANES_INLINE void lanes_q8_0_block(const float *xb, int8_t *q, float *d) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
    const float mult = amax != 0.0f ? 127.0f / amax : 0.0f;
    *d = (float)(_Float16)(amax / 127.0f);
    for (int i = 0; i < 32; i++) q[i] = (int8_t)rintf(xb[i] * mult);
}

// quantize_row_q8_K_ref, one block of 256: the element of largest magnitude (the first on a tie)
// maps to -127, iscale = -127 / max, round half to even, capped at 127, d = 1 / iscale; with
// pos_wins (a row of the repacked Q4_K gemm, ggml_quantize_mat_q8_K_4x8) on a +max / -max tie the
// positive one maps to -127. bs: the sums per 16.
LANES_INLINE void lanes_q8_K_block(const float *xb, int pos_wins, int8_t *qb, float *d, int16_t *bs) {
    float amax = 0.0f, vmax = 0.0f;
#if LANES_512
    {   // max_ps keeps its second operand where the first is NaN: a NaN is passed over, as the scalar's >
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + i)), m);
        amax = _mm512_reduce_max_ps(m);
        for (int i = 0; i < 256; i += 16) {        // the first element that reached amax
            const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + i)), _mm512_set1_ps(amax),
                                                    _CMP_EQ_OQ);
            if (eq) {
                vmax = xb[i + __builtin_ctz(eq)];
                break;
            }
        }
    }
#elif LANES_AVX2
    {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 256; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), m);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        for (int i = 0; i < 256; i += 8) {             // the first element that reached amax
            const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)),
                                                            _mm256_set1_ps(amax), _CMP_EQ_OQ));
            if (eq) {
                vmax = xb[i + __builtin_ctz((unsigned)eq)];
                break;
            }
        }
    }
#else
    for (int i = 0; i < 256; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
    for (int i = 0; i < 256; i++)                      // the first element that reached amax
        if (fabsf(xb[i]) == amax) {
            vmax = xb[i];
            break;
        }
#endif
    if (pos_wins && vmax < 0.0f)
        for (int i = 0; i < 256; i++)
            if (xb[i] == amax) {
                vmax = amax;
                break;
            }
    if (vmax == 0.0f) {
        *d = 0.0f;
        memset(qb, 0, 256);
        memset(bs, 0, 32);
        return;
    }
    const float iscale = -127.0f / vmax;
#if LANES_512
    for (int j = 0; j < 16; j++) {                     // rint(iscale * x) capped at 127, 16 at a time
        const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_set1_ps(iscale), _mm512_loadu_ps(xb + 16 * j)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(v, _mm512_set1_ps(127.0f)));
        _mm_storeu_si128((__m128i *)(qb + 16 * j), _mm512_cvtepi32_epi8(qi));
        bs[j] = (int16_t)_mm512_reduce_add_epi32(qi);
    }
#elif LANES_AVX2
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i s4[8];                                     // per 32: the sums per 4 (lanes 0-3 the first 16, 4-7 the next)
    for (int c = 0; c < 8; c++) {                      // rint(iscale * x) capped at 127, 32 at a time
        __m256i v[4];
        for (int i = 0; i < 4; i++) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_set1_ps(iscale), _mm256_loadu_ps(xb + 32 * c + 8 * i)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[i] = _mm256_cvtps_epi32(_mm256_min_ps(r, _mm256_set1_ps(127.0f)));
        }
        // |q| <= 127: the packs do not saturate; the permute undoes their per-128-bit order
        const __m256i q8 = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), order);
        _mm256_storeu_si256((__m256i *)(qb + 32 * c), q8);
        s4[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
    }
    for (int h = 0; h < 2; h++) {                      // [g0 g2 g4 g6 | g1 g3 g5 g7] of four 32s, put in order
        const __m256i g = _mm256_permutevar8x32_epi32(
            _mm256_hadd_epi32(_mm256_hadd_epi32(s4[4 * h], s4[4 * h + 1]), _mm256_hadd_epi32(s4[4 * h + 2], s4[4 * h + 3])),
            order);
        _mm_storeu_si128((__m128i *)(bs + 8 * h), _mm_packs_epi32(_mm256_castsi256_si128(g), _mm256_extracti128_si256(g, 1)));
    }
#else
    for (int i = 0; i < 256; i++) {
        const float v = rintf(iscale * xb[i]);
        qb[i] = (int8_t)(v < 127.0f ? v : 127.0f);
    }
    for (int j = 0; j < 16; j++) {
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) sum += qb[16 * j + i];
        bs[j] = (int16_t)sum;
    }
#endif
    *d = 1.0f / iscale;
}

// ---- ggml_v_expf and swiglu

// ggml_v_expf, the __m512 version (the AVX-512 build the reference runs), one lane
static inline float v_expf1(float x) {
    const float r = 0x1.8p23f;
    float z = fmaf(x, 0x1.715476p+0f, r);
    float n = z - r;
    float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    float u = b * b;
    float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                   u, fmaf(0x1.ffffecp-1f, b, 1.0f));
    if (!(fabsf(n) <= 192.0f)) {                   // _CMP_GT_OQ: a NaN n keeps the scalef result
        if (fabsf(n) > 192.0f)
            return n > 0 ? INFINITY : 0.0f;
        return j + n;                              // NaN
    }
    const int e = (int)n;
    if (e >= -126 && e <= 127) {                   // 2^e is a normal float: one rounding, as ldexpf's
        const uint32_t bits = (uint32_t)(e + 127) << 23;
        float p2;
        memcpy(&p2, &bits, 4);
        return j * p2;
    }
    return ldexpf(j, e);
}

#if defined(__AVX512F__)
// v_expf1 on 16 lanes at once: the same operations in the same order; 2^n by scalef (one rounding, as the
// scalar's product or ldexpf), the lanes past |n| > 192 to inf or 0 (a NaN lane keeps scalef's NaN)
static inline __m512 v_expf16(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r), r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 hi = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)),
                                      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f)));
    const __m512 j = _mm512_fmadd_ps(hi, u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    const __m512 p = _mm512_scalef_ps(j, n);
    const __mmask16 far = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192.0f), _CMP_GT_OQ);
    if (!far)
        return p;
    const __mmask16 up = _mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 edge = _mm512_mask_blend_ps(up, _mm512_setzero_ps(), _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(far, p, edge);
}
#endif

#if LANES_AVX2 && !defined(__AVX512F__)
// v_expf1 on 8 lanes at once (AVX2): the same operations in the same order; 2^n as two normal
// powers of two, 2^(n/2) then 2^(n - n/2) (the first product exact: one rounding, as the scalar's
// product or ldexpf), the lanes past |n| > 192 to inf or 0, a NaN lane j + n as the scalar's
static inline __m256 v_expf8(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r), r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 hi = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)),
                                      u, _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f)));
    const __m256 j = _mm256_fmadd_ps(hi, u, _mm256_fmadd_ps(_mm256_set1_ps(0x1.ffffecp-1f), b, _mm256_set1_ps(1.0f)));
    const __m256 far = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), n), _mm256_set1_ps(192.0f), _CMP_GT_OQ);
    const __m256 nan = _mm256_cmp_ps(n, n, _CMP_UNORD_Q);
    const __m256 ok = _mm256_andnot_ps(_mm256_or_ps(far, nan), _mm256_castsi256_ps(_mm256_set1_epi32(-1)));
    const __m256i e = _mm256_cvtps_epi32(_mm256_and_ps(n, ok)), e1 = _mm256_srai_epi32(e, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
    const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, e1), bias), 23));
    __m256 p = _mm256_mul_ps(_mm256_mul_ps(j, p1), p2);
    if (_mm256_movemask_ps(_mm256_or_ps(far, nan))) {
        const __m256 up = _mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_GT_OQ);
        p = _mm256_blendv_ps(p, _mm256_and_ps(up, _mm256_set1_ps(INFINITY)), far);
        p = _mm256_blendv_ps(p, _mm256_add_ps(j, n), nan);
    }
    return p;
}
#endif

// ggml_vec_swiglu_f32 (AVX-512 build) on elements i0..i1 of a row of n: o = x / (1 + e^-x) * g,
// ggml_v_expf on the row's 16-wide chunks (v_expf16, v_expf8 or v_expf1: the same bits), the C
// library's expf on its last n % 16
LANES_INLINE void lanes_swiglu(const float *x, const float *g, float *o, int64_t n, int64_t i0, int64_t i1) {
    const int64_t n_vec = n - n % 16;
    int64_t i = i0;
    // x > 20: e^-x < 2^-28, so 1 + e is 1 and the lane is x * g; e is not computed there (an
    // e^-x below 2^-126 comes out subnormal, which costs Intel cores a microcode assist a lane)
#if defined(__AVX512F__)
    for (; i + 16 <= i1 && i + 16 <= n_vec; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i), one = _mm512_set1_ps(1.0f);
        const __mmask16 big = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(20.0f), _CMP_GT_OQ);
        const __m512 e = v_expf16(_mm512_maskz_sub_ps((__mmask16)~big, _mm512_setzero_ps(), xv));
        const __m512 den = _mm512_mask_blend_ps(big, _mm512_add_ps(one, e), one);
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(xv, den), _mm512_loadu_ps(g + i)));
    }
#elif LANES_AVX2
    for (; i + 8 <= i1 && i + 8 <= n_vec; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i), one = _mm256_set1_ps(1.0f);
        const __m256 big = _mm256_cmp_ps(xv, _mm256_set1_ps(20.0f), _CMP_GT_OQ);
        const __m256 e = v_expf8(_mm256_andnot_ps(big, _mm256_sub_ps(_mm256_setzero_ps(), xv)));
        const __m256 den = _mm256_blendv_ps(_mm256_add_ps(one, e), one, big);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(xv, den), _mm256_loadu_ps(g + i)));
    }
#endif
    for (; i < i1; i++) {
        const float e = i < n_vec ? v_expf1(0.0f - x[i]) : expf(-x[i]);
        o[i] = (x[i] / (1.0f + e)) * g[i];
    }
}

// ---- one weight row against n <= LANES_NMAX quantized activation rows: out[j] = w . a[j]

typedef struct {                                       // one activation row as the quantizers above lay it out
    const int8_t *q;                                   // [K] the quants
    const float *d;                                    // [K / 32] (Q8_0) or [K / 256] (Q8_K) the block scales
    const int16_t *bs;                                 // [K / 16] Q8_K's sums per 16 (Q8_0: unused)
    const int32_t *aoff;                               // optional, Q8_0 with AVX-512: [K / 4] -off * the sums per 4
                                                       // for the weight's offset off (Q8_0 128, Q5_0 16, Q4_0 8)
} lanes_act;

// Q8_0 / Q5_0 / Q4_0 (qtype 0 / 1 / 2) against Q8_0 (ggml_vec_dot_q8_0_q8_0 and kin, x86; tinyBLAS
// has the same order): per output eight f32 lanes, lane l of block b the exact integer sum of
// elements 4l..4l+3; acc = fma(d_w * d_a, (float)lane, acc) block after block (the scale
// product rounded to f32: exact here, two f16 values), then hsum_float_8.
LANES_INLINE void lanes_dot_q80_n(const uint8_t *w, int64_t nb, int qtype, const lanes_act *a, const int n,
                                  float *out) {
    const int64_t bb = q80_bytes(qtype);
#if LANES_AVX2
    __m256 acc[LANES_NMAX];
    for (int j = 0; j < n; j++) acc[j] = _mm256_setzero_ps();
#if LANES_512
    if (a[0].aoff) {
        // the weight's quants made unsigned (w + off) for dpbusd, whose lanes start from the
        // activation's -off * sums per 4 (made once for all the rows of a product): the same integers
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bb;
            const __m256i wu = q80_unsigned(blk, qtype);
            const float s = f16_at(blk);
            for (int j = 0; j < n; j++) {
                const __m256i lanes = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(a[j].aoff + 8 * b)), wu,
                                                          _mm256_loadu_si256((const __m256i *)(a[j].q + 32 * b)));
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(s * a[j].d[b]), _mm256_cvtepi32_ps(lanes), acc[j]);
            }
        }
        for (int j = 0; j < n; j++) out[j] = hsum8_ps(acc[j]);
        return;
    }
#endif
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        const __m256i wv = q80_vec(blk, qtype), wa = _mm256_sign_epi8(wv, wv);
        const float s = f16_at(blk);
        for (int j = 0; j < n; j++) {
            const __m256i lanes = block_lanes_i(wa, wv, _mm256_loadu_si256((const __m256i *)(a[j].q + 32 * b)));
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(s * a[j].d[b]), _mm256_cvtepi32_ps(lanes), acc[j]);
        }
    }
    for (int j = 0; j < n; j++) out[j] = hsum8_ps(acc[j]);
#else
    float acc[LANES_NMAX][8];
    for (int j = 0; j < n; j++)
        for (int l = 0; l < 8; l++) acc[j][l] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int8_t wb[32];
        q80_ints(w + b * bb, qtype, wb);
        const float dw = f16_at(w + b * bb);
        for (int j = 0; j < n; j++) {
            const int8_t *ab = a[j].q + 32 * b;
            const float s = dw * a[j].d[b];
            for (int l = 0; l < 8; l++) {
                int32_t sum = 0;
                for (int e = 0; e < 4; e++) sum += (int32_t)wb[4 * l + e] * (int32_t)ab[4 * l + e];
                acc[j][l] = fmaf(s, (float)sum, acc[j][l]);
            }
        }
    }
    for (int j = 0; j < n; j++) out[j] = hsum8(acc[j]);
#endif
}

// Q6_K against Q8_K (ggml_vec_dot_q6_K_q8_K on AVX2, and ggml's tiled matmul from 8 columns):
// eight int32 lanes per super-block, lane l holding the unsigned quant (0..63) * its scale * a
// over elements 128j + 32k + 4l + e (j < 2, k < 4, e < 4), less 32 * the scales times the bsums
// of sub-blocks 2l, 2l+1. lanes (tiled 0): acc_l = fma(f32(d_a * d_w), f32(lane), acc_l),
// hsum_float_8. tiled: the lanes' integer total, to f32, times d_w (rounded), then
// acc = fma(that, d_a, acc).
LANES_INLINE void lanes_dot_q6k_n(const uint8_t *w, int64_t nb, int tiled, const lanes_act *a, const int n,
                                  float *out) {
#if LANES_512
    // 64 elements a vector (64c .. 64c + 63, c < 4), dpbusd per 4 of them (|sum| <= 4 * 63 * 127 <
    // 2^15, so dpwssd against the scale in the low 16 bits of a lane scales it exactly), lane i of
    // vector c is llama's lane i % 8: the halves folded give its eight lanes
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30), lo16 = _mm512_set1_epi32(0xFFFF);
    const __m512i shl = lanes_pair16(4, 2), shr = lanes_pair16(0, 2);
    __m512i pick[4];
    for (int c = 0; c < 4; c++)                        // lane i of vector c: sub-block 4c + i / 4
        pick[c] = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                    4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3);
    __m256 acc8[LANES_NMAX];
    float acc[LANES_NMAX];
    for (int j = 0; j < n; j++) {
        acc8[j] = _mm256_setzero_ps();
        acc[j] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q6_K_BYTES;
        const float dw = f16_at(blk + 208);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m512i s32 = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), lo16);
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        __m512i wv[4], sv[4];
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
            wv[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30));
            wv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                            _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30));
        }
        for (int c = 0; c < 4; c++) sv[c] = _mm512_permutexvar_epi32(pick[c], s32);
        for (int j = 0; j < n; j++) {
            const int8_t *y = a[j].q + 256 * b;
            __m512i t = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++)
                t = _mm512_dpwssd_epi32(t, _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[c],
                                                               _mm512_loadu_si512((const void *)(y + 64 * c))), sv[c]);
            const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a[j].bs + 16 * b)));
            const __m256i lanes = _mm256_sub_epi32(lanes_fold(t), _mm256_slli_epi32(corr, 5));
            if (tiled)
                acc[j] = fmaf((float)hsum_epi32(lanes) * dw, a[j].d[b], acc[j]);
            else
                acc8[j] = _mm256_fmadd_ps(_mm256_set1_ps(a[j].d[b] * dw), _mm256_cvtepi32_ps(lanes), acc8[j]);
        }
    }
    for (int j = 0; j < n; j++) out[j] = tiled ? acc[j] : hsum8_ps(acc8[j]);
#elif LANES_AVX2
    __m256 acc8[LANES_NMAX];
    float acc[LANES_NMAX];
    for (int j = 0; j < n; j++) {
        acc8[j] = _mm256_setzero_ps();
        acc[j] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q6_K_BYTES;
        const int8_t *sb = (const int8_t *)(blk + 192);
        const float dw = f16_at(blk + 208);
        __m256i q[8];
        q6k_vecs(blk, q);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)sb);
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8), bsc = _mm256_broadcastsi128_si256(sc8);
        for (int j = 0; j < n; j++) {
            const int8_t *ab = a[j].q + 256 * b;
            __m256i lanes = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {              // c = 4j + k: 32 elements, scales 2c (low half), 2c + 1
                const __m256i s16 = _mm256_srai_epi16(_mm256_shuffle_epi8(bsc, _mm256_set_m128i(
                    _mm_set1_epi16((short)(((2 * c + 1) << 8) | 0x80)), _mm_set1_epi16((short)((2 * c << 8) | 0x80)))), 8);
                const __m256i p = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i *)(ab + 32 * c)));
                lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(p, s16));
            }
            const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a[j].bs + 16 * b)));
            lanes = _mm256_sub_epi32(lanes, _mm256_slli_epi32(corr, 5));
            if (tiled)
                acc[j] = fmaf((float)hsum_epi32(lanes) * dw, a[j].d[b], acc[j]);
            else
                acc8[j] = _mm256_fmadd_ps(_mm256_set1_ps(a[j].d[b] * dw), _mm256_cvtepi32_ps(lanes), acc8[j]);
        }
    }
    for (int j = 0; j < n; j++) out[j] = tiled ? acc[j] : hsum8_ps(acc8[j]);
#else
    float acc[LANES_NMAX], acc8[LANES_NMAX][8];
    for (int j = 0; j < n; j++) {
        acc[j] = 0.0f;
        for (int l = 0; l < 8; l++) acc8[j][l] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q6_K_BYTES;
        const int8_t *sb = (const int8_t *)(blk + 192);
        const float dw = f16_at(blk + 208);
        uint8_t q[256];
        q6k_ints(blk, q);
        for (int j = 0; j < n; j++) {
            const int8_t *ab = a[j].q + 256 * b;
            const int16_t *bs = a[j].bs + 16 * b;
            int32_t lanes[8], total = 0;
            for (int l = 0; l < 8; l++) {
                int32_t lane = 0;
                for (int c = 0; c < 8; c++) {
                    const int base = 32 * c + 4 * l;
                    int32_t sum = 0;
                    for (int e = 0; e < 4; e++) sum += (int32_t)q[base + e] * (int32_t)ab[base + e];
                    lane += sum * (int32_t)sb[2 * c + (l >= 4)];
                }
                lanes[l] = lane - 32 * ((int32_t)sb[2 * l] * bs[2 * l] + (int32_t)sb[2 * l + 1] * bs[2 * l + 1]);
                total += lanes[l];
            }
            if (tiled) {
                acc[j] = fmaf((float)total * dw, a[j].d[b], acc[j]);
            } else {
                const float dd = a[j].d[b] * dw;
                for (int l = 0; l < 8; l++) acc8[j][l] = fmaf(dd, (float)lanes[l], acc8[j][l]);
            }
        }
    }
    for (int j = 0; j < n; j++) out[j] = tiled ? acc[j] : hsum8(acc8[j]);
#endif
}

// Q5_K against Q8_K (not repacked on x86): ggml_vec_dot_q5_K_q8_K's AVX2 order under 8 columns,
// ggml's tiled K-quant matmul from 8 (tiled). Per super-block eight int32 lanes, lane l the scaled
// sums over elements 32c + 4l + e (sub-block c, e < 4) of the unsigned 5-bit quants. lanes:
// acc_l = fma(f32(d_a * d_w), f32(lane), acc_l), hsum_float_8, the mins apart in a scalar,
// summs = fma(-(d_a * dmin_w), f32(s2), summs) with s2 the mins times the activation's sums per
// 32 (gcc fuses ggml's summs += dmin * s2); out = hsum + summs. tiled: r = fma(-dmin_w, f32(s2),
// f32(s1) * d_w) with s1 the lanes' total, acc = fma(r, d_a, acc). The same bits as
// quant/k_quants.dot_llama, which tests/test_quant.py holds to b11434's own mul_mat.
LANES_INLINE void lanes_dot_q5k_n(const uint8_t *w, int64_t nb, int tiled, const lanes_act *a, const int n,
                                  float *out) {
    float acc[LANES_NMAX], summs[LANES_NMAX];
    for (int j = 0; j < n; j++) acc[j] = summs[j] = 0.0f;
#if LANES_512
    // as Q6_K's: vector c holds sub-blocks 2c, 2c + 1 (elements 64c .. 64c + 63), lane i of it is
    // llama's lane i % 8 (|sum| <= 4 * 31 * 127 < 2^15: dpwssd scales it exactly)
    const __m512i sixteen = _mm512_set1_epi8(16);
    __m512i pick[4];
    for (int c = 0; c < 4; c++) pick[c] = lanes_pick_halves(c);
    __m256 acc8[LANES_NMAX];
    for (int j = 0; j < n; j++) acc8[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q5_K_BYTES;
        const float dw = f16_at(blk), dmw = f16_at(blk + 2);
        const __m128i scm = k4_scales_v(blk + 4);
        const __m512i s32 = _mm512_cvtepu8_epi32(scm);
        const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scm, scm));    // each min twice
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        __m512i wv[4], sv[4];
        for (int c = 0; c < 4; c++) {
            const __mmask64 hi = _mm512_test_epi8_mask(qh, lanes_pair8(1 << (2 * c), 1 << (2 * c + 1)));
            const __m512i q = k4_nibbles64(blk + 48, c);
            wv[c] = _mm512_mask_add_epi8(q, hi, q, sixteen);
            sv[c] = _mm512_permutexvar_epi32(pick[c], s32);
        }
        for (int j = 0; j < n; j++) {
            const int8_t *y = a[j].q + 256 * b;
            __m512i t = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++)
                t = _mm512_dpwssd_epi32(t, _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[c],
                                                               _mm512_loadu_si512((const void *)(y + 64 * c))), sv[c]);
            const __m256i lanes = lanes_fold(t);
            const int32_t s2 = hsum_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a[j].bs + 16 * b)), mn16));
            const float da = a[j].d[b];
            if (tiled) {
                acc[j] = fmaf(fmaf(-dmw, (float)s2, (float)hsum_epi32(lanes) * dw), da, acc[j]);
            } else {
                acc8[j] = _mm256_fmadd_ps(_mm256_set1_ps(da * dw), _mm256_cvtepi32_ps(lanes), acc8[j]);
                summs[j] = fmaf(-(da * dmw), (float)s2, summs[j]);
            }
        }
    }
    for (int j = 0; j < n; j++) out[j] = tiled ? acc[j] : hsum8_ps(acc8[j]) + summs[j];
#elif LANES_AVX2
    __m256 acc8[LANES_NMAX];
    for (int j = 0; j < n; j++) acc8[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q5_K_BYTES;
        const __m128i scm = k4_scales_v(blk + 4);
        const __m256i bscm = _mm256_broadcastsi128_si256(scm);
        const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scm, scm));    // each min twice
        const float dw = f16_at(blk), dmw = f16_at(blk + 2);
        __m256i q[8];
        q5k_vecs(blk, q);
        for (int j = 0; j < n; j++) {
            const int8_t *ab = a[j].q + 256 * b;
            __m256i lanes = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i p = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i *)(ab + 32 * c)));
                lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(p, lanes_bcast_u8(bscm, c)));
            }
            const int32_t s2 = hsum_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a[j].bs + 16 * b)), mn16));
            const float da = a[j].d[b];
            if (tiled) {
                acc[j] = fmaf(fmaf(-dmw, (float)s2, (float)hsum_epi32(lanes) * dw), da, acc[j]);
            } else {
                acc8[j] = _mm256_fmadd_ps(_mm256_set1_ps(da * dw), _mm256_cvtepi32_ps(lanes), acc8[j]);
                summs[j] = fmaf(-(da * dmw), (float)s2, summs[j]);
            }
        }
    }
    for (int j = 0; j < n; j++) out[j] = tiled ? acc[j] : hsum8_ps(acc8[j]) + summs[j];
#else
    float acc8[LANES_NMAX][8];
    for (int j = 0; j < n; j++)
        for (int l = 0; l < 8; l++) acc8[j][l] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q5_K_BYTES;
        int32_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const float dw = f16_at(blk), dmw = f16_at(blk + 2);
        uint8_t q[256];
        q5k_ints(blk, q);
        for (int j = 0; j < n; j++) {
            const int8_t *ab = a[j].q + 256 * b;
            const int16_t *bs = a[j].bs + 16 * b;
            int32_t lanes[8] = {0}, s1 = 0, s2 = 0;
            for (int c = 0; c < 8; c++) {
                for (int l = 0; l < 8; l++) {
                    const int base = 32 * c + 4 * l;
                    const int32_t part = (int32_t)q[base] * ab[base] + (int32_t)q[base + 1] * ab[base + 1]
                                         + (int32_t)q[base + 2] * ab[base + 2] + (int32_t)q[base + 3] * ab[base + 3];
                    lanes[l] += part * sc[c];
                }
                s2 += mn[c] * ((int32_t)bs[2 * c] + (int32_t)bs[2 * c + 1]);
            }
            for (int l = 0; l < 8; l++) s1 += lanes[l];
            const float da = a[j].d[b];
            if (tiled) {
                acc[j] = fmaf(fmaf(-dmw, (float)s2, (float)s1 * dw), da, acc[j]);
            } else {
                const float dd = da * dw;
                for (int l = 0; l < 8; l++) acc8[j][l] = fmaf(dd, (float)lanes[l], acc8[j][l]);
                summs[j] = fmaf(-(da * dmw), (float)s2, summs[j]);
            }
        }
    }
    for (int j = 0; j < n; j++) out[j] = tiled ? acc[j] : hsum8(acc8[j]) + summs[j];
#endif
}

// Q4_K against Q8_K as ggml_gemv / ggml_gemm_q4_K_8x8_q8_K (the weight repacked at load): per 64
// elements (two sub-blocks) sumi = sum of sc * (q . a), summ = sum of m * (a's sum over the
// sub-block). gemm rows: acc = fma(f32(sumi), f32(d_a * d_w), acc) and the same for the mins
// with d_a * dmin, once per 64; gemv rows (gemm 0; every row of ggml_mul_mat_id): once per
// super-block, the four 64s' int32 sums first. out = acc - acc_min.
LANES_INLINE void lanes_dot_q4k_n(const uint8_t *w, int64_t nb, int gemm, const lanes_act *a, const int n,
                                  float *out) {
    float acc[LANES_NMAX], acc_min[LANES_NMAX];
    for (int j = 0; j < n; j++) acc[j] = acc_min[j] = 0.0f;
#if LANES_AVX2
    if (!gemm) {
        // the gemv needs each super-block's two integer totals only (any integer order): per row
        // the scaled quants times the activations in 8 int32 lanes and the mins times the sums per
        // 16 in 8 more, two super-blocks' four such vectors reduced at once (one hadd tree),
        // converted together, then the two chains of fmas in order
#if LANES_512
        __m512i pick[4];                               // lane i of vector c: sub-block 2c + i / 8
        for (int c = 0; c < 4; c++) pick[c] = lanes_pick_halves(c);
#endif
        for (int64_t b0 = 0; b0 < nb; b0 += 2) {
            const int nbp = nb - b0 < 2 ? 1 : 2;
            __m256i tm[LANES_NMAX][4];                 // per row: t, m of super-block b0, then of b0 + 1
            uint32_t dm[2] = {0, 0};                   // d, dmin of each (f16 pairs)
            for (int i = 0; i < 2; i++) {
                if (i == nbp) {
                    for (int j = 0; j < n; j++) tm[j][2 * i] = tm[j][2 * i + 1] = _mm256_setzero_si256();
                    break;
                }
                const uint8_t *blk = w + (b0 + i) * Q4_K_BYTES;
                memcpy(dm + i, blk, 4);
                const __m128i scm = k4_scales_v(blk + 4);
                const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scm, scm));    // each min twice
#if LANES_512
                // 64 elements a vector (as Q5_K's), dpbusd then dpwssd with the scales
                const __m512i s32 = _mm512_cvtepu8_epi32(scm);
                __m512i wv[4], sv[4];
                for (int c = 0; c < 4; c++) {
                    wv[c] = k4_nibbles64(blk + 16, c);
                    sv[c] = _mm512_permutexvar_epi32(pick[c], s32);
                }
                for (int j = 0; j < n; j++) {
                    const int8_t *y = a[j].q + 256 * (b0 + i);
                    __m512i v = _mm512_setzero_si512();
                    for (int c = 0; c < 4; c++)
                        v = _mm512_dpwssd_epi32(v, _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[c],
                                                                       _mm512_loadu_si512((const void *)(y + 64 * c))), sv[c]);
                    tm[j][2 * i] = lanes_fold(v);
                    tm[j][2 * i + 1] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a[j].bs + 16 * (b0 + i))), mn16);
                }
#else
                // sub-block s's 32 quants a vector, maddubs then madd with its scale
                const __m256i bscm = _mm256_broadcastsi128_si256(scm), lo4 = _mm256_set1_epi8(0xF);
                __m256i wq[8];
                for (int c = 0; c < 4; c++) {
                    const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                    wq[2 * c] = _mm256_and_si256(qs, lo4);
                    wq[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), lo4);
                }
                for (int j = 0; j < n; j++) {
                    const int8_t *y = a[j].q + 256 * (b0 + i);
                    __m256i v = _mm256_setzero_si256();
                    for (int s = 0; s < 8; s++)
                        v = _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_maddubs_epi16(wq[s], _mm256_loadu_si256(
                                                                      (const __m256i *)(y + 32 * s))), lanes_bcast_u8(bscm, s)));
                    tm[j][2 * i] = v;
                    tm[j][2 * i + 1] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a[j].bs + 16 * (b0 + i))), mn16);
                }
#endif
            }
            // [d0, dmin0, d1, dmin1]
            const __m128 dd = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128((int)dm[0]), _mm_cvtsi32_si128((int)dm[1])));
            for (int j = 0; j < n; j++) {
                const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(tm[j][0], tm[j][1]), _mm256_hadd_epi32(tm[j][2], tm[j][3]));
                float f[4], p[4];                      // [si0, sm0, si1, sm1] and [da0 * d0, da0 * dmin0, da1 * d1, da1 * dmin1]
                _mm_storeu_ps(f, _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))));
                const float da0 = a[j].d[b0], da1 = nbp == 2 ? a[j].d[b0 + 1] : 0.0f;
                _mm_storeu_ps(p, _mm_mul_ps(_mm_setr_ps(da0, da0, da1, da1), dd));
                acc[j] = fmaf(f[0], p[0], acc[j]);
                acc_min[j] = fmaf(f[1], p[1], acc_min[j]);
                if (nbp == 2) {
                    acc[j] = fmaf(f[2], p[2], acc[j]);
                    acc_min[j] = fmaf(f[3], p[3], acc_min[j]);
                }
            }
        }
        for (int j = 0; j < n; j++) out[j] = acc[j] - acc_min[j];
        return;
    }
#endif
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q4_K_BYTES;
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        int32_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
#if LANES_AVX2
        __m256i q[8], s16[8];
        const __m256i lo4 = _mm256_set1_epi8(0xF);
        for (int c = 0; c < 4; c++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            q[2 * c] = _mm256_and_si256(qs, lo4);
            q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), lo4);
        }
        for (int s = 0; s < 8; s++) s16[s] = _mm256_set1_epi16((int16_t)sc[s]);
        int16_t mn2[16];                               // each min twice: madd with the bsums gives min * (bs + bs)
        for (int s = 0; s < 8; s++) mn2[2 * s] = mn2[2 * s + 1] = (int16_t)mn[s];
        const __m256i mn16 = _mm256_loadu_si256((const __m256i *)mn2);
#else
        uint8_t q[256];
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                q[64 * c + l] = blk[16 + 32 * c + l] & 0xF;
                q[64 * c + 32 + l] = blk[16 + 32 * c + l] >> 4;
            }
#endif
        for (int j = 0; j < n; j++) {
            const int8_t *ab = a[j].q + 256 * b;
            const int16_t *bs = a[j].bs + 16 * b;
            const float dd = a[j].d[b] * d, dm = a[j].d[b] * dmin;
            int32_t si_all = 0, sm_all = 0;
#if LANES_AVX2
            int32_t sums[4], summs[4];                 // the four 64s' integer sums, reduced together
            {
                __m256i v[4];
                for (int c = 0; c < 4; c++) {
                    const __m256i a0 = _mm256_loadu_si256((const __m256i *)(ab + 64 * c));
                    const __m256i a1 = _mm256_loadu_si256((const __m256i *)(ab + 64 * c + 32));
#if LANES_512
                    v[c] = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), _mm256_maddubs_epi16(q[2 * c], a0),
                                                                   s16[2 * c]),
                                               _mm256_maddubs_epi16(q[2 * c + 1], a1), s16[2 * c + 1]);
#else
                    v[c] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q[2 * c], a0), s16[2 * c]),
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(q[2 * c + 1], a1), s16[2 * c + 1]));
#endif
                }
                const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                _mm_storeu_si128((__m128i *)sums, _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
                // the mins' sums: lane s = mn[s] * (bs[2s] + bs[2s+1]); 64 c is lanes 2c, 2c + 1
                const __m256i mv = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bs), mn16);
                const __m256i mh = _mm256_permute4x64_epi64(_mm256_hadd_epi32(mv, mv), 0x08);
                _mm_storeu_si128((__m128i *)summs, _mm256_castsi256_si128(mh));
            }
#endif
            for (int c = 0; c < 4; c++) {
#if LANES_AVX2
                const int32_t sumi = sums[c], summ = summs[c];
#else
                int32_t sumi = 0;
                for (int h = 0; h < 2; h++) {
                    int32_t sum = 0;
                    for (int e = 0; e < 32; e++) sum += (int32_t)q[64 * c + 32 * h + e] * (int32_t)ab[64 * c + 32 * h + e];
                    sumi += sum * sc[2 * c + h];
                }
                const int32_t summ = mn[2 * c] * ((int32_t)bs[4 * c] + bs[4 * c + 1])
                                   + mn[2 * c + 1] * ((int32_t)bs[4 * c + 2] + bs[4 * c + 3]);
#endif
                if (gemm) {
                    acc[j] = fmaf((float)sumi, dd, acc[j]);
                    acc_min[j] = fmaf((float)summ, dm, acc_min[j]);
                } else {
                    si_all += sumi;
                    sm_all += summ;
                }
            }
            if (!gemm) {
                acc[j] = fmaf((float)si_all, dd, acc[j]);
                acc_min[j] = fmaf((float)sm_all, dm, acc_min[j]);
            }
        }
    }
    for (int j = 0; j < n; j++) out[j] = acc[j] - acc_min[j];
}

// The dots with n a constant (each row loop unrolled): the functions the two files call.
// mode: the Q8_0 family's qtype, Q6_K's and Q5_K's tiled, Q4_K's gemm.
typedef void (*lanes_dot_fn)(const uint8_t *w, int64_t nb, int mode, const lanes_act *a, int n, float *out);

#define LANES_DOT_BY_N(name, kern)                                                                     \
    static void name(const uint8_t *w, int64_t nb, int mode, const lanes_act *a, int n, float *out) {  \
        switch (n) {                                                                                   \
        case 1: kern(w, nb, mode, a, 1, out); break;                                                   \
        case 2: kern(w, nb, mode, a, 2, out); break;                                                   \
        case 3: kern(w, nb, mode, a, 3, out); break;                                                   \
        default: kern(w, nb, mode, a, 4, out); break;                                                  \
        }                                                                                              \
    }

LANES_DOT_BY_N(lanes_dot_q80, lanes_dot_q80_n)
LANES_DOT_BY_N(lanes_dot_q6k, lanes_dot_q6k_n)
LANES_DOT_BY_N(lanes_dot_q5k, lanes_dot_q5k_n)
LANES_DOT_BY_N(lanes_dot_q4k, lanes_dot_q4k_n)
#undef LANES_DOT_BY_N

#endif
