// Shared helpers for bloomery's kernels. Compiled by NVRTC through CuPy RawModule
// (bloomery/engine/cuda_kernels.py inlines this file): no system headers.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define WARP 32

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
// A 32-bit word from 2-byte-aligned memory (Q8_0, Q5_0, Q4_0 and Q6_K blocks are only 2-aligned).
__device__ __forceinline__ int ld_b2(const u8* p) {
    const u16* h = (const u16*)p;
    return (int)((u32)h[0] | ((u32)h[1] << 16));
}
__device__ __forceinline__ int ld_b4(const u8* p) { return *(const int*)p; }
__device__ __forceinline__ u16 ld_h(const u8* p) { return *(const u16*)p; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets it.
// A warp's 32 values (lane l holds the value at index at, at % 32 == l) in their int8-per-32 form:
// xq[at] = round(v / d), and lane 0 writes xd = d = max|v| / 127 and xs = d * sum(q) for the block
// (llama.cpp's block_q8_1, as quantize_q8 writes it). The whole warp calls it.
__device__ __forceinline__ void store_q8(float v, i64 at, i8* __restrict__ xq, float* __restrict__ xd,
                                         float* __restrict__ xs) {
    float amax = warp_max(fabsf(v));
    float d = amax / 127.f;
    int q = amax == 0.f ? 0 : __float2int_rn(v / d);
    float sum = warp_sum((float)q) * d;      // the sum of the values as quantized: offsets cancel exactly
    xq[at] = (i8)q;
    if (at % WARP == 0) { xd[at / WARP] = d; xs[at / WARP] = sum; }
}
__device__ __forceinline__ float block_sum(float v, float* sh /* [32] */) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* sh) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : -3.0e38f;
    return warp_max(v);
}
// The larger of two (value, index) pairs across the warp; ties go to the lower index.
__device__ __forceinline__ void warp_argmax(float& best, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
}
// Programmatic dependent launch (sm_90). A decode step's kernels are captured with the
// launch attribute that lets each one start while the kernel before it drains (cuda_kernels.py,
// cuda_graph.py): before pdl_wait() a kernel may read its weights and the step's inputs
// (ids, slots, positions: copied in before the graph runs), never anything a kernel writes,
// and it writes nothing. Every block calls pdl_wait() before any early
// return, so a kernel's end implies the end of every kernel before it. pdl_next() lets the
// next kernel's blocks start. Both are no-ops in a launch without the attribute.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" :: "l"(p)); }

// Asynchronous global -> shared copies (sm_80): 16 bytes each, no registers held while in flight.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* dst_smem, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_addr(dst_smem)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Bytes [src, src + n) copied into dst (shared, 16-aligned, STAGE_CAP(n) bytes) by n_thr threads
// (this one is thread `me`), whole aligned 16-byte pieces; returns where src's first byte
// lands, so the copy keeps src's alignment mod 16. The caller waits (cp_async_wait_all) and
// syncs the threads that share it. May read up to 15 bytes before and after the range, inside
// the aligned 16-byte pieces that hold it (never outside an allocation CuPy rounds to 512).
#define STAGE_CAP(n) ((((n) + 15) & ~15) + 32)
__device__ __forceinline__ const u8* stage_async(const u8* src, int n, u8* dst, int me, int n_thr) {
    const u8* a = (const u8*)((u64)src & ~(u64)15);
    int off = (int)(src - a), total = (off + n + 15) & ~15;
    for (int i = me * 16; i < total; i += n_thr * 16) cp_async16(dst + i, a + i);
    return dst + off;
}
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
