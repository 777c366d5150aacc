// Host experts: one MoE layer's routed experts computed on the host from their stored GGUF
// blocks (bloomery/engine/cpu/host_moe.py compiles this with -O3 -march=native -ffp-contract=off
// -pthread and loads it). The cuda backend's decode steps hand their host part to the bell thread
// below ("the doorbell"), which calls host_moe() on a persistent args struct; tests and tools call
// it through ctypes (host_moe_layer).
//
// The products are the CPU backend's (kernels/lanes_dot.h, which kernels/cpu_lanes.c includes
// too): the input rows rounded as ggml's quantize_row_q8_K (Q4_K, Q5_K, Q6_K) or quantize_row_q8_0
// (Q8_0, Q5_0, Q4_0), each weight row read in place as stored (never decoded into a copy: the host
// is memory bound) against them in llama.cpp's float order for its type, swiglu with ggml_v_expf,
// its output rounded the same way for down. So each (token, slot)'s down output has the bits of
// the CPU backend's expert loop (cpu_lanes.c moe_chunk: ggml_mul_mat_id's products, Q4_K's gemv
// for every row, Q6_K and Q5_K tiled for 8 or more rows of one expert in a chunk of 64), and out is
// those outputs times their weights added in slot order, as the CPU backend adds them.
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

#include "lanes_dot.h"

#define HM_ISA (LANES_512 ? 2 : LANES_AVX2)      // 2 AVX-512 VNNI, 1 AVX2, 0 portable C

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
    case T_Q4_0: return Q4_0_BYTES;
    case T_Q5_0: return Q5_0_BYTES;
    case T_Q8_0: return Q8_0_BYTES;
    case T_Q4_K: return Q4_K_BYTES;
    case T_Q5_K: return Q5_K_BYTES;
    case T_Q6_K: return Q6_K_BYTES;
    default: return 0;
    }
}

// ---------------------------------------------------------------- activations
// A quantized activation row of length k, as lanes_dot.h's quantizers write it: the int8 quants
// [k], the f32 block scales [k / 32] (Q8_0) or [k / 256] (Q8_K), then Q8_K's int16 sums per 16
// [k / 16]; the row padded to 64 bytes.

enum { K_32 = 0, K_256 = 1 };                  // the weight's activation kind: Q8_0 or Q8_K

static inline int kind_of(int type) { return block_elems(type) == 32 ? K_32 : K_256; }
static inline int kind_block(int kind) { return kind == K_32 ? 32 : 256; }

static int64_t act_row_bytes(int kind, int64_t k) {
    const int64_t n = k + 4 * (k / kind_block(kind)) + (kind == K_256 ? k / 8 : 0);
    return (n + 63) & ~(int64_t)63;
}

static inline lanes_act act_at(const uint8_t *row, int kind, int64_t k) {
    return (lanes_act){.q = (const int8_t *)row, .d = (const float *)(row + k),
                       .bs = kind == K_256 ? (const int16_t *)(row + k + 4 * (k / 256)) : NULL};
}

// elements 256 c .. 256 c + len of a row of length k (one Q8_K block, or up to eight Q8_0 blocks),
// v its values there, into the activation row dst. Returns 1 where some value is not finite: the
// span is rounded as zeros and the row's outputs are to be NaN (as the CPU backend's, formats.CAct
// and cpu_lanes.c dact_init: such a row's products are NaN), else 0.
static int quantize_span(int kind, const float *v, int64_t len, int64_t k, uint8_t *dst, int64_t c) {
    int bad = 0;
    for (int64_t i = 0; i < len; i++) bad |= !isfinite(v[i]);
    float zero[256];
    if (bad) {
        memset(zero, 0, sizeof zero);
        v = zero;
    }
    int8_t *q = (int8_t *)dst + 256 * c;
    float *d = (float *)(dst + k);
    if (kind == K_256)
        lanes_q8_K_block(v, 0, q, d + c, (int16_t *)(dst + k + 4 * (k / 256)) + 16 * c);
    else
        for (int64_t b = 0; b < len / 32; b++) lanes_q8_0_block(v + 32 * b, q + 32 * b, d + 8 * c + b);
    return bad;
}

// ---------------------------------------------------------------- dot products
// Each weight type's lanes_dot.h product and its mode: the Q8_0 family's qtype; Q4_K's gemv
// (ggml_mul_mat_id runs the repacked Q4_K's gemv for every row); Q6_K's and Q5_K's lanes, or
// their tiled order where the expert's rows in the CPU backend's chunk are TILED_MIN_T or more.

#define MOE_CHUNK_ROWS 64        // cpu_lanes.c moe_chunk: an expert's routed rows, 64 at a time
#define TILED_MIN_T 8            // quant/k_quants.py TILED_MIN_T (cpu_lanes.c DL_Q6K_TILED_MIN_T)

typedef struct {
    lanes_dot_fn fn;
    int mode;                    // the mode, or for `tiled` types the lanes' (0)
    int tiled;                   // 1 for chunks of TILED_MIN_T rows and more
} hm_dot;

static int dot_of(int type, hm_dot *o) {
    switch (type) {
    case T_Q8_0: *o = (hm_dot){lanes_dot_q80, 0, 0}; return 1;
    case T_Q5_0: *o = (hm_dot){lanes_dot_q80, 1, 0}; return 1;
    case T_Q4_0: *o = (hm_dot){lanes_dot_q80, 2, 0}; return 1;
    case T_Q4_K: *o = (hm_dot){lanes_dot_q4k, 0, 0}; return 1;
    case T_Q5_K: *o = (hm_dot){lanes_dot_q5k, 0, 1}; return 1;
    case T_Q6_K: *o = (hm_dot){lanes_dot_q6k, 0, 1}; return 1;
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
    if (!block_elems(A->gate_type) || !block_elems(A->up_type) || !block_elems(A->down_type)) return 5;
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

// How a call is cut (tools/bench_host_moe.py --units): a phase of an expert's rows takes units of fewer rows
// (RC_GU and RC_DN halved, down to a quarter) until it has at least `units_per_thread` units a thread (0, the
// default: always RC_GU and RC_DN rows; BLOOMERY_HOST_UNITS as pool_init reads it). On the H200's host (session
// 25) 8 a thread against 0 was within the runs' spread at 1, 2 and 8 experts, in the kernel alone and in a step.
//
// A one-row product asks for the bytes `prefetch_bytes` ahead of each row it reads (into every cache level), and a
// unit for its first ones: on the H200's Xeon host one thread of the Q4_K product read 6.1-7.5 GB/s from memory
// without, 8.0-10.4 with 2 KiB ahead, and 14 threads at once 72-77 GB/s against 104-109 (the read test's
// figure); the hardware's own prefetch does not run far enough ahead of a core that also computes. The
// non-temporal hint instead made it slower (4.9-5.5 GB/s). BLOOMERY_HOST_PREFETCH sets the bytes (0: none).
#define UNITS_PER_THREAD 0
#define PREFETCH_BYTES 2048
static _Atomic int units_per_thread = UNITS_PER_THREAD, prefetch_bytes = PREFETCH_BYTES, tuning_set;

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) {
    const char *s = getenv("BLOOMERY_HOST_SPIN_US");
    if (!atomic_load(&spin_set)) atomic_store(&pool.spin_ns, (s && *s ? atoll(s) : 2000) * 1000);
    if (!atomic_load(&tuning_set)) {
        const char *u = getenv("BLOOMERY_HOST_UNITS"), *p = getenv("BLOOMERY_HOST_PREFETCH");
        if (u && *u) atomic_store(&units_per_thread, atoi(u) > 0 ? atoi(u) : 0);
        if (p && *p) atomic_store(&prefetch_bytes, atoi(p) > 0 ? atoi(p) : 0);
    }
    pthread_atfork(NULL, NULL, pool_after_fork);
}

// Set how calls are cut and how far ahead a one-row product asks for its bytes (units_per_thread and
// prefetch_bytes above); below 0 keeps a setting. Returns the settings before: units * 2^32 + bytes.
int64_t host_moe_set_tuning(int units, int prefetch) {
    pthread_once(&pool_once, pool_init);
    atomic_store(&tuning_set, 1);
    const int64_t was = (int64_t)atomic_load(&units_per_thread) << 32 | (int64_t)atomic_load(&prefetch_bytes);
    if (units >= 0) atomic_store(&units_per_thread, units);
    if (prefetch >= 0) atomic_store(&prefetch_bytes, prefetch);
    return was;
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
// rows; fewer in calls of few experts where units_per_thread asks), 2 swiglu + quantize (256
// elements of a pair's hidden row), 3 down into y [P, D] (an expert's RC_DN rows, the same), 4 out =
// sum over slots in order of wts * y (RC_OUT rows of a token).

#define RC_GU 16
#define RC_DN 32
#define RC_OUT 512

typedef struct {
    const host_moe_args *A;
    int NA, n_ex;
    int64_t D, F;
    int kg, ku, kd;                              // the activation kinds of gate, up, down
    int64_t xrow_g, xrow_u, hrow;
    int64_t x_units, gu_chunks, dn_chunks, out_chunks, h_units;  // per token / expert / expert / token / pair
    int64_t rc_gu, rc_dn;                        // rows a unit of phase 1 / 3 (units_per_thread)
    int64_t pf;                                  // prefetch_bytes
    hm_dot dg, du, dd;
    int64_t nbg, nbu, nbd;
    const int32_t *ex, *cnt, *start, *plist;
    uint8_t *xa_g, *xa_u, *ha;
    uint8_t *xbad, *hbad;                        // [T], [P]: a non-finite input row, hidden row
    float *g, *u, *y;
} layer;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// rows r0..r1 of one expert's matrix (rows of row_bytes, nb blocks) against the activation rows of
// its pairs pl[0..cnt): pair p's row is act + (p / div) * act_row (kind, length k), NaN for it where
// bad[p / div]; result r of pair p goes to dst[p * ld + r]. The pairs go LANES_NMAX at a time in
// order, within the CPU backend's chunks of MOE_CHUNK_ROWS, whose size picks the tiled order; a
// group's rows are read again from cache for the next group (an expert of 5+ rows in a call).
static void expert_rows(const hm_dot *dot, const uint8_t *w, int64_t row_bytes, int64_t nb, int64_t r0, int64_t r1,
                        const int32_t *pl, int cnt, int div, const uint8_t *act, int64_t act_row, int kind, int64_t k,
                        const uint8_t *bad, float *dst, int64_t ld, int64_t pf) {
    for (int c = 0; c < cnt;) {
        const int c0 = c - c % MOE_CHUNK_ROWS, c1 = cnt < c0 + MOE_CHUNK_ROWS ? cnt : c0 + MOE_CHUNK_ROWS;
        const int n = c1 - c < LANES_NMAX ? c1 - c : LANES_NMAX;
        const int mode = dot->tiled && c1 - c0 >= TILED_MIN_T ? 1 : dot->mode;
        lanes_act ap[LANES_NMAX];
        float *o[LANES_NMAX];
        int any_bad = 0;
        for (int j = 0; j < n; j++) {
            ap[j] = act_at(act + (int64_t)(pl[c + j] / div) * act_row, kind, k);
            o[j] = dst + (int64_t)pl[c + j] * ld;
            any_bad |= bad[pl[c + j] / div];
        }
        const lanes_dot_fn fn = dot->fn;
        if (n == 1) {                            // decode's common case: one row of activations
            if (pf > 0 && c == 0)                // the unit's first bytes, then each row's pf ahead
                for (int64_t b = 0; b < pf; b += 64) __builtin_prefetch(w + r0 * row_bytes + b, 0, 3);
            for (int64_t r = r0; r < r1; r++) {
                if (pf > 0)                      // past the stack's end a prefetch reads nothing
                    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(w + r * row_bytes + pf + b, 0, 3);
                fn(w + r * row_bytes, nb, mode, ap, 1, o[0] + r);
            }
        } else {
            for (int64_t r = r0; r < r1; r++) {
                float v[LANES_NMAX];
                fn(w + r * row_bytes, nb, mode, ap, n, v);
                for (int j = 0; j < n; j++) o[j][r] = v[j];
            }
        }
        if (any_bad)
            for (int j = 0; j < n; j++)
                if (bad[pl[c + j] / div])
                    for (int64_t r = r0; r < r1; r++) o[j][r] = NAN;
        c += n;
    }
}

static void layer_unit(const void *vctx, int phase, int64_t unit) {
    const layer *L = (const layer *)vctx;
    const host_moe_args *A = L->A;
    const int64_t D = L->D, F = L->F;
    if (phase == 0) {
        const int64_t t = unit / L->x_units, c = unit % L->x_units, len = min64(256, D - 256 * c);
        const float *v = A->x + t * D + 256 * c;
        int bad = quantize_span(L->kg, v, len, D, L->xa_g + t * L->xrow_g, c);
        if (L->xrow_u) bad |= quantize_span(L->ku, v, len, D, L->xa_u + t * L->xrow_u, c);
        if (bad) __atomic_store_n(L->xbad + t, 1, __ATOMIC_RELAXED);
    } else if (phase == 1) {
        const int64_t ei = unit / L->gu_chunks, r0 = unit % L->gu_chunks * L->rc_gu, r1 = min64(F, r0 + L->rc_gu);
        const int32_t e = L->ex[ei], *pl = L->plist + L->start[ei];
        expert_rows(&L->dg, A->gate[e], A->gate_row_bytes, L->nbg, r0, r1, pl, L->cnt[ei], L->NA, L->xa_g, L->xrow_g,
                    L->kg, D, L->xbad, L->g, F, L->pf);
        expert_rows(&L->du, A->up[e], A->up_row_bytes, L->nbu, r0, r1, pl, L->cnt[ei], L->NA, L->xrow_u ? L->xa_u : L->xa_g,
                    L->xrow_u ? L->xrow_u : L->xrow_g, L->ku, D, L->xbad, L->u, F, L->pf);
    } else if (phase == 2) {
        const int64_t p = L->plist[unit / L->h_units], c = unit % L->h_units, i0 = 256 * c, len = min64(256, F - i0);
        float s[256];
        lanes_swiglu(L->g + p * F + i0, L->u + p * F + i0, s, F - i0, 0, len);   // F % 32 == 0: its 16s are the row's
        if (quantize_span(L->kd, s, len, F, L->ha + p * L->hrow, c)) __atomic_store_n(L->hbad + p, 1, __ATOMIC_RELAXED);
    } else if (phase == 3) {
        const int64_t ei = unit / L->dn_chunks, r0 = unit % L->dn_chunks * L->rc_dn, r1 = min64(D, r0 + L->rc_dn);
        expert_rows(&L->dd, A->down[L->ex[ei]], A->down_row_bytes, L->nbd, r0, r1, L->plist + L->start[ei],
                    L->cnt[ei], 1, L->ha, L->hrow, L->kd, F, L->hbad, L->y, D, L->pf);
    } else {                                    // as the CPU backend: the first slot's w * y, then + w * y in order
        const int64_t t = unit / L->out_chunks, r0 = unit % L->out_chunks * RC_OUT, r1 = min64(D, r0 + RC_OUT);
        float *o = A->out + t * D;
        int first = 1;
        for (int a = 0; a < L->NA; a++) {
            const int64_t p = t * L->NA + a;
            if (A->skip[A->ids[p]]) continue;
            const float w = A->wts[p], *y = L->y + p * D;
            if (first)
                for (int64_t r = r0; r < r1; r++) o[r] = w * y[r];
            else
                for (int64_t r = r0; r < r1; r++) o[r] += w * y[r];
            first = 0;
        }
        if (first) memset(o + r0, 0, sizeof(float) * (size_t)(r1 - r0));
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
    layer L = {.A = A, .NA = NA, .D = D, .F = F, .kg = kind_of(A->gate_type), .ku = kind_of(A->up_type),
               .kd = kind_of(A->down_type), .nbg = D / block_elems(A->gate_type), .nbu = D / block_elems(A->up_type),
               .nbd = F / block_elems(A->down_type)};
    dot_of(A->gate_type, &L.dg);
    dot_of(A->up_type, &L.du);
    dot_of(A->down_type, &L.dd);
    L.xrow_g = act_row_bytes(L.kg, D);
    L.xrow_u = L.ku == L.kg ? 0 : act_row_bytes(L.ku, D);
    L.hrow = act_row_bytes(L.kd, F);
    const size_t n_int = up64(sizeof(int32_t) * (5 * (size_t)P + max_id + 1)), n_flags = up64((size_t)T + P);
    const size_t n_xa = up64((size_t)T * (L.xrow_g + L.xrow_u)), n_gu = up64(sizeof(float) * (size_t)P * F);
    const size_t n_ha = up64((size_t)P * L.hrow), n_y = up64(sizeof(float) * (size_t)P * D);
    pthread_mutex_lock(&pool.lock);
    uint8_t *base = scratch_get(n_int + n_flags + n_xa + 2 * n_gu + n_ha + n_y);
    if (!base) {
        pthread_mutex_unlock(&pool.lock);
        fail(A);
        return;
    }
    // X distinct host experts in order of first use, each with its pairs in order: ex [X],
    // cnt [X], start [X], plist [P]; slot [max_id + 1] maps an expert to its index in ex
    int32_t *ex = (int32_t *)base, *cnt = ex + P, *start = cnt + P, *plist = start + P, *fill = plist + P;
    int32_t *slot = fill + P;
    L.xbad = base + n_int;
    L.hbad = L.xbad + T;
    memset(L.xbad, 0, (size_t)T + P);
    L.xa_g = base + n_int + n_flags;
    L.xa_u = L.xrow_u ? L.xa_g + (size_t)T * L.xrow_g : L.xa_g;
    L.g = (float *)(L.xa_g + n_xa);
    L.u = (float *)((uint8_t *)L.g + n_gu);
    L.ha = (uint8_t *)L.u + n_gu;
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
    pthread_once(&pool_once, pool_init);
    const int nt = A->n_threads > 0 ? A->n_threads : n_cpus(), upt = atomic_load(&units_per_thread);
    L.rc_gu = RC_GU, L.rc_dn = RC_DN, L.pf = atomic_load(&prefetch_bytes);
    while (upt > 0 && L.rc_gu > RC_GU / 4 && (int64_t)n_ex * ceil_div(F, L.rc_gu) < (int64_t)upt * nt) L.rc_gu /= 2;
    while (upt > 0 && L.rc_dn > RC_DN / 4 && (int64_t)n_ex * ceil_div(D, L.rc_dn) < (int64_t)upt * nt) L.rc_dn /= 2;
    L.gu_chunks = ceil_div(F, L.rc_gu);
    L.dn_chunks = ceil_div(D, L.rc_dn);
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
