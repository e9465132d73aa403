// Programmatic dependent launch (sm_90+): a kernel launched with programmatic stream
// serialisation (Gpu::launch_programmatic) may start while the kernel before it in the stream is
// still running. Its blocks get onto the SMs and set up during the previous kernel's tail, and
// wait_for_prior_grids holds them, before their first read or write of memory, until that kernel
// has finished and its writes are visible. allow_next_grid lets the next such kernel in the
// stream start once every block of this one has called it (or exited). Before sm_90, and when the
// kernel was launched the ordinary way, both do nothing.
#ifndef LADDER_PDL_CUH
#define LADDER_PDL_CUH

__device__ __forceinline__ void wait_for_prior_grids() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

#endif  // LADDER_PDL_CUH
