// Input ring of the chunks kernels: one extra warp per CTA (the producer) streams the CTA's row steps into shared
// memory with the bulk-copy engine (cp.async.bulk, sm_90 and up), kRingSlots steps ahead of the quantizing warps
// (the consumers). The bytes in flight per SM then no longer depend on registers or resident warps: the direct
// loads keep one 32-byte block per thread in flight.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_utils.cuh"

namespace nvq {

constexpr uint32_t kRingSlots = 4;  // row steps in flight per CTA (a power of two)
constexpr int kRingThreads = 32;    // the producer warp, after the tile's warps

// One slot holds a CTA tile's row step: up to kThreads blocks of 16 values.
template <typename T>
constexpr uint32_t kRingSlotBytes = uint32_t(kThreads) * 16u * uint32_t(sizeof(T));

// Dynamic shared memory of a ring: the slots, then per slot a "full" mbarrier. Slot s is released through the
// named barrier 1 + s (consumer warps bar.arrive, the producer bar.sync: an order compute-sanitizer racecheck
// follows, where it does not follow an mbarrier arrive/wait before a bulk copy).
template <typename T>
constexpr size_t ring_smem_bytes() {
  return size_t(kRingSlots) * (kRingSlotBytes<T> + 8u);
}

#if defined(__CUDACC__)

// Row step j of a CTA tile is load j: `bytes` (a multiple of 16, at most one slot) read from a 16-byte aligned
// global address into slot j % kRingSlots; the slot's full barrier completes when they land. Each consuming warp
// arrives on the slot's named barrier once it has used its blocks, and the producer refills the slot once all
// consumers have.
//   - producer warp, before the CTA's first __syncthreads: start(); after it: produce() (the rest of the loads);
//   - consumer warps, after that __syncthreads: next() and then release() once per load they consume, in order.
// A load that fewer warps consume (a partial last row step) must be the last one. Below sm_90 there is no
// producer: the consumers load their blocks directly.
template <typename T>
struct Ring {
  uint8_t* smem;     // ring_smem_bytes<T>() of dynamic shared memory
  uint32_t threads;  // consumer threads + the producer warp (the named barriers' count)

  __device__ __forceinline__ uint32_t base() const { return uint32_t(__cvta_generic_to_shared(smem)); }
  __device__ __forceinline__ uint32_t full(uint32_t s) const { return base() + kRingSlots * kRingSlotBytes<T> + 8u * s; }

  // Producer: the full barriers, and the first loads of the `n` (load j: src_of(j), bytes_of(j)).
  template <class Src, class Bytes>
  __device__ __forceinline__ void start(uint32_t n, Src src_of, Bytes bytes_of) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if ((threadIdx.x & 31u) != 0) return;
    for (uint32_t s = 0; s < kRingSlots; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full(s)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (uint32_t j = 0; j < kRingSlots && j < n; ++j) issue(j, src_of(j), bytes_of(j));
#else
    (void)n;
    (void)src_of;
    (void)bytes_of;
#endif
  }

  // Producer (whole warp): loads kRingSlots .. n - 1, each once its slot's previous load has been consumed.
  template <class Src, class Bytes>
  __device__ __forceinline__ void produce(uint32_t n, Src src_of, Bytes bytes_of) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (uint32_t j = kRingSlots; j < n; ++j) {
      asm volatile("bar.sync %0, %1;" ::"r"(1u + (j & (kRingSlots - 1u))), "r"(threads) : "memory");
      if ((threadIdx.x & 31u) == 0) {
        // the consumers' reads of the slot (generic proxy) before the copy's writes (async proxy)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue(j, src_of(j), bytes_of(j));
      }
      __syncwarp();
    }
#else
    (void)n;
    (void)src_of;
    (void)bytes_of;
#endif
  }

  // Consumer: this lane's block at byte offset `off` of load i (`src`: the same block in global memory, for the
  // direct loads below sm_90; nullptr: none).
  __device__ __forceinline__ void next(uint32_t i, uint4 (&c)[kChunksPerBlock16<T>], uint32_t off, const T* src) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    (void)src;
    const uint32_t s = i & (kRingSlots - 1u);
    wait(full(s), (i / kRingSlots) & 1u);
    const uint32_t a = base() + s * kRingSlotBytes<T> + off;
#pragma unroll
    for (int h = 0; h < kChunksPerBlock16<T>; ++h) {
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(c[h].x), "=r"(c[h].y), "=r"(c[h].z), "=r"(c[h].w)
                   : "r"(a + 16u * h)
                   : "memory");
    }
#else
    (void)i;
    (void)off;
    if (src != nullptr) load_block16<T>(src, c);
#endif
  }

  // Consumer, once the warp has used the blocks of load i (whole warp). The shared loads must have completed: an
  // mbarrier arrive does not wait for them, an instruction that reads their registers does (the warp's loads
  // complete together), so the caller releases after the lane 0 block's quantization, never right after next().
  __device__ __forceinline__ void release(uint32_t i) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __syncwarp();
    asm volatile("bar.arrive %0, %1;" ::"r"(1u + (i & (kRingSlots - 1u))), "r"(threads) : "memory");
#else
    (void)i;
#endif
  }

  // Consumer: load i, whose blocks the warp does not need (its copy must still land before the slot is refilled).
  __device__ __forceinline__ void skip(uint32_t i) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    wait(full(i & (kRingSlots - 1u)), (i / kRingSlots) & 1u);
#endif
    release(i);
  }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
 private:
  __device__ __forceinline__ static void wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    } while (done == 0);
  }

  __device__ __forceinline__ void issue(uint32_t j, const T* src, uint32_t bytes) const {
    const uint32_t s = j & (kRingSlots - 1u);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full(s)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     base() + s * kRingSlotBytes<T>),
                 "l"(src), "r"(bytes), "r"(full(s))
                 : "memory");
  }
#endif
};

#endif  // __CUDACC__

}  // namespace nvq
