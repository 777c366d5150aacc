// Embedding rows, dequantization to f16 for the prompt GEMMs, and elementwise steps.
#include "common.cuh"
#include "blocks.cuh"


template <class T>
__device__ __forceinline__ void deq_item(const u8* row, int item, float* out) { T w; w.deq(row, item, out); }

// The IV values of work item `item` of `row` (IV = 64 for Q4_K/Q5_K, 32 for the others).
__device__ __forceinline__ int deq_any(int type, const u8* row, int item, float* out) {
    switch (type) {
        case T_Q4_K: deq_item<Q4K>(row, item, out); return 64;
        case T_Q5_K: deq_item<Q5K>(row, item, out); return 64;
        case T_Q6_K: deq_item<Q6K>(row, item, out); return 32;
        case T_Q8_0: deq_item<Q8_0>(row, item, out); return 32;
        case T_Q5_0: deq_item<Q5_0>(row, item, out); return 32;
        case T_Q4_0: deq_item<Q4_0>(row, item, out); return 32;
    }
    return 0;
}
__device__ __forceinline__ int item_values(int type) { return (type == T_Q4_K || type == T_Q5_K) ? 64 : 32; }
__device__ __forceinline__ float float_at(int type, const u8* row, int i) {
    return type == T_F32 ? F32W::get(row, i) : (type == T_F16 ? F16W::get(row, i) : BF16W::get(row, i));
}
__device__ __forceinline__ bool is_float(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }

// out [n_ids, K] float = rows ids of W. grid (n_ids), block 128.
extern "C" __global__ void get_rows(const u8* __restrict__ W, int type, i64 row_bytes, int K,
                                    const int* __restrict__ ids, float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    const u8* row = W + (i64)ids[blockIdx.x] * row_bytes;
    float* o = out + (i64)blockIdx.x * K;
    if (is_float(type)) {
        for (int i = threadIdx.x; i < K; i += blockDim.x) o[i] = float_at(type, row, i);
        return;
    }
    int iv = item_values(type);
    float v[64];
    for (int it = threadIdx.x; it < K / iv; it += blockDim.x) {
        deq_any(type, row, it, v);
        for (int l = 0; l < iv; l++) o[it * iv + l] = v[l];
    }
}

// out [n_rows, K] f16 = W dequantized (every row; stacked experts are just more rows), or,
// with a table of expert addresses, the rows of the experts sel[0..n_rows / rpe) in that order
// (rpe = rows per expert). One thread per work item of IV values, kept in registers (IV is
// the type's constant) and written as 16-byte stores; consecutive threads take consecutive
// items of a row.
struct RowAt {
    const u8* W; const u64* tab; const int* sel; i64 rpe, row_bytes;
    __device__ __forceinline__ const u8* operator()(i64 r) const {
        if (!tab) return W + r * row_bytes;
        i64 e = r / rpe;
        return (const u8*)tab[sel[e]] + (r - e * rpe) * row_bytes;
    }
};
template <class T>
__device__ __forceinline__ void deq_rows_f16(RowAt at, i64 n_rows, int K, u16* __restrict__ out) {
    const int IV = T::IV;
    i64 per_row = K / IV;
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < n_rows * per_row; g += stride) {
        i64 r = g / per_row;
        int it = (int)(g - r * per_row);
        float v[IV];
        T w;
        w.deq(at(r), it, v);
        uint4* o = (uint4*)(out + r * K + (i64)it * IV);
#pragma unroll
        for (int c = 0; c < IV / 8; c++) {
            uint4 u;
            u.x = (u32)f2h(v[8 * c]) | ((u32)f2h(v[8 * c + 1]) << 16);
            u.y = (u32)f2h(v[8 * c + 2]) | ((u32)f2h(v[8 * c + 3]) << 16);
            u.z = (u32)f2h(v[8 * c + 4]) | ((u32)f2h(v[8 * c + 5]) << 16);
            u.w = (u32)f2h(v[8 * c + 6]) | ((u32)f2h(v[8 * c + 7]) << 16);
            o[c] = u;
        }
    }
}

__device__ __forceinline__ void dequant_any(RowAt at, int type, i64 n_rows, int K, u16* __restrict__ out) {
    switch (type) {
        case T_Q4_K: deq_rows_f16<Q4K>(at, n_rows, K, out); return;
        case T_Q5_K: deq_rows_f16<Q5K>(at, n_rows, K, out); return;
        case T_Q6_K: deq_rows_f16<Q6K>(at, n_rows, K, out); return;
        case T_Q8_0: deq_rows_f16<Q8_0>(at, n_rows, K, out); return;
        case T_Q5_0: deq_rows_f16<Q5_0>(at, n_rows, K, out); return;
        case T_Q4_0: deq_rows_f16<Q4_0>(at, n_rows, K, out); return;
    }
    i64 stride = (i64)gridDim.x * blockDim.x;       // float formats
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < n_rows * K; g += stride)
        out[g] = f2h(float_at(type, at(g / K), (int)(g % K)));
}

extern "C" __global__ void dequant_f16(const u8* __restrict__ W, int type, i64 row_bytes, i64 n_rows, int K,
                                       u16* __restrict__ out) {
    pdl_wait();
    pdl_next();
    dequant_any(RowAt{W, nullptr, nullptr, 1, row_bytes}, type, n_rows, K, out);
}
// The chosen experts only: out [n_sel * rpe, K] f16, expert sel[j]'s rows at j * rpe.
extern "C" __global__ void dequant_f16_sel(const u64* __restrict__ tab, const int* __restrict__ sel, int n_sel,
                                           int type, i64 row_bytes, i64 rpe, int K, u16* __restrict__ out) {
    pdl_wait();
    pdl_next();
    dequant_any(RowAt{nullptr, tab, sel, rpe, row_bytes}, type, (i64)n_sel * rpe, K, out);
}

extern "C" __global__ void f32_to_f16(const float* __restrict__ x, i64 n, u16* __restrict__ y) {
    pdl_wait();
    pdl_next();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) y[i] = f2h(x[i]);
}
// out[i] = a[i] + b[i % nb]: a residual (nb = n) or a bias over rows (nb = the row's length).
extern "C" __global__ void add_f32(const float* __restrict__ a, const float* __restrict__ b, i64 n, i64 nb,
                                   float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = a[i] + b[nb == n ? i : i % nb];
}
// Rows idx[0 .. n-1] of x [R, D] (rows ld floats apart) -> out [n, D]. grid (n), block 256.
extern "C" __global__ void take_rows(const float* __restrict__ x, i64 ld, const int* __restrict__ idx, int D,
                                     float* __restrict__ out) {
    pdl_wait();
    pdl_next();
    const float* src = x + (i64)idx[blockIdx.x] * ld;
    float* dst = out + (i64)blockIdx.x * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src[i];
}
// The same for decode-sized rows: out f32 and its int8-per-32 form (n % 32 == 0, whole warps
// over consecutive blocks of 32), so the product that reads it next quantizes nothing.
extern "C" __global__ void swiglu_q8(const float* __restrict__ g, const float* __restrict__ u, i64 n,
                                     float* __restrict__ out, i8* __restrict__ oq, float* __restrict__ od,
                                     float* __restrict__ os) {
    pdl_wait();
    pdl_next();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = silu(g[i]) * u[i];
        out[i] = v;
        store_q8(v, i, oq, od, os);
    }
}
// y = x * sigmoid(gate) (+ plus) (+ residual), each step rounded as its own op (the numpy backend's
// order: the product, then plus + it, then + residual), over [rows, N]; gate is [rows, ng] with ng = N
// or 1 (one gate a row). With oq set (N % 32 == 0), y's int8-per-32 form too.
extern "C" __global__ void sigmoid_gate(const float* __restrict__ x, const float* __restrict__ gate, int ng,
                                        const float* __restrict__ plus, const float* __restrict__ residual,
                                        int N, i64 n, float* __restrict__ y, i8* __restrict__ oq,
                                        float* __restrict__ od, float* __restrict__ os) {
    pdl_wait();
    pdl_next();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 row = i / N;
        float g = gate[ng == 1 ? row : row * ng + i % N];
        float s = 1.0f / (1.0f + expf(-g));
        float v = __fmul_rn(x[i], s);
        if (plus) v = __fadd_rn(plus[i], v);
        if (residual) v = __fadd_rn(v, residual[i]);
        y[i] = v;
        if (oq) store_q8(v, i, oq, od, os);
    }
}
// act = silu(g) * u over [n] elements; g, u float (f32) -> out f16 (prompt path) or f32.
extern "C" __global__ void swiglu_f(const float* __restrict__ g, const float* __restrict__ u, i64 n,
                                    float* __restrict__ out32, u16* __restrict__ out16) {
    pdl_wait();
    pdl_next();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = silu(g[i]) * u[i];
        if (out32) out32[i] = v;
        if (out16) out16[i] = f2h(v);
    }
}
