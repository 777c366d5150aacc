// CPU kernels of the numpy backend (bloomery/engine/cpu_kernels.py compiles this once per
// machine with the system's C compiler and loads it through ctypes).
//
// q8_lanes: out[t][n] = x_t . w_n for a Q8_0-family weight (Q8_0, Q5_0, Q4_0 stored as int8
// quants [N, K] and f32 block scales [N, K/32]) against Q8_0 activations, in the float order of
// llama.cpp's CPU kernels (tinyBLAS and ggml_vec_dot_q8_0_q8_0 agree on it on AVX2): per output
// eight f32 lanes, lane l of block b holding the exact integer sum of elements 4l..4l+3; each
// block does acc = fma(d_w * d_a, (float)lane, acc), the scale product rounded to f32 (exact
// here: two f16 values); then hsum_float_8. The integer sums are exact whatever the
// instructions, and the float steps are spelled out, so the AVX2 path and the portable one give
// the same bits. Built with -ffp-contract=off so the compiler adds no fma of its own.
//
// Legend: N = weight rows, K = row length, B = K / 32 blocks, T = activation rows.
#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES_AVX2 1
#else
#define LANES_AVX2 0
#endif

int lanes_isa(void) { return LANES_AVX2; }

static inline float hsum8(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#if LANES_AVX2
static inline float hsum8_ps(__m256 v) {
    float a[8];
    _mm256_storeu_ps(a, v);
    return hsum8(a);
}

// the 8 lane sums of one block as f32: |w| * (a with w's sign), pairs to int16 (no
// saturation: |w| <= 127 here, |a| <= 127), pairs again to int32
static inline __m256 block_lanes(__m256i w_abs, __m256i w, __m256i a, __m256i ones) {
    __m256i s = _mm256_sign_epi8(a, w);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, s), ones));
}
#endif

// Rows n0..n1 of the weight against all T activation rows; out[t * ldo + n].
void q8_lanes(const int8_t *w, const float *dw, int64_t n0, int64_t n1, int64_t n_blocks,
              const int8_t *a, const float *da, int64_t t, float *out, int64_t ldo) {
    const int64_t k = n_blocks * 32;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wr = w + n * k;
        const float *dwr = dw + n * n_blocks;
        int64_t r = 0;
#if LANES_AVX2
        const __m256i ones = _mm256_set1_epi16(1);
        for (; r + 4 <= t; r += 4) {            // four activation rows share each weight load
            __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
            const int8_t *a0 = a + r * k, *a1 = a0 + k, *a2 = a1 + k, *a3 = a2 + k;
            const float *d0 = da + r * n_blocks, *d1 = d0 + n_blocks, *d2 = d1 + n_blocks, *d3 = d2 + n_blocks;
            for (int64_t b = 0; b < n_blocks; b++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + 32 * b));
                __m256i wa = _mm256_sign_epi8(wv, wv);
                float s = dwr[b];
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s * d0[b]),
                                       block_lanes(wa, wv, _mm256_loadu_si256((const __m256i *)(a0 + 32 * b)), ones), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s * d1[b]),
                                       block_lanes(wa, wv, _mm256_loadu_si256((const __m256i *)(a1 + 32 * b)), ones), acc1);
                acc2 = _mm256_fmadd_ps(_mm256_set1_ps(s * d2[b]),
                                       block_lanes(wa, wv, _mm256_loadu_si256((const __m256i *)(a2 + 32 * b)), ones), acc2);
                acc3 = _mm256_fmadd_ps(_mm256_set1_ps(s * d3[b]),
                                       block_lanes(wa, wv, _mm256_loadu_si256((const __m256i *)(a3 + 32 * b)), ones), acc3);
            }
            out[(r + 0) * ldo + n] = hsum8_ps(acc0);
            out[(r + 1) * ldo + n] = hsum8_ps(acc1);
            out[(r + 2) * ldo + n] = hsum8_ps(acc2);
            out[(r + 3) * ldo + n] = hsum8_ps(acc3);
        }
        for (; r < t; r++) {
            __m256 acc = _mm256_setzero_ps();
            const int8_t *ar = a + r * k;
            const float *dar = da + r * n_blocks;
            for (int64_t b = 0; b < n_blocks; b++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + 32 * b));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dwr[b] * dar[b]),
                                      block_lanes(_mm256_sign_epi8(wv, wv), wv,
                                                  _mm256_loadu_si256((const __m256i *)(ar + 32 * b)), ones), acc);
            }
            out[r * ldo + n] = hsum8_ps(acc);
        }
#else
        for (; r < t; r++) {
            float acc[8] = {0};
            const int8_t *ar = a + r * k;
            const float *dar = da + r * n_blocks;
            for (int64_t b = 0; b < n_blocks; b++) {
                const int8_t *wb = wr + 32 * b, *ab = ar + 32 * b;
                float s = dwr[b] * dar[b];
                for (int l = 0; l < 8; l++) {
                    int32_t sum = 0;
                    for (int e = 0; e < 4; e++)
                        sum += (int32_t)wb[4 * l + e] * (int32_t)ab[4 * l + e];
                    acc[l] = fmaf(s, (float)sum, acc[l]);
                }
            }
            out[r * ldo + n] = hsum8(acc);
        }
#endif
    }
}

// ---- flash attention over the F16 KV cache, as ggml_compute_forward_flash_attn_ext_f16 -------
// bloomery/engine/kv_cache.py describes both paths (and is their numpy form). One call does the
// query rows r0..r1 of q [T, H, Dh] (row r = t * H + head); row t sees positions 0..pos0+t of
// k, v [L, Hkv, Dh] (F16), head h reads KV head h / (H / Hkv). out [T, H, Dh] f32.
//
// The numpy form emulates each f32 fma by a float64 product and sum (two roundings in about
// 2^-29 of the inexact cases); these are true fmas, as llama.cpp's.

typedef _Float16 f16;

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
    return ldexpf(j, (int)n);
}

// _mm512_reduce_add_ps as gcc's macro: halves 8, 4, 2, 1
static inline float reduce_add16(const float *y) {
    float v[16];
    for (int i = 0; i < 16; i++) v[i] = y[i];
    for (int half = 8; half >= 1; half /= 2)
        for (int i = 0; i < half; i++) v[i] = v[i] + v[i + half];
    return v[0];
}

// ggml_vec_dot_f16 on AVX-512: exact F16 products summed into 4 x 16 lanes per 64-step, the
// accumulators (0 + 2) + (1 + 3), the lanes by halves, a tail past the last whole 64 in double
static inline float dot_f16(const float *q16, const f16 *k, int64_t dh) {
    int64_t n_main = dh - dh % 64;
    double s;
    if (n_main == 0) {
        s = 0.0;
        for (int64_t i = 0; i < dh; i++) s += (double)(q16[i] * (float)k[i]);
        return (float)s;
    }
    float acc[64];
    for (int i = 0; i < 64; i++) acc[i] = q16[i] * (float)k[i];
    for (int64_t c = 64; c < n_main; c += 64)
        for (int i = 0; i < 64; i++) acc[i] = acc[i] + q16[c + i] * (float)k[c + i];
    float lanes[16];
    for (int i = 0; i < 16; i++) lanes[i] = (acc[i] + acc[32 + i]) + (acc[16 + i] + acc[48 + i]);
    s = (double)reduce_add16(lanes);
    for (int64_t i = n_main; i < dh; i++) s += (double)(q16[i] * (float)k[i]);
    return (float)s;
}

// the one-chunk path (fewer than 64 query rows): F16 Q, position by position, F16 accumulator
void attn_f16(const float *q, const f16 *k, const f16 *v, int64_t n_head, int64_t n_head_kv, int64_t dh,
              int64_t pos0, float scale, float *out, int64_t r0, int64_t r1) {
    const int64_t g = n_head / n_head_kv, kv_row = n_head_kv * dh;
    float q16[1024];
    f16 acc[1024];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r / n_head, h = r % n_head, kh = h / g;
        const float *qr = q + r * dh;
        for (int64_t d = 0; d < dh; d++) q16[d] = (float)(f16)qr[d];
        for (int64_t d = 0; d < dh; d++) acc[d] = (f16)0.0f;
        float m = -INFINITY, s_run = 0.0f;
        const int64_t n_see = pos0 + t + 1;
        for (int64_t l = 0; l < n_see; l++) {
            const f16 *kl = k + l * kv_row + kh * dh, *vl = v + l * kv_row + kh * dh;
            float s = dot_f16(q16, kl, dh) * scale;
            float ms = 1.0f, vs = 1.0f;
            if (s > m) {                           // a new max: rescale what came before
                ms = expf(m - s);
                for (int64_t d = 0; d < dh; d++) acc[d] = (f16)((float)acc[d] * ms);
                s_run = fmaf(s_run, ms, vs);
                m = s;
            } else {
                vs = expf(s - m);
                s_run = s_run + vs;
            }
            for (int64_t d = 0; d < dh; d++) acc[d] = (f16)fmaf((float)vl[d], vs, (float)acc[d]);
        }
        const float inv = s_run == 0.0f ? 0.0f : 1.0f / s_run;
        float *o = out + r * dh;
        for (int64_t d = 0; d < dh; d++) o[d] = (float)acc[d] * inv;
    }
}

// the tiled path (64 query rows or more): F32, online softmax over tiles of 64 positions
void attn_f32(const float *q, const f16 *k, const f16 *v, int64_t n_head, int64_t n_head_kv, int64_t dh,
              int64_t pos0, int64_t n_kv, float scale, float *out, int64_t r0, int64_t r1, float *kq) {
    const int64_t g = n_head / n_head_kv, kv_row = n_head_kv * dh;
    float acc[1024], y[64];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r / n_head, h = r % n_head, kh = h / g;
        const float *qr = q + r * dh;
        const int64_t n_see = pos0 + t + 1;
        int64_t l = 0;
        for (; l + 8 <= n_kv; l += 8) {           // simd_gemm: one fma chain over Dh from 0 per
            float s[8] = {0};                      // position; eight positions' chains side by side
            const f16 *kl = k + l * kv_row + kh * dh;
            for (int64_t d = 0; d < dh; d++)
                for (int i = 0; i < 8; i++) s[i] = fmaf(qr[d], (float)kl[i * kv_row + d], s[i]);
            for (int i = 0; i < 8; i++) kq[l + i] = l + i < n_see ? s[i] * scale : -INFINITY;
        }
        for (; l < n_kv; l++) {
            const f16 *kl = k + l * kv_row + kh * dh;
            float s = 0.0f;
            for (int64_t d = 0; d < dh; d++) s = fmaf(qr[d], (float)kl[d], s);
            kq[l] = l < n_see ? s * scale : -INFINITY;
        }
        for (int64_t d = 0; d < dh; d++) acc[d] = 0.0f;
        float m_run = -INFINITY, s_run = 0.0f;
        for (int64_t c = 0; c < n_kv; c += 64) {
            const int64_t n_tile = n_kv - c < 64 ? n_kv - c : 64;
            float tmax = -INFINITY;
            for (int64_t i = 0; i < n_tile; i++) tmax = kq[c + i] > tmax ? kq[c + i] : tmax;
            if (tmax == -INFINITY) continue;
            const float m_new = m_run > tmax ? m_run : tmax;
            if (m_new > m_run) {
                const float ms = expf(m_run - m_new);
                for (int64_t d = 0; d < dh; d++) acc[d] = acc[d] * ms;
                s_run = s_run * ms;
            }
            m_run = m_new;
            for (int i = 0; i < 64; i++) y[i] = v_expf1((i < n_tile ? kq[c + i] : -INFINITY) - m_new);
            double total = 0.0;                    // ggml_vec_soft_max_f32: chunk sums in double
            for (int i = 0; i < 64; i += 16) total += (double)reduce_add16(y + i);
            s_run = (float)((double)s_run + total);
            for (int64_t j = 0; j < n_tile; j++) {  // simd_gemm: VKQ += KQ[j] * V[j], in order
                const f16 *vl = v + (c + j) * kv_row + kh * dh;
                for (int64_t d = 0; d < dh; d++) acc[d] = fmaf(y[j], (float)vl[d], acc[d]);
            }
        }
        const float inv = s_run == 0.0f ? 0.0f : 1.0f / s_run;
        float *o = out + r * dh;
        for (int64_t d = 0; d < dh; d++) o[d] = acc[d] * inv;
    }
}

// ---- K-quants against Q8_K activations (256 per super-block, bsums per 16) ---------------
// a [T, K] int8 (|a| <= 127), da [T, K/256] f32, bsums [T, K/16] int32.

// Q6_K: q [N, K] uint8 (the unsigned quants, 0..63), sc [N, K/16] int8, d [N, K/256] f32.
// tiled (ggml's tiled mul_mat, 8+ rows): per super-block the exact sum of sc * ((q - 32) . a)
// over its 16 sub-blocks, to f32, times d_w (rounded), then acc = fma(that, d_a, acc).
// lanes (ggml_vec_dot_q6_K_q8_K, AVX2): eight int32 lanes, lane l holding q * scale * a of
// elements 128j + 32k + 4l + e (j < 2, k < 4, e < 4), less 32 * the scales times the bsums of
// sub-blocks 2l, 2l+1; to f32; acc_l = fma(f32(d_a * d_w), lane, acc_l); hsum_float_8.
// Both from the same eight lanes: the tiled sum is their integer total less 32 * sum(sc * bsums).
static inline void q6k_lanes(const uint8_t *qb, const int8_t *ab, const int8_t *sb, int32_t lanes[8]) {
#if LANES_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {                  // c = 4j + k: 32 elements, scales 2c, 2c + 1
        __m256i qv = _mm256_loadu_si256((const __m256i *)(qb + 32 * c));
        __m256i av = _mm256_loadu_si256((const __m256i *)(ab + 32 * c));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qv, av), ones);   // lane l: 4l..4l+3
        __m256i s = _mm256_setr_epi32(sb[2 * c], sb[2 * c], sb[2 * c], sb[2 * c],
                                      sb[2 * c + 1], sb[2 * c + 1], sb[2 * c + 1], sb[2 * c + 1]);
        acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, s));
    }
    _mm256_storeu_si256((__m256i *)lanes, acc);
#else
    for (int l = 0; l < 8; l++) {
        int32_t lane = 0;
        for (int c = 0; c < 8; c++) {
            const int base = 32 * c + 4 * l;
            int32_t sum = 0;
            for (int e = 0; e < 4; e++) sum += (int32_t)qb[base + e] * (int32_t)ab[base + e];
            lane += sum * (int32_t)sb[2 * c + (l >= 4)];
        }
        lanes[l] = lane;
    }
#endif
}

void q6k_dot(const uint8_t *q, const int8_t *sc, const float *d, int64_t n0, int64_t n1, int64_t n_super,
             const int8_t *a, const float *da, const int32_t *bsums, int64_t t, int tiled,
             float *out, int64_t ldo) {
    const int64_t k = n_super * 256;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *qr = q + n * k;
        const int8_t *scr = sc + n * n_super * 16;
        const float *dr = d + n * n_super;
        for (int64_t r = 0; r < t; r++) {
            const int8_t *ar = a + r * k;
            const float *dar = da + r * n_super;
            const int32_t *bsr = bsums + r * n_super * 16;
            float acc8[8] = {0}, acc = 0.0f;
            for (int64_t b = 0; b < n_super; b++) {
                const int8_t *sb = scr + 16 * b;
                const int32_t *bs = bsr + 16 * b;
                int32_t lanes[8];
                q6k_lanes(qr + 256 * b, ar + 256 * b, sb, lanes);
                if (tiled) {
                    int32_t total = 0;
                    for (int l = 0; l < 8; l++)
                        total += lanes[l] - 32 * ((int32_t)sb[2 * l] * bs[2 * l] + (int32_t)sb[2 * l + 1] * bs[2 * l + 1]);
                    acc = fmaf((float)total * dr[b], dar[b], acc);
                } else {
                    const float dd = dar[b] * dr[b];
                    for (int l = 0; l < 8; l++) {
                        int32_t lane = lanes[l] - 32 * ((int32_t)sb[2 * l] * bs[2 * l] + (int32_t)sb[2 * l + 1] * bs[2 * l + 1]);
                        acc8[l] = fmaf(dd, (float)lane, acc8[l]);
                    }
                }
            }
            out[r * ldo + n] = tiled ? acc : hsum8(acc8);
        }
    }
}

// the exact sum of 32 unsigned (<= 63) times signed int8 products
static inline int32_t dot32_u8_s8(const uint8_t *q, const int8_t *a) {
#if LANES_AVX2
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)q),
                                                       _mm256_loadu_si256((const __m256i *)a)), _mm256_set1_epi16(1));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
#else
    int32_t sum = 0;
    for (int e = 0; e < 32; e++) sum += (int32_t)q[e] * (int32_t)a[e];
    return sum;
#endif
}

// Q4_K as ggml_gemm / ggml_gemv_q4_K_8x8_q8_K (the repacked weight): q [N, K] uint8 (0..15),
// sc and m [N, K/32] uint8 (6-bit scales and mins), d and dmin [N, K/256] f32. Per 64 elements
// (two sub-blocks) sumi = sum of sc * (q . a), summ = sum of m * (a's sum over the sub-block);
// rows r < t_gemm (the gemm's) do acc = fma(f32(sumi), f32(d_a * d_w), acc) and the same for
// the mins with d_a * dmin, once per 64; the other rows (the gemv's) once per super-block, the
// four 64s' int32 sums first. out = acc - acc_min.
void q4k_dot(const uint8_t *q, const uint8_t *sc, const uint8_t *m, const float *d, const float *dmin,
             int64_t n0, int64_t n1, int64_t n_super, const int8_t *a, const float *da, const int32_t *bsums,
             int64_t t, int64_t t_gemm, float *out, int64_t ldo) {
    const int64_t k = n_super * 256;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *qr = q + n * k, *scr = sc + n * n_super * 8, *mr = m + n * n_super * 8;
        const float *dr = d + n * n_super, *dmr = dmin + n * n_super;
        for (int64_t r = 0; r < t; r++) {
            const int8_t *ar = a + r * k;
            const float *dar = da + r * n_super;
            const int32_t *bsr = bsums + r * n_super * 16;
            float acc = 0.0f, acc_min = 0.0f;
            for (int64_t b = 0; b < n_super; b++) {
                const float dd = dar[b] * dr[b], dm = dar[b] * dmr[b];
                int32_t si_all = 0, sm_all = 0;
                for (int c = 0; c < 4; c++) {
                    int32_t sumi = 0, summ = 0;
                    for (int h = 0; h < 2; h++) {
                        const int s = 2 * c + h;
                        const uint8_t *qs = qr + 256 * b + 32 * s;
                        const int8_t *as = ar + 256 * b + 32 * s;
                        int32_t sum = dot32_u8_s8(qs, as);
                        sumi += sum * (int32_t)scr[8 * b + s];
                        const int32_t *bs = bsr + 16 * b + 2 * s;
                        summ += (int32_t)mr[8 * b + s] * (bs[0] + bs[1]);
                    }
                    if (r < t_gemm) {
                        acc = fmaf((float)sumi, dd, acc);
                        acc_min = fmaf((float)summ, dm, acc_min);
                    } else {
                        si_all += sumi;
                        sm_all += summ;
                    }
                }
                if (r >= t_gemm) {
                    acc = fmaf((float)si_all, dd, acc);
                    acc_min = fmaf((float)sm_all, dm, acc_min);
                }
            }
            out[r * ldo + n] = acc - acc_min;
        }
    }
}

// ---- ggml_vec_swiglu_f32 (AVX-512 build): x / (1 + e^-x) * g, ggml_v_expf on each row's
// 16-wide chunks and the C library's expf on the tail. Rows r0..r1 of [rows, n].
void swiglu(const float *x, const float *g, float *out, int64_t n, int64_t r0, int64_t r1) {
    const int64_t n_vec = n - n % 16;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * n, *gr = g + r * n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float e = i < n_vec ? v_expf1(0.0f - xr[i]) : expf(-xr[i]);
            o[i] = (xr[i] / (1.0f + e)) * gr[i];
        }
    }
}
