// Doorbell words as kernels: the alternative to stream memory operations
// (cuStreamWaitValue32 / cuStreamWriteValue32, proto/stream_ops.py) for either side of
// the doorbell transport. A wait is one thread spinning on a volatile word in device
// memory (it holds one SM slot while it waits); a set is one atomic store after a
// system-wide fence. Both capture into CUDA graphs like any kernel. Which one a side
// uses is chosen by measurement (docs/PERF.md; stream memory operations by default).
//
//   skv_wait_word   wait until *word == 1, then *word = 0
//   skv_set_word    *word = 1 (after every earlier write of the stream is visible)
#include "common.cuh"

extern "C" __global__ void skv_wait_word(u32* word) {
    if (blockIdx.x == 0) skv_wait_and_clear(word);
}

extern "C" __global__ void skv_set_word(u32* word) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        __threadfence_system();
        atomicExch(word, 1u);
    }
}
