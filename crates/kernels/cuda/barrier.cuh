// Synchronisation between the warpgroups of a Hopper block.
//
// mbarrier (sm_80+, transaction counts sm_90): a 64-bit shared-memory object that completes a
// *phase* once `count` threads have arrived and, with expect_tx, once the copy engine has
// delivered the bytes announced. Phases alternate parity 0, 1, 0, …; a waiter names the parity of
// the phase it waits for. The pipeline of fa3_forward.cu uses two barriers per shared-memory
// stage: `full` (the producer's TMA copy has landed) and `empty` (every consumer warp has finished
// reading the stage).
//
// Named barriers (bar.sync / bar.arrive with an id 1-15): a fixed number of threads meet; a
// warpgroup that only signals (arrive) does not wait. Used for the ping-pong schedule.
#ifndef LADDER_BARRIER_CUH
#define LADDER_BARRIER_CUH

#include "copy.cuh"
#include "types.cuh"

__device__ __forceinline__ void mbar_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Make initialised barriers visible to the other threads and to the copy engine (the async
// proxy), before the __syncthreads that publishes them.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::
                     : "memory");
}

// Arrive once and announce `bytes` more to come from the copy engine.
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Wait until the phase of parity `parity` has completed. (A fresh barrier counts the phase
// "before" phase 0, of parity 1, as complete: waiting on parity 1 returns at once.)
__device__ __forceinline__ void mbar_wait(u64* bar, int parity) {
    const u32 addr = smem_addr(bar);
    u32 done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(addr), "r"(parity)
            : "memory");
}

// A position in a pipeline of STAGES shared-memory stages, counted across everything a block
// streams through it: which stage, and the parity of the round (how many times the stages have
// been cycled through) for the mbarrier waits.
template <int STAGES>
struct PipelineState {
    int count = 0;
    __device__ __forceinline__ int stage() const { return count % STAGES; }
    __device__ __forceinline__ int parity() const { return (count / STAGES) & 1; }
};

// Release a stage: one arrival per warp (the `empty` barrier counts warps), after the warp's
// wgmma reading it has completed.
__device__ __forceinline__ void release(u64* empty) {
    __syncwarp();
    if (lane_id() == 0) mbar_arrive(empty);
}

// Named barrier `id` for `threads` threads: wait for all of them, or only count this warp in.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

#endif  // LADDER_BARRIER_CUH
