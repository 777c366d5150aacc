// CPU kernels of the numpy backend (bloomery/engine/cpu/kernels.py compiles this once per
// machine with the system's C compiler and loads it through ctypes).
//
// The quantized products read the GGUF blocks in place (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K: no decoded
// copy of a weight is kept) against activations already quantized to the weight's vec_dot
// partner (Q8_0 or Q8_K, bloomery/engine/quant/q8_0.py and k_quants.py), in the float order of llama.cpp's
// CPU kernels, which the same files spell out in numpy. The activation quantizers, swiglu and
// the product of one weight row with a few activation rows are in lanes_dot.h, which
// kernels/host_moe.c (the cuda backend's host experts) includes too: one implementation, one
// set of bits; the kernels here that take many weight rows at once (the AVX-512 pairs and tiles
// of a prompt) keep the same order:
//   Q8_0 family: per output eight f32 lanes, lane l of block b holding the exact integer sum of
//   elements 4l..4l+3; each block does acc = fma(d_w * d_a, (float)lane, acc), the scale product
//   rounded to f32 (exact here: two f16 values); then hsum_float_8.
//   Q6_K, Q5_K and Q4_K: see lanes_dot.h.
// The integer sums are exact whatever the instructions, and the float steps are spelled out, so
// the AVX2 path and the portable one give the same bits. Built with -ffp-contract=off so the
// compiler adds no fma of its own. One call spreads the weight rows (attention: the query rows)
// over `nth` threads (the pool below); no output's float order depends on the split.
//
// Legend: N = weight rows, K = row length, B = K / 32 blocks, Bs = K / 256 super-blocks,
// T = activation rows.
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "lanes_dot.h"

int lanes_isa(void) { return LANES_512 ? 2 : LANES_AVX2; }

typedef _Float16 f16;

// ---- the thread pool: a call's items (weight rows, query rows) in chunks that the calling
// thread and the workers take from one counter. The caller waits only for chunks taken and not
// yet done, never for a worker that has not started: on a machine whose cores are shared, a
// worker the scheduler has not run yet costs nothing, the caller does its share. Workers spin a
// little after a job (500 pause rounds by default, tens of microseconds: the next product of a
// layer often comes that soon), then sleep; a longer spin buys little on an idle machine and
// costs the caller's own core on a busy one (bloomery/engine/cpu/kernels.py sets it).
typedef void (*chunk_fn)(const void *ctx, int64_t i0, int64_t i1, int worker);

#define POOL_MAX 64
static atomic_int pool_spin = 500;                     // pause rounds a worker waits before it sleeps

void lanes_set_spin(int rounds) { atomic_store(&pool_spin, rounds < 0 ? 0 : rounds); }

typedef struct {
    chunk_fn fn;
    const void *ctx;
    int64_t n, grain;
    int nth;                                           // workers 1..nth-1 may join (per-thread scratch)
    atomic_llong next, done;
    atomic_int users;                                  // workers inside this job
} job_t;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_started;
    atomic_ullong gen;                                 // job number; its slot is gen % 2
    job_t slot[2];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};

static void run_chunks(job_t *j, int worker) {
    for (;;) {
        const int64_t i0 = atomic_fetch_add(&j->next, j->grain);
        if (i0 >= j->n) return;
        const int64_t i1 = i0 + j->grain < j->n ? i0 + j->grain : j->n;
        j->fn(j->ctx, i0, i1, worker);
        atomic_fetch_add(&j->done, i1 - i0);
    }
}

static void *pool_worker(void *arg) {
    const int worker = (int)(intptr_t)arg;
    unsigned long long seen = atomic_load(&pool.gen);
    for (;;) {
        unsigned long long g;
        int spins = 0;
        const int spin_max = atomic_load(&pool_spin);
        while ((g = atomic_load(&pool.gen)) == seen && ++spins < spin_max) {
#if LANES_AVX2
            _mm_pause();
#endif
        }
        pthread_mutex_lock(&pool.mu);
        while ((g = atomic_load(&pool.gen)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
        job_t *j = &pool.slot[g % 2];
        atomic_fetch_add(&j->users, 1);                // under the lock: the caller reuses a slot only at 0
        pthread_mutex_unlock(&pool.mu);
        seen = g;
        if (worker < j->nth) run_chunks(j, worker);
        atomic_fetch_sub(&j->users, 1);
    }
    return NULL;
}

// fn over items 0..n in chunks of `grain`, on the calling thread and up to nth - 1 workers
static atomic_flag pool_busy = ATOMIC_FLAG_INIT;       // one caller at a time; a second runs alone

static void pool_run(chunk_fn fn, const void *ctx, int64_t n, int64_t grain, int nth) {
    if (nth > POOL_MAX) nth = POOL_MAX;
    if (nth <= 1 || n <= grain || atomic_flag_test_and_set(&pool_busy)) {
        fn(ctx, 0, n, 0);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    while (pool.n_started < nth - 1) {                 // workers start on first need, and stay
        pthread_t th;
        if (pthread_create(&th, NULL, pool_worker, (void *)(intptr_t)(pool.n_started + 1)) != 0) break;
        pthread_detach(th);
        pool.n_started++;
    }
    const unsigned long long g = atomic_load(&pool.gen) + 1;
    job_t *j = &pool.slot[g % 2];
    while (atomic_load(&j->users) > 0) {               // a straggler of two jobs ago: it holds no chunk
        pthread_mutex_unlock(&pool.mu);
        sched_yield();
        pthread_mutex_lock(&pool.mu);
    }
    j->fn = fn;
    j->ctx = ctx;
    j->n = n;
    j->grain = grain;
    j->nth = nth;
    atomic_store(&j->next, 0);
    atomic_store(&j->done, 0);
    atomic_store(&pool.gen, g);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    run_chunks(j, 0);
    for (int spins = 0; atomic_load(&j->done) < n; spins++) {   // chunks a worker took and is finishing
        if (spins > 64) sched_yield();
#if LANES_AVX2
        else _mm_pause();
#endif
    }
    atomic_flag_clear(&pool_busy);
}

static int64_t grain_for(int64_t n, int nth, int64_t at_least) {   // about 4 chunks a thread
    int64_t g = n / (4 * (nth > 0 ? nth : 1));
    return g < at_least ? at_least : g;
}

#define ACT_TILE 64                                    // activation rows kept in cache while the weight streams

// ---- activations quantized as ggml-cpu's x86 build does (lanes_dot.h; quant/q8_0.py and k_quants.py
// hold the numpy form)
// quantize_row_q8_0: per 32, d = f16(amax / 127), the multiplier 127 / amax in f32, round half
// to even. x [T, K] -> q [T, K], d [T, K/32].
void quant_q8_0(const float *x, int64_t t, int64_t k, int8_t *q, float *d) {
    const int64_t n = t * (k / 32);
    for (int64_t b = 0; b < n; b++) lanes_q8_0_block(x + 32 * b, q + 32 * b, d + b);
}

// quantize_row_q8_K_ref per 256 (lanes_q8_K_block); a row with pos_wins[r] set follows
// ggml_quantize_mat_q8_K_4x8 (on a +max / -max tie the positive one maps to -127). bsums: the
// sums per 16. x [T, K] -> q [T, K], d [T, K/256], bsums [T, K/16].
void quant_q8_K(const float *x, int64_t t, int64_t k, const uint8_t *pos_wins, int8_t *q, float *d, int16_t *bsums) {
    const int64_t nb = k / 256;
    for (int64_t r = 0; r < t; r++)
        for (int64_t b = 0; b < nb; b++)
            lanes_q8_K_block(x + r * k + 256 * b, pos_wins[r], q + r * k + 256 * b, d + r * nb + b,
                             bsums + r * (k / 16) + 16 * b);
}

typedef struct mm_args {                               // a quantized product's arguments
    const uint8_t *w;
    int64_t row_bytes, n_blocks, t, t_gemm, ldo;
    int qtype, tiled;
    const int8_t *a;
    const float *da;
    const int16_t *bsums;
    const int32_t *aoff;                               // LANES_512 Q8_0 family: -offset * the 4-sums of a
    const uint8_t *au;                                 // LANES_512 Q8_0 family, prompts: a + 128 (unsigned)
    float *out;
    void (*row)(const struct mm_args *m, int64_t n, int64_t r0, int64_t r1);   // one weight row's outputs
    void (*row2)(const struct mm_args *m, int64_t n, int64_t r0, int64_t r1);  // rows n, n + 1 (or NULL)
    void (*tile)(const struct mm_args *m, int64_t n);                           // rows n .. n + 16, every T (or NULL)
    const int32_t *aext;                               // the tile kernels' per-activation terms (see there)
} mm_args;

// ---- one weight row's outputs for activation rows r0..r1, LANES_NMAX rows a call of kern (a lanes_dot.h *_n
// product, inlined for each row count: called through a pointer a weight row, an 896-wide Q5_0 row's decode
// product spent up to a quarter of its time in the call, session 24); bsums: K types (k a multiple of 256)
#define ROW_BY_DOT(kern, mode, m, n, r0, r1, k)                                                                   \
    do {                                                                                                          \
        const uint8_t *wr_ = (m)->w + (n) * (m)->row_bytes;                                                       \
        for (int64_t r_ = (r0); r_ < (r1); r_ += LANES_NMAX) {                                                    \
            const int nr_ = (r1) - r_ < LANES_NMAX ? (int)((r1) - r_) : LANES_NMAX;                               \
            if (nr_ == 1) {                   /* a decode row: one activation, kept in registers */               \
                const lanes_act a1_ = {.q = (m)->a + r_ * (k), .d = (m)->da + r_ * (m)->n_blocks,                 \
                                       .bs = (m)->bsums ? (m)->bsums + r_ * ((k) / 16) : NULL,                    \
                                       .aoff = (m)->aoff ? (m)->aoff + r_ * ((k) / 4) : NULL};                    \
                float o1_;                                                                                        \
                kern(wr_, (m)->n_blocks, (mode), &a1_, 1, &o1_);                                                  \
                (m)->out[r_ * (m)->ldo + (n)] = o1_;                                                              \
                continue;                                                                                         \
            }                                                                                                     \
            lanes_act act_[LANES_NMAX];                                                                           \
            float o_[LANES_NMAX];                                                                                 \
            for (int i_ = 0; i_ < nr_; i_++)                                                                      \
                act_[i_] = (lanes_act){.q = (m)->a + (r_ + i_) * (k), .d = (m)->da + (r_ + i_) * (m)->n_blocks,   \
                                       .bs = (m)->bsums ? (m)->bsums + (r_ + i_) * ((k) / 16) : NULL,             \
                                       .aoff = (m)->aoff ? (m)->aoff + (r_ + i_) * ((k) / 4) : NULL};             \
            switch (nr_) {                                                                                        \
            case 2: kern(wr_, (m)->n_blocks, (mode), act_, 2, o_); break;                                         \
            case 3: kern(wr_, (m)->n_blocks, (mode), act_, 3, o_); break;                                         \
            default: kern(wr_, (m)->n_blocks, (mode), act_, 4, o_); break;                                       \
            }                                                                                                     \
            for (int i_ = 0; i_ < nr_; i_++) (m)->out[(r_ + i_) * (m)->ldo + (n)] = o_[i_];                       \
        }                                                                                                         \
    } while (0)

// ---- Q8_0 family: out[r * ldo + n] for weight rows 0..N, activation rows 0..T ----------------
// w: the stored blocks [N, B] (qtype 0: Q8_0, 1: Q5_0); a [T, K] int8, da [T, B] f32.
static void q80_row(const mm_args *m, int64_t n, int64_t r0, int64_t r1) {
    ROW_BY_DOT(lanes_dot_q80_n, m->qtype, m, n, r0, r1, m->n_blocks * 32);
}


// a chunk of weight rows: each tile of activation rows over all of them (the rows stay in cache)
static void mm_chunk(const void *ctx, int64_t n0, int64_t n1, int worker) {
    const mm_args *m = ctx;
    (void)worker;
    if (m->tile)
        for (; n0 + 16 <= n1; n0 += 16) m->tile(m, n0);
    for (int64_t r0 = 0; r0 < m->t; r0 += ACT_TILE) {
        const int64_t r1 = r0 + ACT_TILE < m->t ? r0 + ACT_TILE : m->t;
        int64_t n = n0;
        if (m->row2)
            for (; n + 2 <= n1; n += 2) m->row2(m, n, r0, r1);
        for (; n < n1; n++) m->row(m, n, r0, r1);
    }
}

#if LANES_512
// Two weight rows at once: bits 0-255 of a vector hold row n's block b, bits 256-511 row n + 1's,
// so each half is its own output's chain of fmas, in the order above. The quants are made
// unsigned (Q8_0: w + 128, Q5_0: w + 16) for dpbusd, whose lane l sums the four products of
// elements 4l..4l+3 exactly; the offset comes off through aoff, -offset * the same four-sums of
// the activation, the lane's start value. Every lane is the same integer as the AVX2 path's.
static inline __m512i q80_pair_u(const uint8_t *b0, const uint8_t *b1, int qtype) {
    if (qtype == 0) {
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
        return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    }
    uint32_t h0, h1;
    memcpy(&h0, b0 + 2, 4);
    memcpy(&h1, b1 + 2, 4);
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(b0 + 6)), q1 = _mm_loadu_si128((const __m128i *)(b1 + 6));
    __m512i x = _mm512_castsi128_si512(q0);
    x = _mm512_inserti32x4(x, _mm_srli_epi16(q0, 4), 1);
    x = _mm512_inserti32x4(x, q1, 2);
    x = _mm512_inserti32x4(x, _mm_srli_epi16(q1, 4), 3);
    x = _mm512_and_si512(x, _mm512_set1_epi8(0xF));
    return _mm512_mask_add_epi8(x, (__mmask64)((uint64_t)h0 | ((uint64_t)h1 << 32)), x, _mm512_set1_epi8(16));
}

static inline void store_pair(float *o0, float *o1, __m512 acc) {
    float a[16];
    _mm512_storeu_ps(a, acc);
    *o0 = hsum8(a);
    *o1 = hsum8(a + 8);
}

// one activation row's step of q80_row2 (its locals: a, k, aoff, da, b, r, the pair's u and sw)
#define Q80_STEP(i, accv) {                                                                                    \
    const int64_t ri = r + (i);                                                                                 \
    const __m512i av = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a + ri * k + 32 * b)));        \
    const __m512i o = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(aoff + (ri * n_blocks + b) * 8)));  \
    accv = _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_set1_ps(da[ri * n_blocks + b])),                            \
                           _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(o, u, av)), accv); }

// R activation rows (a constant, 1..8) share each decoded pair
static inline __attribute__((always_inline)) void q80_pair_rows(const mm_args *m, int64_t n, int64_t r, const int R) {
    const int qtype = m->qtype;
    const int64_t n_blocks = m->n_blocks, ldo = m->ldo, k = n_blocks * 32;
    const int64_t bb = qtype == 0 ? Q8_0_BYTES : Q5_0_BYTES;
    const uint8_t *w0 = m->w + n * m->row_bytes, *w1 = w0 + m->row_bytes;
    const int8_t *a = m->a;
    const int32_t *aoff = m->aoff;
    const float *da = m->da;
    __m512 acc[8];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *x0 = w0 + b * bb, *x1 = w1 + b * bb;
        const __m512i u = q80_pair_u(x0, x1, qtype);
        const __m512 sw = _mm512_insertf32x8(_mm512_set1_ps(f16_at(x0)), _mm256_set1_ps(f16_at(x1)), 1);
        for (int i = 0; i < R; i++) Q80_STEP(i, acc[i])
    }
#undef Q80_STEP
    for (int i = 0; i < R; i++) store_pair(m->out + (r + i) * ldo + n, m->out + (r + i) * ldo + n + 1, acc[i]);
}

static void q80_row2(const mm_args *m, int64_t n, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1;) {
        const int64_t R = r1 - r < 8 ? r1 - r : 8;
        switch (R) {
        case 8: q80_pair_rows(m, n, r, 8); break;
        case 7: q80_pair_rows(m, n, r, 7); break;
        case 6: q80_pair_rows(m, n, r, 6); break;
        case 5: q80_pair_rows(m, n, r, 5); break;
        case 4: q80_pair_rows(m, n, r, 4); break;
        case 3: q80_pair_rows(m, n, r, 3); break;
        case 2: q80_pair_rows(m, n, r, 2); break;
        default: q80_pair_rows(m, n, r, 1); break;
        }
        r += R;
    }
}

// Prompts: the activation made unsigned instead (a + 128, once a call) and the weight kept
// signed, so the offset, -128 * the four-sums of the weight, is a weight block's (one dpbusd a
// pair, shared by every activation row) and no activation offsets are read; each lane is again
// the same integer.
static inline __m512i q80_pair_s(const uint8_t *b0, const uint8_t *b1, int qtype) {
    if (qtype == 0)
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                  _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
    return _mm512_sub_epi8(q80_pair_u(b0, b1, qtype), _mm512_set1_epi8(16));
}

#define Q80U_STEP(i, accv) {                                                                                   \
    const int64_t ri = r + (i);                                                                                 \
    const __m512i av = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(au + ri * k + 32 * b)));       \
    accv = _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_set1_ps(da[ri * n_blocks + b])),                            \
                           _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(wo, av, ws)), accv); }

static void q80_row2u(const mm_args *m, int64_t n, int64_t r0, int64_t r1) {
    const int qtype = m->qtype;
    const int64_t n_blocks = m->n_blocks, ldo = m->ldo, k = n_blocks * 32;
    const int64_t bb = qtype == 0 ? Q8_0_BYTES : Q5_0_BYTES;
    const uint8_t *w0 = m->w + n * m->row_bytes, *w1 = w0 + m->row_bytes;
    const uint8_t *au = m->au;
    const float *da = m->da;
    float *out = m->out;
    const __m512i ones = _mm512_set1_epi8(1);
    int64_t r = r0;
    for (; r + 16 <= r1; r += 16) {                    // sixteen activation rows share each decoded pair
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        __m512 acc4 = acc0, acc5 = acc0, acc6 = acc0, acc7 = acc0;
        __m512 acc8 = acc0, acc9 = acc0, acc10 = acc0, acc11 = acc0;
        __m512 acc12 = acc0, acc13 = acc0, acc14 = acc0, acc15 = acc0;
        for (int64_t b = 0; b < n_blocks; b++) {
            const uint8_t *x0 = w0 + b * bb, *x1 = w1 + b * bb;
            const __m512i ws = q80_pair_s(x0, x1, qtype);
            const __m512i wo = _mm512_sub_epi32(_mm512_setzero_si512(),
                                                _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, ws), 7));
            const __m512 sw = _mm512_insertf32x8(_mm512_set1_ps(f16_at(x0)), _mm256_set1_ps(f16_at(x1)), 1);
            Q80U_STEP(0, acc0) Q80U_STEP(1, acc1) Q80U_STEP(2, acc2) Q80U_STEP(3, acc3)
            Q80U_STEP(4, acc4) Q80U_STEP(5, acc5) Q80U_STEP(6, acc6) Q80U_STEP(7, acc7)
            Q80U_STEP(8, acc8) Q80U_STEP(9, acc9) Q80U_STEP(10, acc10) Q80U_STEP(11, acc11)
            Q80U_STEP(12, acc12) Q80U_STEP(13, acc13) Q80U_STEP(14, acc14) Q80U_STEP(15, acc15)
        }
        const __m512 accs[16] = {acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                                 acc8, acc9, acc10, acc11, acc12, acc13, acc14, acc15};
        for (int i = 0; i < 16; i++) store_pair(out + (r + i) * ldo + n, out + (r + i) * ldo + n + 1, accs[i]);
    }
    for (; r + 8 <= r1; r += 8) {
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        __m512 acc4 = acc0, acc5 = acc0, acc6 = acc0, acc7 = acc0;
        for (int64_t b = 0; b < n_blocks; b++) {
            const uint8_t *x0 = w0 + b * bb, *x1 = w1 + b * bb;
            const __m512i ws = q80_pair_s(x0, x1, qtype);
            const __m512i wo = _mm512_sub_epi32(_mm512_setzero_si512(),
                                                _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, ws), 7));
            const __m512 sw = _mm512_insertf32x8(_mm512_set1_ps(f16_at(x0)), _mm256_set1_ps(f16_at(x1)), 1);
            Q80U_STEP(0, acc0) Q80U_STEP(1, acc1) Q80U_STEP(2, acc2) Q80U_STEP(3, acc3)
            Q80U_STEP(4, acc4) Q80U_STEP(5, acc5) Q80U_STEP(6, acc6) Q80U_STEP(7, acc7)
        }
        const __m512 accs[8] = {acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7};
        for (int i = 0; i < 8; i++) store_pair(out + (r + i) * ldo + n, out + (r + i) * ldo + n + 1, accs[i]);
    }
#undef Q80U_STEP
    if (r < r1) q80_row2(m, n, r, r1);
}

// A calling thread's scratch buffer `slot`, kept between calls and grown as needed: a prompt's
// few-MB buffers, taken fresh from malloc each product, came as new pages the kernel zeroed
// (clear_page was 3 % of a prompt's CPU). NULL where the memory is not there.
static void *scratch(int slot, size_t bytes) {
    static _Thread_local void *buf[3];
    static _Thread_local size_t cap[3];
    if (bytes > cap[slot]) {
        free(buf[slot]);
        buf[slot] = malloc(bytes);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
}

// aoff [T, B, 8]: -offset * (a[4l] + .. + a[4l+3]) for lane l of each block
static int32_t *q80_aoff(const int8_t *a, int64_t t, int64_t n_blocks, int qtype) {
    int32_t *o = scratch(0, (size_t)(t * n_blocks * 8) * sizeof(int32_t));
    if (!o) return NULL;
    const __m256i ones = _mm256_set1_epi8(1);
    const int shift = qtype == 0 ? 7 : qtype == 1 ? 4 : 3;                    // 128, 16 or 8
    for (int64_t i = 0; i < t * n_blocks; i++) {
        const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, _mm256_loadu_si256((const __m256i *)(a + 32 * i)));
        _mm256_storeu_si256((__m256i *)(o + 8 * i), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, shift)));
    }
    return o;
}
// ---- Prompts with the weight rows across the lanes (Q8_0 family, Q6_K tiled, Q4_K gemm) -----
// A tile of 16 weight rows is unpacked once a call into 4-byte groups across 16 lanes: vector s
// holds elements 4s..4s+3 of each of the 16 rows, so dpbusd against 4 activation
// bytes broadcast adds four products to each row's lane, and each lane ends holding one output's
// integer sum (Q8_0 family: one of its eight lane sums): no horizontal sums, and the weight unpacked
// once for every activation row. The float steps then run per lane in the order above (one lane,
// one output), so the bits are the row kernels'. Taken from TILE_MIN_T activation rows, where the unpacking is paid back.
#define TILE_MIN_T 20
#define TILE_R 8                                       // activation rows a micro-step holds in registers

static int64_t tile_grain(int64_t n_rows, int nth) {  // chunks of whole 16-row tiles
    return (grain_for(n_rows, nth, 16) + 15) & ~(int64_t)15;
}

static inline __m512i bcast4(const int8_t *p) {        // four activation bytes in every lane
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// 32-element vectors of one row (elements in order) -> their 4-byte groups into the tile's lane j
static inline void tile_scatter(const __m256i *v, int nv, uint8_t *q, int j) {
    uint32_t g[64];
    memcpy(g, v, (size_t)nv * 32);
    uint32_t *dst = (uint32_t *)q + j;
    for (int s = 0; s < nv * 8; s++) dst[16 * s] = g[s];
}

// Q8_0 / Q5_0: q [B][8][16][4] the unsigned quants (Q8_0: w + 128, Q5_0: w + 16), d [B][16]. Lane
// l of a block is its own dpbusd from aoff (-offset * the activation's 4-sum) and its own chain of
// fmas per output, acc_l = fma(d_w * d_a, lane, acc_l), all 16 rows in one vector; the
// hsum_float_8 at the end is vertical adds between the eight lanes' vectors, in its order.
#define Q80_TILE_R 2
#define Q80_TILE_MIN_T 8                               // the unpacking is cheap here: from 8 rows

static void q80_tile(const mm_args *m, int64_t n) {
    const int qtype = m->qtype;
    const int64_t nb = m->n_blocks, k = nb * 32, ldo = m->ldo, t = m->t, bb = qtype == 0 ? Q8_0_BYTES : Q5_0_BYTES;
    uint8_t *q = scratch(2, (size_t)nb * (512 + 64));
    if (!q) {
        for (int j = 0; j < 16; j++) q80_row(m, n + j, 0, t);
        return;
    }
    float *dw = (float *)(q + nb * 512);
    for (int j = 0; j < 16; j++) {
        const uint8_t *wr = m->w + (n + j) * m->row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            const __m256i v = q80_unsigned(wr + b * bb, qtype);
            tile_scatter(&v, 1, q + b * 512, j);
            dw[b * 16 + j] = f16_at(wr + b * bb);
        }
    }
    for (int64_t r = 0; r < t; r += Q80_TILE_R) {
        const int nr = t - r < Q80_TILE_R ? (int)(t - r) : Q80_TILE_R;
        __m512 acc[Q80_TILE_R][8];
        int64_t ri[Q80_TILE_R];
        for (int i = 0; i < Q80_TILE_R; i++) {
            ri[i] = r + (i < nr ? i : 0);
            for (int l = 0; l < 8; l++) acc[i][l] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const __m512 dwv = _mm512_loadu_ps(dw + b * 16);
            __m512i w[8];
            for (int l = 0; l < 8; l++) w[l] = _mm512_loadu_si512((const void *)(q + b * 512 + 64 * l));
            for (int i = 0; i < Q80_TILE_R; i++) {
                const __m512 dd = _mm512_mul_ps(dwv, _mm512_set1_ps(m->da[ri[i] * nb + b]));
                const int8_t *ab = m->a + ri[i] * k + 32 * b;
                const int32_t *o = m->aoff + (ri[i] * nb + b) * 8;
                for (int l = 0; l < 8; l++)
                    acc[i][l] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_set1_epi32(o[l]), w[l],
                                                                                           bcast4(ab + 4 * l))),
                                                acc[i][l]);
            }
        }
        for (int i = 0; i < nr; i++) {
            const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][4]), _mm512_add_ps(acc[i][2], acc[i][6])),
                                           _mm512_add_ps(_mm512_add_ps(acc[i][1], acc[i][5]), _mm512_add_ps(acc[i][3], acc[i][7])));
            _mm512_storeu_ps(m->out + (r + i) * ldo + n, s);
        }
    }
}
#endif

void q80_mm(const uint8_t *w, int qtype, int64_t n_rows, int64_t n_blocks, const int8_t *a, const float *da,
            int64_t t, float *out, int64_t ldo, int nth) {
    mm_args m = {.w = w, .row_bytes = n_blocks * (qtype == 0 ? Q8_0_BYTES : Q5_0_BYTES), .n_blocks = n_blocks,
                 .t = t, .ldo = ldo, .qtype = qtype, .a = a, .da = da, .out = out, .row = q80_row};
#if LANES_512
    // two weight rows a vector from 2 activation rows (several slots' decode rows); one row reads the weight
    // faster one row at a time
    int32_t *aoff = q80_aoff(a, t, n_blocks, qtype);
    if (aoff) {
        m.aoff = aoff;
        m.row2 = t >= 2 ? q80_row2 : NULL;
    }
    if (aoff && t >= Q80_TILE_MIN_T && n_rows >= 16) m.tile = q80_tile;
    uint8_t *au = aoff && t >= 8 && (!m.tile || n_rows % 16) ? scratch(1, (size_t)(t * n_blocks * 32)) : NULL;
    if (au) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int64_t i = 0; i < t * n_blocks / 2; i++)
            _mm512_storeu_si512((void *)(au + 64 * i), _mm512_xor_si512(_mm512_loadu_si512((const void *)(a + 64 * i)), flip));
        for (int64_t i = t * n_blocks / 2 * 64; i < t * n_blocks * 32; i++) au[i] = (uint8_t)(a[i] ^ 0x80);
        m.au = au;
        m.row2 = q80_row2u;
    }
    pool_run(mm_chunk, &m, n_rows, m.tile ? tile_grain(n_rows, nth) : grain_for(n_rows, nth, 4) & ~(int64_t)1, nth);
#else
    pool_run(mm_chunk, &m, n_rows, grain_for(n_rows, nth, 4), nth);
#endif
}

// ---- K-quants against Q8_K activations (256 per super-block, bsums per 16) ---------------
// a [T, K] int8 (|a| <= 127), da [T, Bs] f32, bsums [T, K/16] int16.

// Q6_K (ggml_vec_dot_q6_K_q8_K's lanes, and ggml's tiled mul_mat from 8 rows: tiled), Q5_K (not
// repacked on x86: the same two) and Q4_K (repacked: its gemm's rows below t_gemm, its gemv's
// after) row by row through lanes_dot.h, where their float orders are spelled out; the AVX-512
// prompt tiles below keep the same orders.
static void q6k_row(const mm_args *m, int64_t n, int64_t r0, int64_t r1) {
    ROW_BY_DOT(lanes_dot_q6k_n, m->tiled, m, n, r0, r1, m->n_blocks * 256);
}

#if LANES_512
static void q6k_tile(const mm_args *m, int64_t n) {
    const int64_t n_super = m->n_blocks, k = n_super * 256, ldo = m->ldo, t = m->t;
    uint8_t *q = scratch(2, (size_t)n_super * (4096 + 16 * 16 * 4 + 16 * 4));
    if (!q) {
        for (int j = 0; j < 16; j++) m->row(m, n + j, 0, t);   // no memory for the tile: the row kernel, same bits
        return;
    }
    int32_t *sc = (int32_t *)(q + n_super * 4096);
    float *d = (float *)(sc + n_super * 256);
    for (int j = 0; j < 16; j++) {
        const uint8_t *wr = m->w + (n + j) * m->row_bytes;
        for (int64_t b = 0; b < n_super; b++) {
            const uint8_t *blk = wr + b * Q6_K_BYTES;
            __m256i v[8];
            q6k_vecs(blk, v);
            tile_scatter(v, 8, q + b * 4096, j);
            for (int u = 0; u < 16; u++) sc[(b * 16 + u) * 16 + j] = ((const int8_t *)(blk + 192))[u];
            d[b * 16 + j] = f16_at(blk + 208);
        }
    }
    const int32_t *off = m->aext;
    int64_t r = 0;
    for (; r < t; r += TILE_R) {
        const int nr = t - r < TILE_R ? (int)(t - r) : TILE_R;
        __m512 acc[TILE_R];
        for (int i = 0; i < TILE_R; i++) acc[i] = _mm512_setzero_ps();
        const int8_t *a[TILE_R];
        for (int i = 0; i < TILE_R; i++) a[i] = m->a + (r + (i < nr ? i : 0)) * k;
        for (int64_t b = 0; b < n_super; b++) {
            __m512i tot[TILE_R];
            for (int i = 0; i < TILE_R; i++) tot[i] = _mm512_setzero_si512();
            const uint8_t *qb = q + b * 4096;
            for (int u = 0; u < 16; u++) {
                __m512i p[TILE_R];
                for (int i = 0; i < TILE_R; i++)
                    p[i] = _mm512_set1_epi32(off[(r + (i < nr ? i : 0)) * n_super * 16 + b * 16 + u]);
                for (int s4 = 0; s4 < 4; s4++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(qb + (4 * u + s4) * 64));
                    for (int i = 0; i < TILE_R; i++)
                        p[i] = _mm512_dpbusd_epi32(p[i], w, bcast4(a[i] + 256 * b + 16 * u + 4 * s4));
                }
                const __m512i scv = _mm512_loadu_si512((const void *)(sc + (b * 16 + u) * 16));
                for (int i = 0; i < TILE_R; i++) tot[i] = _mm512_add_epi32(tot[i], _mm512_mullo_epi32(p[i], scv));
            }
            const __m512 dw = _mm512_loadu_ps(d + b * 16);
            for (int i = 0; i < TILE_R; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(tot[i]), dw),
                                         _mm512_set1_ps(m->da[(r + (i < nr ? i : 0)) * n_super + b]), acc[i]);
        }
        for (int i = 0; i < nr; i++) _mm512_storeu_ps(m->out + (r + i) * ldo + n, acc[i]);
    }
}
#endif

void q6k_mm(const uint8_t *w, int64_t n_rows, int64_t n_super, const int8_t *a, const float *da,
            const int16_t *bsums, int64_t t, int tiled, float *out, int64_t ldo, int nth) {
    mm_args m = {.w = w, .row_bytes = n_super * Q6_K_BYTES, .n_blocks = n_super, .t = t, .ldo = ldo,
                 .tiled = tiled, .a = a, .da = da, .bsums = bsums, .out = out, .row = q6k_row};
#if LANES_512
    if (tiled && t >= TILE_MIN_T) {
        int32_t *off = scratch(0, (size_t)(t * n_super * 16) * sizeof(int32_t));
        if (off) {
            for (int64_t i = 0; i < t * n_super * 16; i++) off[i] = -32 * (int32_t)bsums[i];
            m.aext = off;
            m.tile = q6k_tile;
        }
    }
    pool_run(mm_chunk, &m, n_rows, m.tile ? tile_grain(n_rows, nth) : grain_for(n_rows, nth, 4), nth);
#else
    pool_run(mm_chunk, &m, n_rows, grain_for(n_rows, nth, 4), nth);
#endif
}

static void q5k_row(const mm_args *m, int64_t n, int64_t r0, int64_t r1) {
    ROW_BY_DOT(lanes_dot_q5k_n, m->tiled, m, n, r0, r1, m->n_blocks * 256);
}

void q5k_mm(const uint8_t *w, int64_t n_rows, int64_t n_super, const int8_t *a, const float *da,
            const int16_t *bsums, int64_t t, int tiled, float *out, int64_t ldo, int nth) {
    mm_args m = {.w = w, .row_bytes = n_super * Q5_K_BYTES, .n_blocks = n_super, .t = t, .ldo = ldo,
                 .tiled = tiled, .a = a, .da = da, .bsums = bsums, .out = out, .row = q5k_row};
    pool_run(mm_chunk, &m, n_rows, grain_for(n_rows, nth, 4), nth);
}

// Q4_K: rows below t_gemm in the repacked gemm's order (once per 64), the rest in its gemv's
static void q4k_row(const mm_args *m, int64_t n, int64_t r0, int64_t r1) {
    const int64_t k = m->n_blocks * 256, split = r0 > m->t_gemm ? r0 : m->t_gemm < r1 ? m->t_gemm : r1;
    ROW_BY_DOT(lanes_dot_q4k_n, 1, m, n, r0, split, k);       // the gemm's rows
    ROW_BY_DOT(lanes_dot_q4k_n, 0, m, n, split, r1, k);       // the gemv's
}

#if LANES_512
// Gemm rows four at a time with the float steps in one vector of the four rows: per 64 elements
// c, the four rows' integer sums come out of one hadd tree in row order, so acc = fma(f32(sumi),
// d_a * d_w, acc) is the same per-row chain as above, one lane a row; the mins' sums likewise
// (madd of each row's bsums with the mins, then even / odd pairs). Other rows: q4k_row.
static void q4k_row_gemm(const mm_args *m, int64_t n, int64_t r0, int64_t r1) {
    const int64_t n_super = m->n_blocks, ldo = m->ldo, k = n_super * 256;
    const uint8_t *wr = m->w + n * m->row_bytes;
    const __m256i lo4 = _mm256_set1_epi8(0xF);
    int64_t rb = r0;
    for (int g = 2; g >= 1; g--)                       // two groups of four rows share the unpacked block, then one
        for (; rb + 4 * g <= r1 && rb + 4 * g <= m->t_gemm; rb += 4 * g) {
            __m128 acc[2] = {_mm_setzero_ps(), _mm_setzero_ps()}, accm[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
            for (int64_t b = 0; b < n_super; b++) {
                const uint8_t *blk = wr + b * Q4_K_BYTES;
                const float d = f16_at(blk), dmin = f16_at(blk + 2);
                int32_t sc[8], mn[8];
                q4k_scales(blk + 4, sc, mn);
                const __m256i m32 = _mm256_setr_epi32(mn[0], mn[1], mn[2], mn[3], mn[4], mn[5], mn[6], mn[7]);
                const __m256i mn16 = _mm256_or_si256(m32, _mm256_slli_epi32(m32, 16));   // each min in both words
                __m128 dd4[2], dm4[2];
                __m128i mc[2][4];
                for (int gi = 0; gi < g; gi++) {
                    const float *d0 = m->da + (rb + 4 * gi) * n_super;
                    const int16_t *bs0 = m->bsums + (rb + 4 * gi) * n_super * 16;
                    const __m128 da4 = _mm_setr_ps(d0[b], d0[n_super + b], d0[2 * n_super + b], d0[3 * n_super + b]);
                    dd4[gi] = _mm_mul_ps(da4, _mm_set1_ps(d));
                    dm4[gi] = _mm_mul_ps(da4, _mm_set1_ps(dmin));
                    __m256i mv[4];
                    for (int i = 0; i < 4; i++)
                        mv[i] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs0 + i * n_super * 16 + 16 * b)), mn16);
                    const __m256 x = _mm256_castsi256_ps(_mm256_hadd_epi32(mv[0], mv[1]));   // [r0 c0, r0 c1, r1 c0, r1 c1 | c2, c3]
                    const __m256 y = _mm256_castsi256_ps(_mm256_hadd_epi32(mv[2], mv[3]));
                    const __m256i ev = _mm256_castps_si256(_mm256_shuffle_ps(x, y, 0x88));  // c0 | c2, rows 0..3
                    const __m256i od = _mm256_castps_si256(_mm256_shuffle_ps(x, y, 0xDD));  // c1 | c3
                    mc[gi][0] = _mm256_castsi256_si128(ev);
                    mc[gi][1] = _mm256_castsi256_si128(od);
                    mc[gi][2] = _mm256_extracti128_si256(ev, 1);
                    mc[gi][3] = _mm256_extracti128_si256(od, 1);
                }
                for (int c = 0; c < 4; c++) {
                    const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                    const __m256i ql = _mm256_and_si256(qs, lo4), qh = _mm256_and_si256(_mm256_srli_epi16(qs, 4), lo4);
                    const __m256i s0 = _mm256_set1_epi16((int16_t)sc[2 * c]), s1 = _mm256_set1_epi16((int16_t)sc[2 * c + 1]);
                    for (int gi = 0; gi < g; gi++) {
                        __m256i v[4];
                        for (int i = 0; i < 4; i++) {
                            const int8_t *ab = m->a + (rb + 4 * gi + i) * k + 256 * b + 64 * c;
                            v[i] = _mm256_dpwssd_epi32(
                                _mm256_dpwssd_epi32(_mm256_setzero_si256(),
                                                    _mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)ab)), s0),
                                _mm256_maddubs_epi16(qh, _mm256_loadu_si256((const __m256i *)(ab + 32))), s1);
                        }
                        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                        const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                        acc[gi] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), dd4[gi], acc[gi]);
                        accm[gi] = _mm_fmadd_ps(_mm_cvtepi32_ps(mc[gi][c]), dm4[gi], accm[gi]);
                    }
                }
            }
            for (int gi = 0; gi < g; gi++) {
                float o[4];
                _mm_storeu_ps(o, _mm_sub_ps(acc[gi], accm[gi]));
                for (int i = 0; i < 4; i++) m->out[(rb + 4 * gi + i) * ldo + n] = o[i];
            }
        }
    if (rb < r1) q4k_row(m, n, rb, r1);
}

// Q4_K gemm rows on the tile (see q6k_tile): q [Bs][64][16][4] nibbles, sc [Bs][8][16] int32 scales,
// mp [Bs][4][16] the two mins of each 64 as an int16 pair, d, dmin [Bs][16]. aext [T][Bs * 4]: the
// activation's sums per 32 of each 64, as the same int16 pair, so one dpwssd gives each lane the
// mins' term m0 * bs0 + m1 * bs1 exactly. Rows from t_gemm (the gemv's order): q4k_row.
static void q4k_tile(const mm_args *m, int64_t n) {
    const int64_t n_super = m->n_blocks, k = n_super * 256, ldo = m->ldo, t = m->t_gemm;
    uint8_t *q = scratch(2, (size_t)n_super * (4096 + 8 * 16 * 4 + 4 * 16 * 4 + 2 * 16 * 4));
    if (!q) {
        for (int j = 0; j < 16; j++) m->row(m, n + j, 0, m->t);
        return;
    }
    int32_t *sc = (int32_t *)(q + n_super * 4096), *mp = sc + n_super * 128;
    float *d = (float *)(mp + n_super * 64), *dmin = d + n_super * 16;
    const __m256i lo4 = _mm256_set1_epi8(0xF);
    for (int j = 0; j < 16; j++) {
        const uint8_t *wr = m->w + (n + j) * m->row_bytes;
        for (int64_t b = 0; b < n_super; b++) {
            const uint8_t *blk = wr + b * Q4_K_BYTES;
            __m256i v[8];
            for (int c = 0; c < 4; c++) {
                const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                v[2 * c] = _mm256_and_si256(qs, lo4);
                v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), lo4);
            }
            tile_scatter(v, 8, q + b * 4096, j);
            int32_t s8[8], m8[8];
            q4k_scales(blk + 4, s8, m8);
            for (int u = 0; u < 8; u++) sc[(b * 8 + u) * 16 + j] = s8[u];
            for (int c = 0; c < 4; c++) mp[(b * 4 + c) * 16 + j] = (int32_t)((uint32_t)m8[2 * c] | ((uint32_t)m8[2 * c + 1] << 16));
            d[b * 16 + j] = f16_at(blk);
            dmin[b * 16 + j] = f16_at(blk + 2);
        }
    }
    const int32_t *bp = m->aext;
    for (int64_t r = 0; r < t; r += TILE_R) {
        const int nr = t - r < TILE_R ? (int)(t - r) : TILE_R;
        __m512 acc[TILE_R], accm[TILE_R];
        const int8_t *a[TILE_R];
        int64_t ri[TILE_R];
        for (int i = 0; i < TILE_R; i++) {
            acc[i] = accm[i] = _mm512_setzero_ps();
            ri[i] = r + (i < nr ? i : 0);
            a[i] = m->a + ri[i] * k;
        }
        for (int64_t b = 0; b < n_super; b++) {
            const uint8_t *qb = q + b * 4096;
            const __m512 dv = _mm512_loadu_ps(d + b * 16), dmv = _mm512_loadu_ps(dmin + b * 16);
            __m512 dd[TILE_R], dm[TILE_R];
            for (int i = 0; i < TILE_R; i++) {
                const __m512 dai = _mm512_set1_ps(m->da[ri[i] * n_super + b]);
                dd[i] = _mm512_mul_ps(dai, dv);
                dm[i] = _mm512_mul_ps(dai, dmv);
            }
            for (int c = 0; c < 4; c++) {
                __m512i s[TILE_R];
                for (int h = 0; h < 2; h++) {              // the 64's two sub-blocks of 32
                    __m512i p[TILE_R];
                    for (int i = 0; i < TILE_R; i++) p[i] = _mm512_setzero_si512();
                    for (int s4 = 0; s4 < 8; s4++) {
                        const __m512i w = _mm512_loadu_si512((const void *)(qb + (16 * c + 8 * h + s4) * 64));
                        for (int i = 0; i < TILE_R; i++)
                            p[i] = _mm512_dpbusd_epi32(p[i], w, bcast4(a[i] + 256 * b + 64 * c + 32 * h + 4 * s4));
                    }
                    const __m512i scv = _mm512_loadu_si512((const void *)(sc + (b * 8 + 2 * c + h) * 16));
                    for (int i = 0; i < TILE_R; i++)
                        s[i] = h ? _mm512_add_epi32(s[i], _mm512_mullo_epi32(p[i], scv)) : _mm512_mullo_epi32(p[i], scv);
                }
                const __m512i mpv = _mm512_loadu_si512((const void *)(mp + (b * 4 + c) * 16));
                for (int i = 0; i < TILE_R; i++) {
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), dd[i], acc[i]);
                    const __m512i summ = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mpv,
                                                             _mm512_set1_epi32(bp[ri[i] * n_super * 4 + b * 4 + c]));
                    accm[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), dm[i], accm[i]);
                }
            }
        }
        for (int i = 0; i < nr; i++) _mm512_storeu_ps(m->out + (r + i) * ldo + n, _mm512_sub_ps(acc[i], accm[i]));
    }
    for (int j = 0; j < 16 && t < m->t; j++) q4k_row(m, n + j, t, m->t);
}
#endif

void q4k_mm(const uint8_t *w, int64_t n_rows, int64_t n_super, const int8_t *a, const float *da,
            const int16_t *bsums, int64_t t, int64_t t_gemm, float *out, int64_t ldo, int nth) {
    mm_args m = {.w = w, .row_bytes = n_super * Q4_K_BYTES, .n_blocks = n_super, .t = t, .t_gemm = t_gemm,
                 .ldo = ldo, .a = a, .da = da, .bsums = bsums, .out = out, .row = q4k_row};
#if LANES_512
    if (t_gemm >= 4) m.row = q4k_row_gemm;
    if (t_gemm >= TILE_MIN_T) {
        int32_t *bp = scratch(0, (size_t)(t * n_super * 4) * sizeof(int32_t));
        if (bp) {
            for (int64_t i = 0; i < t * n_super * 4; i++) {    // the sums per 32 of each 64, as int16 pairs
                const int16_t *bs = bsums + 4 * i;
                bp[i] = (int32_t)((uint32_t)(uint16_t)(bs[0] + bs[1]) | ((uint32_t)(uint16_t)(bs[2] + bs[3]) << 16));
            }
            m.aext = bp;
            m.tile = q4k_tile;
        }
    }
    pool_run(mm_chunk, &m, n_rows, m.tile ? tile_grain(n_rows, nth) : grain_for(n_rows, nth, 4), nth);
#else
    pool_run(mm_chunk, &m, n_rows, grain_for(n_rows, nth, 4), nth);
#endif
}

// ---- flash attention over the F16 KV cache, as ggml_compute_forward_flash_attn_ext_f16 -------
// bloomery/engine/cpu/kv_cache.py describes both paths (and is their numpy form). One call does
// the query rows 0..n_rows of q [T, H, Dh] (row r = t * H + head) over `nth` threads; row t sees
// positions 0..pos0+t of k, v [L, Hkv, Dh] (F16), head h reads KV head h / (H / Hkv).
// out [T, H, Dh] f32.
//
// The numpy form emulates each f32 fma by a float64 product and sum (two roundings in about
// 2^-29 of the inexact cases); these are true fmas, as llama.cpp's.

// (ggml_v_expf: v_expf1 and v_expf16 in lanes_dot.h)

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
#if LANES_AVX2
    __m256 acc[8];                                 // lane i of the 64 is acc[i / 8][i % 8]
    for (int j = 0; j < 8; j++)
        acc[j] = _mm256_mul_ps(_mm256_loadu_ps(q16 + 8 * j), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + 8 * j))));
    for (int64_t c = 64; c < n_main; c += 64)
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_loadu_ps(q16 + c + 8 * j),
                                                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + c + 8 * j)))));
    // lanes 0..7 and 8..15 of (acc 0..15 + acc 32..47) + (acc 16..31 + acc 48..63), then halves 8, 4, 2, 1
    const __m256 l0 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
    const __m256 l1 = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
    const __m256 h8 = _mm256_add_ps(l0, l1);
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    h4 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    h4 = _mm_add_ss(h4, _mm_shuffle_ps(h4, h4, 1));
    s = (double)_mm_cvtss_f32(h4);
#else
    float acc[64];
    for (int i = 0; i < 64; i++) acc[i] = q16[i] * (float)k[i];
    for (int64_t c = 64; c < n_main; c += 64)
        for (int i = 0; i < 64; i++) acc[i] = acc[i] + q16[c + i] * (float)k[c + i];
    float lanes[16];
    for (int i = 0; i < 16; i++) lanes[i] = (acc[i] + acc[32 + i]) + (acc[16 + i] + acc[48 + i]);
    s = (double)reduce_add16(lanes);
#endif
    for (int64_t i = n_main; i < dh; i++) s += (double)(q16[i] * (float)k[i]);
    return (float)s;
}

// the F16 accumulator's two steps, acc holding F16 values as f32: acc = f16(acc * ms) and
// acc = f16(fma(v, vs, acc))
static inline void acc_scale_f16(float *acc, int64_t dh, float ms) {
    int64_t d = 0;
#if LANES_AVX2
    const __m256 m = _mm256_set1_ps(ms);
    for (; d + 8 <= dh; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(acc + d), m),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
#endif
    for (; d < dh; d++) acc[d] = (float)(f16)(acc[d] * ms);
}

static inline void acc_mad_f16(float *acc, const f16 *v, int64_t dh, float vs) {
    int64_t d = 0;
#if LANES_AVX2
    const __m256 s = _mm256_set1_ps(vs);
    for (; d + 8 <= dh; d += 8) {
        const __m256 y = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + d))), s, _mm256_loadu_ps(acc + d));
        _mm256_storeu_ps(acc + d, _mm256_cvtph_ps(_mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    }
#endif
    for (; d < dh; d++) acc[d] = (float)(f16)fmaf((float)v[d], vs, acc[d]);
}

typedef struct {                                       // an attention call's arguments
    const float *q;
    const f16 *k, *v;
    int64_t n_head, n_head_kv, dh, pos0, n_kv;
    float scale;
    float *out, *kq, *kt;
} attn_args;

// the one-chunk path (fewer than 64 query rows): F16 Q, position by position, F16 accumulator
static void attn_f16_chunk(const void *ctx, int64_t r0, int64_t r1, int worker) {
    const attn_args *A = ctx;
    const f16 *k = A->k, *v = A->v;
    const int64_t n_head = A->n_head, dh = A->dh, g = A->n_head / A->n_head_kv, kv_row = A->n_head_kv * A->dh;
    const float scale = A->scale;
    (void)worker;
    for (int64_t r = r0; r < r1; r++) {
        float q16[1024], acc[1024];
        const int64_t t = r / n_head, h = r % n_head, kh = h / g;
        const float *qr = A->q + r * dh;
        for (int64_t d = 0; d < dh; d++) q16[d] = (float)(f16)qr[d];
        for (int64_t d = 0; d < dh; d++) acc[d] = 0.0f;
        float m = -INFINITY, s_run = 0.0f;
        const int64_t n_see = A->pos0 + t + 1;
        for (int64_t l = 0; l < n_see; l++) {
            const f16 *kl = k + l * kv_row + kh * dh, *vl = v + l * kv_row + kh * dh;
            float s = dot_f16(q16, kl, dh) * scale;
            float ms = 1.0f, vs = 1.0f;
            if (s > m) {                           // a new max: rescale what came before
                ms = expf(m - s);
                acc_scale_f16(acc, dh, ms);
                s_run = fmaf(s_run, ms, vs);
                m = s;
            } else {
                vs = expf(s - m);
                s_run = s_run + vs;
            }
            acc_mad_f16(acc, vl, dh, vs);
        }
        const float inv = s_run == 0.0f ? 0.0f : 1.0f / s_run;
        float *o = A->out + r * dh;
        for (int64_t d = 0; d < dh; d++) o[d] = acc[d] * inv;
    }
}

void attn_f16(const float *q, const f16 *k, const f16 *v, int64_t n_head, int64_t n_head_kv, int64_t dh,
              int64_t pos0, float scale, float *out, int64_t n_rows, int nth) {
    const attn_args A = {.q = q, .k = k, .v = v, .n_head = n_head, .n_head_kv = n_head_kv, .dh = dh, .pos0 = pos0,
                         .scale = scale, .out = out};
    pool_run(attn_f16_chunk, &A, n_rows, 1, nth);
}

// the tiled path (64 query rows or more): F32, online softmax over tiles of 64 positions;
// kq holds n_kv scores per thread, kt K widened to f32 in blocks of 8 positions [Hkv][L/8][Dh][8]
// One tile's softmax step: 0 where the row sees none of its positions; else the weights y [64]
// (ggml_v_expf of score - the new max; 0 past the tile), the running max and sum moved on, and
// *ms the factor the accumulator takes first (1 where the max did not grow: no multiply needed).
static inline int attn_tile_weights(const float *kq, int64_t n_tile, float *m_run, float *s_run, float *m_out,
                                    float *ms, float *y) {
    float tmax = -INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    if (n_tile == 64) {                                // the max in any order (a NaN score skipped as below)
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (; i < 64; i += 16) mx = _mm512_max_ps(_mm512_loadu_ps(kq + i), mx);
        tmax = _mm512_reduce_max_ps(mx);
    }
#endif
    for (; i < n_tile; i++) tmax = kq[i] > tmax ? kq[i] : tmax;
    if (tmax == -INFINITY) return 0;
    const float m_new = *m_run > tmax ? *m_run : tmax;
    *ms = 1.0f;
    if (m_new > *m_run) {
        *ms = expf(*m_run - m_new);
        *s_run = *s_run * *ms;
    }
    *m_run = *m_out = m_new;
    int i0 = 0;
#if defined(__AVX512F__)
    if (n_tile == 64)                                  // v_expf16: v_expf1 on 16 lanes, the same bits
        for (; i0 < 64; i0 += 16)
            _mm512_storeu_ps(y + i0, v_expf16(_mm512_sub_ps(_mm512_loadu_ps(kq + i0), _mm512_set1_ps(m_new))));
#endif
    for (int i = i0; i < 64; i++) y[i] = v_expf1((i < n_tile ? kq[i] : -INFINITY) - m_new);
    double total = 0.0;                                // ggml_vec_soft_max_f32: chunk sums in double
    for (int i = 0; i < 64; i += 16) total += (double)reduce_add16(y + i);
    *s_run = (float)((double)*s_run + total);
    return 1;
}

// A row's scores kq [n_kv] (masked: -inf) -> its output: per tile of 64 positions the online
// softmax (ggml_v_expf, the tile's sum in double) and VKQ += KQ[j] * V[j] in position order.
// The VKQ accumulator in memory (any head size up to 1024):
static void attn_f32_values_any(const float *kq, const f16 *v, int64_t kv_row, int64_t n_kv, float *o, int64_t dh,
                                float *acc) {
    float y[64];
    for (int64_t d = 0; d < dh; d++) acc[d] = 0.0f;
    float m_run = -INFINITY, s_run = 0.0f;
    for (int64_t c = 0; c < n_kv; c += 64) {
        const int64_t n_tile = n_kv - c < 64 ? n_kv - c : 64;
        float m_new, ms;
        if (!attn_tile_weights(kq + c, n_tile, &m_run, &s_run, &m_new, &ms, y)) continue;
        if (ms != 1.0f)
            for (int64_t d = 0; d < dh; d++) acc[d] = acc[d] * ms;
        for (int64_t j = 0; j < n_tile; j++) {
            const f16 *vl = v + (c + j) * kv_row;
            int64_t d = 0;
#if LANES_AVX2
            const __m256 yj = _mm256_set1_ps(y[j]);
            for (; d + 8 <= dh; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(yj, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vl + d))),
                                                          _mm256_loadu_ps(acc + d)));
#endif
            for (; d < dh; d++) acc[d] = fmaf(y[j], (float)vl[d], acc[d]);
        }
    }
    const float inv = s_run == 0.0f ? 0.0f : 1.0f / s_run;
    for (int64_t d = 0; d < dh; d++) o[d] = acc[d] * inv;
}

#if LANES_AVX2
// The same with the accumulator in registers (DH a constant: 64 or 128), where the memory form
// spent half of a prompt's attention on its load-store chain.
static inline __attribute__((always_inline)) void attn_f32_values(const float *kq, const f16 *v, int64_t kv_row,
                                                                  int64_t n_kv, float *o, const int DH) {
    float y[64];
    __m256 acc[DH / 8];
    for (int i = 0; i < DH / 8; i++) acc[i] = _mm256_setzero_ps();
    float m_run = -INFINITY, s_run = 0.0f;
    for (int64_t c = 0; c < n_kv; c += 64) {
        const int64_t n_tile = n_kv - c < 64 ? n_kv - c : 64;
        float m_new, ms;
        if (!attn_tile_weights(kq + c, n_tile, &m_run, &s_run, &m_new, &ms, y)) continue;
        if (ms != 1.0f) {
            const __m256 msv = _mm256_set1_ps(ms);
            for (int i = 0; i < DH / 8; i++) acc[i] = _mm256_mul_ps(acc[i], msv);
        }
        for (int64_t j = 0; j < n_tile; j++) {
            const f16 *vl = v + (c + j) * kv_row;
            const __m256 yj = _mm256_set1_ps(y[j]);
            for (int i = 0; i < DH / 8; i++)
                acc[i] = _mm256_fmadd_ps(yj, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vl + 8 * i))), acc[i]);
        }
    }
    const __m256 inv = _mm256_set1_ps(s_run == 0.0f ? 0.0f : 1.0f / s_run);
    for (int i = 0; i < DH / 8; i++) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(acc[i], inv));
}
#endif

static void attn_f32_chunk(const void *ctx, int64_t r0, int64_t r1, int worker) {
    const attn_args *A = ctx;
    const f16 *k = A->k, *v = A->v;
    const int64_t n_head = A->n_head, dh = A->dh, n_kv = A->n_kv, g = A->n_head / A->n_head_kv;
    const int64_t kv_row = A->n_head_kv * A->dh;
    const float scale = A->scale;
    float *kq = A->kq + worker * n_kv;
    for (int64_t r = r0; r < r1; r++) {
        float acc[1024];
        const int64_t t = r / n_head, h = r % n_head, kh = h / g;
        const float *qr = A->q + r * dh;
        const int64_t n_see = A->pos0 + t + 1;
        int64_t l = 0;
#if LANES_AVX2
        // eight groups of eight positions at once where the first sees some position: the same
        // chains, side by side, so the fmas' latency overlaps instead of each waiting for the last
        for (; l + 64 <= n_kv && l < n_see; l += 64) {   // (groups past the row's last position: masked below)
            const float *kt = A->kt + (kh * (n_kv / 8) + l / 8) * dh * 8;   // 8 x [Dh][8] as f32
            const int64_t gs = dh * 8;
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
            for (int64_t d = 0; d < dh; d++) {
                const __m256 qd = _mm256_set1_ps(qr[d]);
                const float *kd = kt + 8 * d;
                s0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd), s0);
                s1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + gs), s1);
                s2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 2 * gs), s2);
                s3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 3 * gs), s3);
                s4 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 4 * gs), s4);
                s5 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 5 * gs), s5);
                s6 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 6 * gs), s6);
                s7 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 7 * gs), s7);
            }
            float sv[64];
            _mm256_storeu_ps(sv, s0); _mm256_storeu_ps(sv + 8, s1); _mm256_storeu_ps(sv + 16, s2);
            _mm256_storeu_ps(sv + 24, s3); _mm256_storeu_ps(sv + 32, s4); _mm256_storeu_ps(sv + 40, s5);
            _mm256_storeu_ps(sv + 48, s6); _mm256_storeu_ps(sv + 56, s7);
            for (int i = 0; i < 64; i++) kq[l + i] = l + i < n_see ? sv[i] * scale : -INFINITY;
        }
#endif
        for (; l + 8 <= n_kv; l += 8) {           // simd_gemm: one fma chain over Dh from 0 per
            if (l >= n_see) {                      // position; eight positions' chains side by side
                for (int i = 0; i < 8; i++) kq[l + i] = -INFINITY;   // masked whatever the sums
                continue;
            }
            const float *kt = A->kt + (kh * (n_kv / 8) + l / 8) * dh * 8;   // [Dh][8] as f32
#if LANES_AVX2
            __m256 s = _mm256_setzero_ps();
            for (int64_t d = 0; d < dh; d++) s = _mm256_fmadd_ps(_mm256_set1_ps(qr[d]), _mm256_loadu_ps(kt + 8 * d), s);
            float sv[8];
            _mm256_storeu_ps(sv, s);
#else
            float sv[8] = {0};
            for (int64_t d = 0; d < dh; d++)
                for (int i = 0; i < 8; i++) sv[i] = fmaf(qr[d], kt[8 * d + i], sv[i]);
#endif
            for (int i = 0; i < 8; i++) kq[l + i] = l + i < n_see ? sv[i] * scale : -INFINITY;
        }
        for (; l < n_kv; l++) {
            const f16 *kl = k + l * kv_row + kh * dh;
            float s = 0.0f;
            for (int64_t d = 0; d < dh; d++) s = fmaf(qr[d], (float)kl[d], s);
            kq[l] = l < n_see ? s * scale : -INFINITY;
        }
        float *o = A->out + r * dh;
#if LANES_AVX2
        if (dh == 64) attn_f32_values(kq, v + kh * dh, kv_row, n_kv, o, 64);
        else if (dh == 128) attn_f32_values(kq, v + kh * dh, kv_row, n_kv, o, 128);
        else
#endif
        attn_f32_values_any(kq, v + kh * dh, kv_row, n_kv, o, dh, acc);
    }
}

void attn_f32(const float *q, const f16 *k, const f16 *v, int64_t n_head, int64_t n_head_kv, int64_t dh,
              int64_t pos0, int64_t n_kv, float scale, float *out, int64_t n_rows, float *kq_all, float *kt, int nth) {
    const attn_args A = {.q = q, .k = k, .v = v, .n_head = n_head, .n_head_kv = n_head_kv, .dh = dh, .pos0 = pos0,
                         .n_kv = n_kv, .scale = scale, .out = out, .kq = kq_all, .kt = kt};
    for (int64_t kh = 0; kh < n_head_kv; kh++)    // exact: every F16 value is an f32
        for (int64_t l = 0; l < n_kv - n_kv % 8; l++)
            for (int64_t d = 0; d < dh; d++)
                kt[((kh * (n_kv / 8) + l / 8) * dh + d) * 8 + l % 8] = (float)k[(l * n_head_kv + kh) * dh + d];
    pool_run(attn_f32_chunk, &A, n_rows, 1, nth);
}

// ---- ggml_vec_swiglu_f32 (AVX-512 build): x / (1 + e^-x) * g, ggml_v_expf on each row's
// 16-wide chunks and the C library's expf on the tail. Rows 0..n_rows of [rows, n].
typedef struct {
    const float *x, *g;
    float *out;
    int64_t n;
} swiglu_args;


static void swiglu_chunk(const void *ctx, int64_t r0, int64_t r1, int worker) {
    const swiglu_args *S = ctx;
    const int64_t n = S->n;
    (void)worker;
    for (int64_t r = r0; r < r1; r++) lanes_swiglu(S->x + r * n, S->g + r * n, S->out + r * n, n, 0, n);
}

void swiglu(const float *x, const float *g, float *out, int64_t n, int64_t n_rows, int nth) {
    const swiglu_args S = {.x = x, .g = g, .out = out, .n = n};
    pool_run(swiglu_chunk, &S, n_rows, 1, n_rows * n >= 16384 ? nth : 1);
}

// ---- ggml_compute_forward_rms_norm_f32 and the fused mul: squares in f32 summed in double in
// order, mean = f32(sum / n), scale = 1 / sqrtf(mean + eps), out = (x * scale) * w. x, out [T, N]
// (out may be x); w [N], or NULL for no mul.
void rms_norm(const float *x, const float *w, float *out, int64_t t, int64_t n, float eps) {
    for (int64_t r = 0; r < t; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)n);
        const float scale = 1.0f / sqrtf(mean + eps);
        if (w)
            for (int64_t i = 0; i < n; i++) o[i] = (xr[i] * scale) * w[i];
        else
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * scale;
    }
}

// ---- ggml rope, NEOX mode, in place: x [T, H, Dh], pairs (i, i + n_rot/2) of each head turned by
// cos, sin [T, n_rot/2] (ggml's cache); rotate_pairs compiles to fma(x0, cos, -(x1*sin)) and
// fma(x0, sin, x1*cos), the second product rounded to f32
void rope_neox(float *x, int64_t t, int64_t h, int64_t dh, int64_t n_rot, const float *cs, const float *sn) {
    const int64_t half = n_rot / 2;
    for (int64_t r = 0; r < t; r++)
        for (int64_t j = 0; j < h; j++) {
            float *v = x + (r * h + j) * dh;
            const float *c = cs + r * half, *s = sn + r * half;
            for (int64_t i = 0; i < half; i++) {
                const float x0 = v[i], x1 = v[i + half];
                v[i] = fmaf(x0, c[i], -(x1 * s[i]));
                v[i + half] = fmaf(x0, s[i], x1 * c[i]);
            }
        }
}

// ---- the decode rows of every busy slot through dense attention + SwiGLU layers, in one call ----
// The same kernels, in the same order, as the numpy backend's ops for T rows, each row its own
// slot's next position (layers.attention then layers.swiglu_ffn): RMSNorm; Q, K, V products of one
// quantized input (+ biases); NEOX RoPE of q and k at each row's position; each row's k, v rounded
// to F16 into its slot at its position and its attention over that slot's positions 0..pos (the
// one-chunk F16 path, a call per row as the ops' spans); the O product + the residual; RMSNorm; gate
// and up of one quantized input; swiglu; down + the residual. The products take all T rows at once
// (each weight read once for every slot), in the kernels' order for T rows: Q4_K's gemm rows
// t - t % 4 (formats: _q4_K_gemm_rows), Q6_K tiled from 8 rows (k_quants.TILED_MIN_T). Only the
// Python between the kernels is gone (a decode layer was about 15 ctypes calls; now every layer of a
// step is one). Weight types: 8 Q8_0, 6 Q5_0, 12 Q4_K (rows in eights), 14 Q6_K.
enum { DL_Q, DL_K, DL_V, DL_O, DL_GATE, DL_UP, DL_DOWN, DL_N };
#define DL_Q6K_TILED_MIN_T 8                           // k_quants.TILED_MIN_T

typedef struct {
    const float *attn_norm, *ffn_norm;
    const float *bias[3];                              // Q, K, V biases, or NULL
    const uint8_t *w[DL_N];
    int64_t wtype[DL_N];
    f16 *kc, *vc;                                      // this layer's slot 0 at position 0: [n_ctx, Hkv, Dh]
    const float *q_norm, *k_norm;                      // per-head RMSNorm of q and k [Dh] (qwen3), or NULL
    // a routed FFN half (qwen3moe) in place of gate / up / down when router is not NULL
    const float *router;                               // [E, D] F32
    int64_t n_expert, n_used, norm_weights, n_ff_exp;
    const uint8_t *exps[3];                            // gate, up, down stacks: expert e at exps[i] + e * exps_bytes[i]
    int64_t exps_type[3], exps_bytes[3];
} dlayer_t;

typedef struct {
    int64_t n_embd, n_head, n_head_kv, head_dim, n_rot, n_ff, n_rows;
    const int64_t *pos;                                // [n_rows] each row's position
    const int64_t *kv_slot;                            // [n_rows] its slot's offset from kc, vc: slot * n_ctx * Hkv * Dh
    float eps, scale;
    const float *cos, *sin;                            // [n_rows, n_rot/2] at each row's position
    int nth;
} dstep_t;

typedef struct {                                       // one input [t, k] quantized for its products
    const float *x;                                    // the input, its non-finite rows zeroed (formats.CAct)
    int64_t t, k, q8k_gemm;                            // q8k_gemm: the t_gemm the Q8_K form was made with, or -1
    int n_bad, have_q80;
    const uint8_t *bad;                                // [t] rows whose outputs are NaN
    int8_t *q;
    float *d;
    int16_t *bsums;
    uint8_t *wins;                                     // [t] scratch: quant_q8_K's tie rule per row
} dact_t;

typedef struct {                                       // decode_layers' scratch, sized once a call
    float *xz;
    uint8_t *bad, *wins;
    int8_t *q;
    float *d;
    int16_t *bsums;
} dscratch_t;

// scratch for inputs of up to t rows of k; 0, or -1 where some buffer is not there (all freed then)
static void dscratch_free(dscratch_t *sc) {
    free(sc->xz);
    free(sc->bad);
    free(sc->wins);
    free(sc->q);
    free(sc->d);
    free(sc->bsums);
}

static int dscratch_alloc(dscratch_t *sc, int64_t t, int64_t k) {
    *sc = (dscratch_t){.xz = malloc(sizeof(float) * (size_t)(t * k)), .bad = malloc((size_t)t),
                       .wins = malloc((size_t)t), .q = malloc((size_t)(t * k)),
                       .d = malloc(sizeof(float) * (size_t)(t * (k / 32 + 1))),
                       .bsums = malloc(sizeof(int16_t) * (size_t)(t * (k / 16 + 1)))};
    if (sc->xz && sc->bad && sc->wins && sc->q && sc->d && sc->bsums) return 0;
    dscratch_free(sc);
    return -1;
}

static void dact_init(dact_t *a, const float *x, int64_t t, int64_t k, const dscratch_t *sc) {
    uint8_t *bad = sc->bad;
    a->x = x;
    a->t = t;
    a->k = k;
    a->q8k_gemm = -1;
    a->have_q80 = 0;
    a->n_bad = 0;
    a->bad = bad;
    a->q = sc->q;
    a->d = sc->d;
    a->bsums = sc->bsums;
    a->wins = sc->wins;
    for (int64_t r = 0; r < t; r++) {
        bad[r] = 0;
        for (int64_t i = 0; i < k; i++)
            if (!isfinite(x[r * k + i])) bad[r] = 1;
        a->n_bad += bad[r];
    }
    if (a->n_bad) {                                    // formats.CAct: such a row's output is NaN
        for (int64_t r = 0; r < t; r++)
            for (int64_t i = 0; i < k; i++) sc->xz[r * k + i] = bad[r] ? 0.0f : x[r * k + i];
        a->x = sc->xz;
    }
}

// out [t, n_rows] = x @ w^T, as formats.dot_c for t rows (per_row: mul_mat_id's, Q4_K's gemv for
// every row); threads as formats.c_threads
static void dprod_rows(dact_t *a, const uint8_t *w, int64_t type, int64_t n_rows, float *out, int nth, int per_row) {
    const int64_t k = a->k, t = a->t;
    const int n_threads = t * n_rows * k >= (1 << 16) ? nth : 1;
    if (type == 8 || type == 6) {
        if (!a->have_q80) {
            quant_q8_0(a->x, t, k, a->q, a->d);
            a->have_q80 = 1;
            a->q8k_gemm = -1;
        }
        q80_mm(w, type == 8 ? 0 : 1, n_rows, k / 32, a->q, a->d, t, out, n_rows, n_threads);
    } else {
        const int64_t t_gemm = type == 12 && !per_row ? t - t % 4 : 0;
        if (a->q8k_gemm != t_gemm) {
            for (int64_t r = 0; r < t; r++) a->wins[r] = r < t_gemm;
            quant_q8_K(a->x, t, k, a->wins, a->q, a->d, a->bsums);
            a->q8k_gemm = t_gemm;
            a->have_q80 = 0;
        }
        if (type == 14)
            q6k_mm(w, n_rows, k / 256, a->q, a->d, a->bsums, t, t >= DL_Q6K_TILED_MIN_T, out, n_rows, n_threads);
        else if (type == 13)
            q5k_mm(w, n_rows, k / 256, a->q, a->d, a->bsums, t, t >= DL_Q6K_TILED_MIN_T, out, n_rows, n_threads);
        else
            q4k_mm(w, n_rows, k / 256, a->q, a->d, a->bsums, t, t_gemm, out, n_rows, n_threads);
    }
    if (a->n_bad)
        for (int64_t r = 0; r < t; r++)
            if (a->bad[r])
                for (int64_t i = 0; i < n_rows; i++) out[r * n_rows + i] = NAN;
}

static void dprod(dact_t *a, const uint8_t *w, int64_t type, int64_t n_rows, float *out, int nth) {
    dprod_rows(a, w, type, n_rows, out, nth, 0);
}

// ---- an F32 weight's product in llama.cpp's order (quant/floats.py dot_f32_llama): out [T, N] =
// x [T, K] . w [N, K]. T >= 2 with N % 4 == 0: tinyBLAS's one 16-lane accumulator over 16-wide steps
// (a partial last step adds zero products), its lanes by halves; otherwise ggml_vec_dot_f32: four
// 16-lane accumulators over 64-wide steps, (0 + 2) + (1 + 3), the lanes by halves, then the tail one
// fma at a time.
static void dot_f32_span(const float *x, int64_t t, int64_t k, const float *w, int64_t n, int tiny, int64_t j0,
                         int64_t j1, float *out) {
    const int64_t k_main = k - k % 64;
    for (int64_t r = 0; r < t; r++) {
        const float *xr = x + r * k;
        for (int64_t j = j0; j < j1; j++) {
            const float *wr = w + j * k;
            float res;
            if (tiny) {
                float acc[16] = {0};
                for (int64_t c = 0; c < k; c += 16)
                    for (int l = 0; l < 16; l++) {
                        const int in = c + l < k;
                        acc[l] = fmaf(in ? xr[c + l] : 0.0f, in ? wr[c + l] : 0.0f, acc[l]);
                    }
                res = reduce_add16(acc);
            } else {
                float acc[64] = {0}, s4[16];
                for (int64_t c = 0; c < k_main; c += 64)
                    for (int l = 0; l < 64; l++) acc[l] = fmaf(xr[c + l], wr[c + l], acc[l]);
                for (int l = 0; l < 16; l++) s4[l] = (acc[l] + acc[32 + l]) + (acc[16 + l] + acc[48 + l]);
                res = reduce_add16(s4);
                for (int64_t i = k_main; i < k; i++) res = fmaf(xr[i], wr[i], res);
            }
            out[r * n + j] = res;
        }
    }
}

static void dot_f32_rows(const float *x, int64_t t, int64_t k, const float *w, int64_t n, float *out) {
    dot_f32_span(x, t, k, w, n, t >= 2 && n % 4 == 0, 0, n, out);
}

typedef struct {
    const float *x, *w;
    int64_t t, k, n;
    int tiny;
    float *out;
} f32_args;

static void f32_chunk(const void *ctx, int64_t j0, int64_t j1, int worker) {
    const f32_args *F = (const f32_args *)ctx;
    (void)worker;
    dot_f32_span(F->x, F->t, F->k, F->w, F->n, F->tiny, j0, j1, F->out);
}

// out [T, N] = x [T, K] . w [N, K] (an F32 weight) in llama.cpp's order, the weight's rows over the threads
void f32_mm(const float *x, int64_t t, int64_t k, const float *w, int64_t n, float *out, int nth) {
    const f32_args F = {.x = x, .w = w, .t = t, .k = k, .n = n, .tiny = t >= 2 && n % 4 == 0, .out = out};
    pool_run(f32_chunk, &F, n, grain_for(n, nth, 1), t * n * k >= (1 << 16) ? nth : 1);
}

// numpy's sum of float32 values in double (its pairwise_sum under 128 values): in order from 0 below
// 8 values, else 8 running sums ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) and the rest in order
static double np_sum_f64(const float *v, int64_t n) {
    if (n < 8) {
        double res = 0.0;
        for (int64_t i = 0; i < n; i++) res += (double)v[i];
        return res;
    }
    double r[8];
    for (int j = 0; j < 8; j++) r[j] = (double)v[j];
    int64_t i = 8;
    for (; i < n - n % 8; i += 8)
        for (int j = 0; j < 8; j++) r[j] += (double)v[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) res += (double)v[i];
    return res;
}

// The router's choice for each row (NumpyOps.moe_route): ggml_soft_max over the E logits z (exp of
// z - max by ggml_v_expf on 16-wide chunks and expf on the tail, summed in double: each chunk's lanes
// by halves in f32, chunks and tail values in order), p scaled by f32(1 / sum); ids the A largest p,
// ties to the lower id, NaN last (a stable argsort of -p); wts = p[ids], with norm_weights divided by
// max(f32(their sum as numpy adds them), 2^-14). p [E] is scratch.
static void route_rows(const float *z, int64_t t, int64_t n_exp, int64_t n_used, int norm, float *p,
                       uint8_t *taken, int32_t *ids, float *wts) {
    const int64_t n_vec = n_exp - n_exp % 16;
    for (int64_t r = 0; r < t; r++) {
        const float *zr = z + r * n_exp;
        float m = -INFINITY;
        int nan = 0;
        for (int64_t i = 0; i < n_exp; i++) {
            if (isnan(zr[i])) nan = 1;
            else if (zr[i] > m) m = zr[i];
        }
        if (nan) m = NAN;
        for (int64_t i = 0; i < n_vec; i++) p[i] = v_expf1(zr[i] - m);
        for (int64_t i = n_vec; i < n_exp; i++) p[i] = expf(zr[i] - m);
        double total = 0.0;
        for (int64_t c = 0; c < n_vec; c += 16) total += (double)reduce_add16(p + c);
        for (int64_t i = n_vec; i < n_exp; i++) total += (double)p[i];
        const float inv = (float)(1.0 / total);
        for (int64_t i = 0; i < n_exp; i++) {
            p[i] = p[i] * inv;
            taken[i] = 0;
        }
        int32_t *ir = ids + r * n_used;
        float *wr = wts + r * n_used;
        for (int64_t a = 0; a < n_used; a++) {
            int64_t best = -1;
            for (int64_t i = 0; i < n_exp; i++) {
                if (taken[i]) continue;
                if (best < 0 || (isnan(p[best]) && !isnan(p[i])) || (!isnan(p[i]) && p[i] > p[best])) best = i;
            }
            taken[best] = 1;
            ir[a] = (int32_t)best;
            wr[a] = p[best];
        }
        if (norm) {
            const float sum = (float)np_sum_f64(wr, n_used), lo = 6.103515625e-5f;
            const float by = sum > lo ? sum : (isnan(sum) ? sum : lo);
            for (int64_t a = 0; a < n_used; a++) wr[a] = wr[a] / by;
        }
    }
}

static int moe_half(const dlayer_t *L, const dstep_t *S, float *x, const float *h);

// one layer over x [T, D] in place (buf: scratch of decode_layers' size); 0, or -1 where a routed FFN's
// scratch could not be allocated
static int decode_layer(const dlayer_t *L, const dstep_t *S, float *x, float *buf, const dscratch_t *sc) {
    const int64_t D = S->n_embd, H = S->n_head, Hkv = S->n_head_kv, Dh = S->head_dim, F = S->n_ff, T = S->n_rows;
    const int64_t nq = H * Dh, nkv = Hkv * Dh;
    float *h = buf, *q = h + T * D, *k = q + T * nq, *v = k + T * nkv, *att = v + T * nkv, *y = att + T * nq;
    float *g = y + T * D, *u = g + T * F, *s = u + T * F;
    const int nth = S->nth;
    dact_t a;

    // attention half
    rms_norm(x, L->attn_norm, h, T, D, S->eps);
    dact_init(&a, h, T, D, sc);
    dprod(&a, L->w[DL_Q], L->wtype[DL_Q], nq, q, nth);
    dprod(&a, L->w[DL_K], L->wtype[DL_K], nkv, k, nth);
    dprod(&a, L->w[DL_V], L->wtype[DL_V], nkv, v, nth);
    float *qkv[3] = {q, k, v};
    const int64_t nqkv[3] = {nq, nkv, nkv};
    for (int i = 0; i < 3; i++)
        if (L->bias[i])
            for (int64_t r = 0; r < T; r++)
                for (int64_t j = 0; j < nqkv[i]; j++) qkv[i][r * nqkv[i] + j] = qkv[i][r * nqkv[i] + j] + L->bias[i][j];
    if (L->q_norm) rms_norm(q, L->q_norm, q, T * H, Dh, S->eps);
    if (L->k_norm) rms_norm(k, L->k_norm, k, T * Hkv, Dh, S->eps);
    rope_neox(q, T, H, Dh, S->n_rot, S->cos, S->sin);
    rope_neox(k, T, Hkv, Dh, S->n_rot, S->cos, S->sin);
    for (int64_t r = 0; r < T; r++) {                  // each row: its slot, its position
        f16 *k0 = L->kc + S->kv_slot[r], *v0 = L->vc + S->kv_slot[r];
        f16 *kc = k0 + S->pos[r] * nkv, *vc = v0 + S->pos[r] * nkv;
        for (int64_t j = 0; j < nkv; j++) {
            kc[j] = (f16)k[r * nkv + j];
            vc[j] = (f16)v[r * nkv + j];
        }
        attn_f16(q + r * nq, k0, v0, H, Hkv, Dh, S->pos[r], S->scale, att + r * nq, H, H > 1 ? nth : 1);
    }
    dact_init(&a, att, T, nq, sc);
    dprod(&a, L->w[DL_O], L->wtype[DL_O], D, y, nth);
    for (int64_t j = 0; j < T * D; j++) x[j] = y[j] + x[j];

    // FFN half
    rms_norm(x, L->ffn_norm, h, T, D, S->eps);
    if (L->router) {
        if (moe_half(L, S, x, h) != 0) return -1;
        return 0;
    }
    dact_init(&a, h, T, D, sc);
    dprod(&a, L->w[DL_GATE], L->wtype[DL_GATE], F, g, nth);
    dprod(&a, L->w[DL_UP], L->wtype[DL_UP], F, u, nth);
    swiglu(g, u, s, F, T, nth);
    dact_init(&a, s, T, F, sc);
    dprod(&a, L->w[DL_DOWN], L->wtype[DL_DOWN], D, y, nth);
    for (int64_t j = 0; j < T * D; j++) x[j] = y[j] + x[j];
    return 0;
}

// layers 0..n_layer of L over x [n_rows, n_embd] in place, one after another. Returns 0, or -1
// where some scratch could not be allocated (x untouched if it was the first; else part done).
int decode_layers(const dlayer_t *L, int64_t n_layer, const dstep_t *S, float *x) {
    const int64_t D = S->n_embd, nq = S->n_head * S->head_dim, nkv = S->n_head_kv * S->head_dim, F = S->n_ff;
    const int64_t T = S->n_rows;
    int64_t kmax = F > D ? F : D;
    kmax = kmax > nq ? kmax : nq;
    float *buf = malloc(sizeof(float) * (size_t)(T * (D + nq + 2 * nkv + nq + D + 3 * F)));
    dscratch_t sc;
    if (!buf || dscratch_alloc(&sc, T, kmax) != 0) {
        free(buf);
        return -1;
    }
    int rc = 0;
    for (int64_t il = 0; il < n_layer && rc == 0; il++) rc = decode_layer(L + il, S, x, buf, &sc);
    free(buf);
    dscratch_free(&sc);
    return rc;
}

// ---- a MoE layer's routed experts (ggml_mul_mat_id), one call --------------------------------
// As NumpyOps.moe_ffn's loop, expert by expert: the rows routed to expert e (in token order)
// through gate and up (one quantized input), swiglu, down, each output times its routing weight
// into out [T, A, D] at (token, rank); the caller adds the ranks in order. Products as
// mul_mat_id's: a Q4_K weight runs its gemv for every row (t_gemm 0). The experts are spread over
// the threads, each expert's products on one (an expert's product is too small to share: the
// hand-offs cost more than they save); no output depends on which thread ran it.
typedef struct {
    const uint8_t *w[3];                               // gate, up, down stacks: expert e at w + e * expert_bytes
    int64_t wtype[3], expert_bytes[3];
    int64_t n_embd, n_ff;                              // D, F (the expert's width)
    const float *x;                                    // [T, D]
    const int32_t *ids;                                // [T, A]
    const float *wts;                                  // [T, A]
    int64_t t, n_used;
    const int32_t *experts;                            // the distinct experts, ascending
    float *out;                                        // [T, A, D]
    int failed;
} moe_args_t;

// An expert's routed rows go through in chunks of at most MOE_CHUNK_ROWS (each row's products are the
// same bits in any chunk), so a worker's buffers are bounded whatever the routing: engine/cpu/sizes.py
// moe_call_bytes counts them, and moe_scratch_peak reports the most all workers held at once.
#define MOE_CHUNK_ROWS 64
static _Atomic int64_t moe_now, moe_top;

static void moe_held(int64_t bytes) {
    const int64_t v = atomic_fetch_add(&moe_now, bytes) + bytes;
    int64_t p = atomic_load(&moe_top);
    while (v > p && !atomic_compare_exchange_weak(&moe_top, &p, v)) {
    }
}

// The most bytes the MoE calls' workers held at once since the last reset (reset: start again from now).
int64_t moe_scratch_peak(int reset) {
    const int64_t p = atomic_load(&moe_top);
    if (reset) atomic_store(&moe_top, atomic_load(&moe_now));
    return p;
}

static void moe_chunk(const void *ctx, int64_t e0, int64_t e1, int worker) {
    moe_args_t *M = (moe_args_t *)ctx;
    (void)worker;
    const int64_t D = M->n_embd, F = M->n_ff, T = M->t, A = M->n_used, kmax = F > D ? F : D;
    for (int64_t ei = e0; ei < e1; ei++) {
        const int32_t e = M->experts[ei];
        int64_t n = 0;
        for (int64_t i = 0; i < T * A; i++) n += M->ids[i] == e;
        const int64_t m = n < MOE_CHUNK_ROWS ? n : MOE_CHUNK_ROWS;
        // as sizes.moe_call_bytes: the pair indices, then m rows of input, gate, up, swiglu, output and codes
        const int64_t bytes = 8 * n + m * (4 * (2 * D + 3 * F) + 5 * kmax + 2 + 4 * (kmax / 32 + 1) + 2 * (kmax / 16 + 1));
        int64_t *pairs = malloc(sizeof(int64_t) * (size_t)n);
        float *buf = malloc(sizeof(float) * (size_t)(m * (D + 3 * F + D)));
        dscratch_t sc;
        moe_held(bytes);
        if (!pairs || !buf || dscratch_alloc(&sc, m, kmax) != 0) {
            M->failed = 1;
        } else {
            int64_t j = 0;
            for (int64_t i = 0; i < T * A; i++)        // np.nonzero(ids == e): token order, then rank
                if (M->ids[i] == e) pairs[j++] = i;
            float *xe = buf, *g = xe + m * D, *u = g + m * F, *s = u + m * F, *y = s + m * F;
            for (int64_t c0 = 0; c0 < n; c0 += m) {
                const int64_t k = n - c0 < m ? n - c0 : m;
                const int64_t *pc = pairs + c0;
                for (int64_t r = 0; r < k; r++) memcpy(xe + r * D, M->x + (pc[r] / A) * D, sizeof(float) * (size_t)D);
                dact_t a;
                dact_init(&a, xe, k, D, &sc);
                dprod_rows(&a, M->w[0] + e * M->expert_bytes[0], M->wtype[0], F, g, 1, 1);
                dprod_rows(&a, M->w[1] + e * M->expert_bytes[1], M->wtype[1], F, u, 1, 1);
                swiglu(g, u, s, F, k, 1);
                dact_init(&a, s, k, F, &sc);
                dprod_rows(&a, M->w[2] + e * M->expert_bytes[2], M->wtype[2], D, y, 1, 1);
                for (int64_t r = 0; r < k; r++) {
                    const float wt = M->wts[pc[r]];
                    float *o = M->out + pc[r] * D;
                    for (int64_t i = 0; i < D; i++) o[i] = y[r * D + i] * wt;
                }
            }
            dscratch_free(&sc);
        }
        free(pairs);
        free(buf);
        moe_held(-bytes);
    }
}

// Returns 0, or -1 where some expert's scratch could not be allocated (out then incomplete).
int moe_ffn_rows(const uint8_t *const *w, const int64_t *wtype, const int64_t *expert_bytes, int64_t n_embd,
                 int64_t n_ff, const float *x, int64_t t, const int32_t *ids, const float *wts, int64_t n_used,
                 const int32_t *experts, int64_t n_experts, float *out, int nth) {
    moe_args_t M = {.n_embd = n_embd, .n_ff = n_ff, .x = x, .ids = ids, .wts = wts, .t = t, .n_used = n_used,
                    .experts = experts, .out = out, .failed = 0};
    for (int i = 0; i < 3; i++) {
        M.w[i] = w[i];
        M.wtype[i] = wtype[i];
        M.expert_bytes[i] = expert_bytes[i];
    }
    pool_run(moe_chunk, &M, n_experts, 1, nth);
    return M.failed ? -1 : 0;
}

// decode_layers' routed FFN half (layers.moe_ffn on the ops): the router over h (x's RMSNorm), each
// row's experts (route_rows), their weighted outputs (moe_chunk, as moe_ffn_rows), then per row the
// A outputs added in rank order and the residual x added, in place. 0, or -1 (no scratch; x untouched).
static int moe_half(const dlayer_t *L, const dstep_t *S, float *x, const float *h) {
    const int64_t T = S->n_rows, D = S->n_embd, E = L->n_expert, A = L->n_used;
    float *logits = malloc(sizeof(float) * (size_t)(T * E)), *p = malloc(sizeof(float) * (size_t)E);
    float *wts = malloc(sizeof(float) * (size_t)(T * A)), *out = malloc(sizeof(float) * (size_t)(T * A * D));
    uint8_t *taken = malloc((size_t)E);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * A)), *experts = malloc(sizeof(int32_t) * (size_t)E);
    int rc = -1;
    if (logits && p && wts && out && taken && ids && experts) {
        dot_f32_rows(h, T, D, L->router, E, logits);
        route_rows(logits, T, E, A, (int)L->norm_weights, p, taken, ids, wts);
        memset(taken, 0, (size_t)E);
        for (int64_t i = 0; i < T * A; i++) taken[ids[i]] = 1;
        int64_t n_ex = 0;
        for (int64_t e = 0; e < E; e++)
            if (taken[e]) experts[n_ex++] = (int32_t)e;              // np.unique: ascending
        moe_args_t M = {.n_embd = D, .n_ff = L->n_ff_exp, .x = h, .ids = ids, .wts = wts, .t = T, .n_used = A,
                        .experts = experts, .out = out, .failed = 0};
        for (int i = 0; i < 3; i++) {
            M.w[i] = L->exps[i];
            M.wtype[i] = L->exps_type[i];
            M.expert_bytes[i] = L->exps_bytes[i];
        }
        pool_run(moe_chunk, &M, n_ex, 1, S->nth);
        if (!M.failed) {
            for (int64_t r = 0; r < T; r++)
                for (int64_t i = 0; i < D; i++) {
                    float acc = out[(r * A) * D + i];
                    for (int64_t a = 1; a < A; a++) acc = acc + out[(r * A + a) * D + i];
                    x[r * D + i] = acc + x[r * D + i];
                }
            rc = 0;
        }
    }
    free(logits);
    free(p);
    free(wts);
    free(out);
    free(taken);
    free(ids);
    free(experts);
    return rc;
}
