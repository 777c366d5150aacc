// f16x2 arithmetic on packed words and the tensor cores' m16n8k16 product, shared by the kernels
// that expand GGUF blocks to f16 in registers (moe_mm.cu, matvec.cu's mmt). NVRTC here has no
// cuda_fp16.h, so each is one PTX instruction.
#include "common.cuh"

__device__ __forceinline__ u32 pack2(float a, float b) { return (u32)f2h(a) | ((u32)f2h(b) << 16); }
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The weights reach shared memory (moe_mm) or the mma fragments (mmt) through these: a block's
// values as f16 1024 + q (q its bits, by byte permutes with 0x64 as the high byte, exact for
// q < 1024), less 1024 (exact), times the sub-block's scale (and less its min) in one rounding. No int or float conversion a value: those run at a
// sixteenth of the ALU rate and bounded the kernels before (8,863 tok/s at 512 ids).
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) { u32 r; asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) { u32 r; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ u32 splat(float v) { return pack2(v, v); }
#define H1024 0x64006400u             // f16x2 (1024, 1024)
#define BYTES_AS_F16(w, sel) __byte_perm((w), 0x64646464u, (sel))   // two bytes b as f16 1024 + b

// 32 bytes from a 2-aligned address as 8 words: three aligned 16-byte loads (the window never passes
// p + 34, inside a Q6_K block for the parts read here), the words picked and shifted into place.
__device__ __forceinline__ void ld32_b2_wide(const u8* p, u32* out) {
    const uint4* a = (const uint4*)((u64)p & ~(u64)15);
    uint4 v0 = a[0], v1 = a[1], v2 = a[2];
    u32 w[12] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w, v2.x, v2.y, v2.z, v2.w};
    int o = ((u32)(u64)p & 15u) >> 2;
    u32 sh = ((u32)(u64)p & 2u) * 8u, t[9];
#pragma unroll
    for (int k = 0; k < 9; k++) t[k] = o == 0 ? w[k] : o == 1 ? w[k + 1] : o == 2 ? w[k + 2] : w[k + 3];
#pragma unroll
    for (int k = 0; k < 8; k++) out[k] = __funnelshift_r(t[k], t[k + 1], sh);
}
