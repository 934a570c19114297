/* Device helpers shared by the tensor-core attention kernels (cuda_attn_prefill.cu,
 * cuda_attn_decode_tc.cu): mma.sync m16n8k16 with f32 accumulation on bf16 or f16 operands,
 * operand packing, ldmatrix, cp.async, bulk copies on an mbarrier (sm_90), 32-bit shared loads.
 * CUDA C++ only; sm_80+. */
#ifndef PD_CUDA_MMA_H
#define PD_CUDA_MMA_H

#include "cuda_internal.h"

/* pd_tc<T>::pack(lo, hi): two floats as one 32-bit register of T; pd_tc<T>::mma(c, a, b0, b1):
 * c += a b for an m16n8k16 tile (A row-major fragments a[4], B column-major b0, b1). */
template <typename T> struct pd_tc;
template <> struct pd_tc<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  }
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct pd_tc<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  }
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

/* Four transposed 8x8 b16 matrices from shared memory (B fragments of a row-major tile). */
__device__ __forceinline__ void pd_ldmatrix_x4_trans(uint32_t r[4], const void *p) {
  uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* Four 8x8 b16 matrices from shared memory, not transposed (B fragments of a K^T operand whose
 * rows are the n index: lane l addresses row l % 8 of matrix l / 8). */
__device__ __forceinline__ void pd_ldmatrix_x4(uint32_t r[4], const void *p) {
  uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* An 8x8 b16 matrix held as an accumulator's pairs (lane l: row l / 4, columns 2 (l % 4) and
 * 2 (l % 4) + 1) transposed in registers, in the same layout: an m16n8k16 result packed to 16
 * bits becomes a B fragment (sm_75 and later). */
__device__ __forceinline__ uint32_t pd_movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

/* 2^x, approximate (MUFU.EX2, flush-to-zero; 2^-inf = 0): the softmax exponentials. */
__device__ __forceinline__ float pd_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/* 16 bytes global -> shared, asynchronous; src_bytes 0 writes zeros. */
__device__ __forceinline__ void pd_cp_async16(void *dst, const void *src, int src_bytes) {
  uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void pd_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n");
}
template <int N> __device__ __forceinline__ void pd_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Bulk copies (Hopper's TMA engine, sm_90+): `bytes` (a multiple of 16, both addresses 16-byte
 * aligned) global -> shared in one instruction, completion counted in bytes on an mbarrier. */
__device__ __forceinline__ void pd_mbar_init(uint64_t *bar, int count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(
                   (uint32_t)__cvta_generic_to_shared(bar)),
               "r"(count));
  asm volatile("fence.mbarrier_init.release.cluster;\n");
#endif
}
/* one arrival that also adds `bytes` to the transactions the current phase waits for */
__device__ __forceinline__ void pd_mbar_expect(uint64_t *bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   (uint32_t)__cvta_generic_to_shared(bar)),
               "r"(bytes));
#endif
}
__device__ __forceinline__ void pd_bulk_g2s(void *dst, const void *src, uint32_t bytes,
                                            uint64_t *bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1], %2, [%3];\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src), "r"(bytes), "r"((uint32_t)__cvta_generic_to_shared(bar))
               : "memory");
#endif
}
/* A box of a 2D tensor map (a __grid_constant__ kernel parameter) at column c0, row c1 into
 * shared memory, as a bulk copy on bar. */
__device__ __forceinline__ void pd_tma_load_2d(void *dst, const void *tmap, int c0, int c1,
                                               uint64_t *bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(tmap), "r"(c0), "r"(c1), "r"((uint32_t)__cvta_generic_to_shared(bar))
               : "memory");
#endif
}
/* waits until the phase of parity `parity` has completed */
__device__ __forceinline__ void pd_mbar_wait(uint64_t *bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(bar);
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(a), "r"(parity)
                 : "memory");
#endif
}

__device__ __forceinline__ uint32_t pd_lds32(const void *p) {
  return *reinterpret_cast<const uint32_t *>(p);
}

#endif
