// Recipe B's CPU sidecar posted and collected by two small kernels on the step's own stream, through
// page-locked host memory read and written in place (no copies, no side stream, no stream memory
// operations). Semantics, refs and why: sidecar_zero_copy.py.
//
// post (one CTA, after the routing): maps each slot's expert id to the layer's CPU-local id (-1: not
// a CPU expert) into `dids` (device); when at least one slot has a CPU expert it writes the ids, the
// routing weights and x into the job's host buffers and then stores 1 into the job's host flag with
// release semantics at system scope, which the CPU thread (cpu/mxfp4_gemv.cpp's poller) acquires.
// Otherwise nothing reaches the host and the CPU does nothing for this layer. `posted` (device) says
// which; `calls` counts the launches (the benchmark's steps).
//
// collect (one CTA, before the experts' slot-order sum): when posted, thread 0 waits for the flag to
// read 2 (the CPU's y is complete; acquire at system scope), the CTA copies the CPU's slots of y from
// host memory into `pairs` (the GPU's experts kernel wrote zero there: a copy is the bit-exact integer
// add of runtime/sidecar.add_pairs) and stores 0 into the flag. A wait longer than ~2 s (a CPU thread
// that died) gives up: `err` is set, those slots stay zero, and the GPU does not hang.

#include <stdint.h>

#include "cuda_common.cuh"

namespace {

using megastep::global_ns;
using megastep::ld_acquire_sys;
using megastep::st_release_sys;

constexpr unsigned long long kGiveUpNs = 2000000000ull;

// x [M, D] bf16 (16-byte aligned, D % 8 == 0), idx / w [M, k] (int32 / fp32, device), local [E] int32
// (device); hx / hids / hrw: the job's host buffers (device-visible addresses); dids [M, k] int32,
// posted [1], calls [1] (device); flag: the job's host flag word
__device__ __forceinline__ void post(const uint4* x, const int* idx, const float* w, const int* local, uint4* hx,
                                     int* hids, float* hrw, int* dids, int* posted, int* calls, unsigned* flag, int M,
                                     int D, int k) {
  __shared__ int any;
  if (threadIdx.x == 0) any = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < M * k; i += blockDim.x) {
    const int e = local[idx[i]];
    dids[i] = e;
    if (e >= 0) any = 1;  // (every writer stores the same value)
  }
  __syncthreads();
  if (any) {
    for (int i = threadIdx.x; i < M * k; i += blockDim.x) {
      hids[i] = dids[i];
      hrw[i] = w[i];
    }
    for (int i = threadIdx.x; i < M * D / 8; i += blockDim.x) hx[i] = x[i];
    __threadfence_system();  // this thread's host writes, then (the barrier) every thread's, before the flag
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *posted = any;
    *calls += 1;
    if (any) st_release_sys(flag, 1u);
  }
}

// pairs [M*k, D] bf16 (device, 16-byte aligned); hy [M*k, D] bf16: the job's host y; err [1] (device)
__device__ __forceinline__ void collect(const int* dids, const int* posted, unsigned* flag, const uint4* hy,
                                        uint4* pairs, int* err, int M, int D, int k) {
  __shared__ int ready;
  if (threadIdx.x == 0) {
    int ok = *posted;
    if (ok) {
      const unsigned long long t0 = global_ns();
      while (ld_acquire_sys(flag) != 2u) {
        if (global_ns() - t0 > kGiveUpNs) {
          atomicExch(err, 1);
          ok = 0;
          break;
        }
        __nanosleep(200);
      }
    }
    ready = ok;
  }
  __syncthreads();
  if (!ready) return;  // nothing posted (or given up): every slot keeps the GPU's value
  const int row = D / 8;  // 16-byte words a slot
  for (int s = 0; s < M * k; ++s) {
    if (dids[s] < 0) continue;
    for (int i = threadIdx.x; i < row; i += blockDim.x) pairs[(long long)s * row + i] = __ldcv(hy + (long long)s * row + i);
  }
  __syncthreads();  // every read of the host y done before the flag lets the CPU write it again
  if (threadIdx.x == 0) st_release_sys(flag, 0u);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(512) sidecar_post(const uint4* x, const int* idx, const float* w,
                                                               const int* local, uint4* hx, int* hids, float* hrw,
                                                               int* dids, int* posted, int* calls, unsigned* flag,
                                                               int M, int D, int k) {
  post(x, idx, w, local, hx, hids, hrw, dids, posted, calls, flag, M, D, k);
}

extern "C" __global__ void __launch_bounds__(512) sidecar_collect(const int* dids, const int* posted, unsigned* flag,
                                                                  const uint4* hy, uint4* pairs, int* err, int M,
                                                                  int D, int k) {
  collect(dids, posted, flag, hy, pairs, err, M, D, k);
}
