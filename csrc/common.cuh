// Shared helpers for the sparsekv kernels: plain CUDA C++ that both nvcc and NVRTC accept
// (no includes: NVRTC has no host headers). csrc/build.py inlines it into each .cu.
// Every block-wide helper here must be called by all threads of the block: they contain
// __syncthreads().
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Dynamic shared memory; the CPU emulator of tests/csrc predefines its own.
#ifndef SKV_DYN_SMEM
#define SKV_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// The step descriptor: int32[SKV_DESC_INTS] in device memory, the head of a step block
// (csrc/README.md). Launch shapes never depend on it.
#define SKV_D_SEQ 0      // request sequence number (for error reports)
#define SKV_D_STEP 1     // the engine's step number (for error reports)
#define SKV_D_BATCH 2    // batch rows, in [0, max_batch]
#define SKV_D_K 3        // top-k columns of this batch, in [0, top_k]
#define SKV_D_GROUP 4    // index group, in [0, groups)
#define SKV_D_INV_N 5    // invalidate columns of a STEP block, in [0, top_k]
#define SKV_D_SLOTS 6    // a doorbell TOPK block: 0 as the engine writes it, 1 once the daemon's
                         // resolve of it has written its slots (set by the first gather)
#define SKV_DESC_INTS 16

// The per-rank error record: int32[SKV_ERR_INTS] in device memory. For each kind e:
// err[e] counts occurrences (never reset: the host remembers what it has reported),
// err[8 + e] / err[16 + e] / err[24 + e] hold the batch row / step / group of the latest.
#define SKV_E_DUPLICATE_IDS 0   // a top-k row named a host row twice: the row was refused
#define SKV_E_CORRUPT_STATE 1   // lru named a slot outside the region, or too few evictables
#define SKV_E_BAD_STATE_ROW 2   // a state row outside [-1, max_reqs): the row was padding
#define SKV_E_TOO_MANY_TOKENS 3 // more rows of one state row than region_stride / top_k: refused
#define SKV_E_BAD_STEP 4        // the descriptor is out of range: the launch did nothing
#define SKV_E_TP_MISMATCH 5     // a TP follower's step or top-k row differed from its leader's: refused
#define SKV_ERR_INTS 32

__device__ __forceinline__ void skv_report(int* err, int kind, int row, const int* desc) {
    atomicAdd(&err[kind], 1);
    err[8 + kind] = row;
    err[16 + kind] = desc[SKV_D_STEP];
    err[24 + kind] = desc[SKV_D_GROUP];
}

__device__ __forceinline__ u64 skv_align16(u64 x) { return (x + 15ull) & ~15ull; }

// The block-wide exclusive prefix of a per-thread value from its warp-wide one: `in_warp`
// (this thread's prefix within its warp) and `warp_sum` (its warp's total, the same in
// every lane), through `warp_tot` (__shared__ int[NT / 32]); `*total` receives the block's
// sum. One barrier; `warp_tot` may be written again only after another barrier.
template <int NT>
__device__ __forceinline__ int skv_warp_totals(int in_warp, int warp_sum, int* warp_tot, int* total) {
    static_assert(NT % 32 == 0 && NT <= 1024, "whole warps, at most 32 of them");
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    if (lane == 0) warp_tot[warp] = warp_sum;
    __syncthreads();
    const unsigned v = lane < NT / 32 ? (unsigned)warp_tot[lane] : 0u;
    *total = (int)__reduce_add_sync(0xffffffffu, v);
    return (int)__reduce_add_sync(0xffffffffu, lane < warp ? v : 0u) + in_warp;
}

// Ballots of a warp: this lane's exclusive prefix (*in_warp) and the warp's total
// (*warp_sum) of a per-thread count v in [0, 2^bits), bit by bit.
__device__ __forceinline__ void skv_warp_count(int v, int bits, int* in_warp, int* warp_sum) {
    const u32 below = (1u << (threadIdx.x & 31)) - 1u;
    int before = 0, sum = 0;
    for (int p = 0; p < bits; ++p) {
        const u32 m = __ballot_sync(0xffffffffu, (v >> p) & 1);
        before += __popc(m & below) << p;
        sum += __popc(m) << p;
    }
    *in_warp = before;
    *warp_sum = sum;
}

// Block-wide collectives with one barrier each (SkvRot): the per-warp partials go to one of
// two slots in turn, so a slot is written again only after every thread has passed the
// barrier of the collective in between (and so has read it). `buf` is __shared__
// int[2 * NT / 32]; `slot` starts at 0 and stays block-uniform.
struct SkvRot {
    int* buf;
    int slot;
};

template <int NT>
__device__ __forceinline__ int skv_rot_add_warps(SkvRot& r, int in_warp, int warp_sum, int* total) {
    int* wt = r.buf + r.slot * (NT / 32);
    r.slot ^= 1;
    return skv_warp_totals<NT>(in_warp, warp_sum, wt, total);
}

template <int NT>
__device__ __forceinline__ int skv_rot_scan_count(SkvRot& r, int v, int bits, int* total) {
    int in_warp, warp_sum;
    skv_warp_count(v, bits, &in_warp, &warp_sum);
    return skv_rot_add_warps<NT>(r, in_warp, warp_sum, total);
}

template <int NT>
__device__ __forceinline__ int skv_rot_scan_flag(SkvRot& r, bool flag, int* total) {
    return skv_rot_scan_count<NT>(r, flag ? 1 : 0, 1, total);
}

// Sum of one value per thread (int, or u32 modulo 2^32 for packed counts).
template <int NT, class T>
__device__ __forceinline__ T skv_rot_sum(SkvRot& r, T v) {
    const unsigned w = __reduce_add_sync(0xffffffffu, (unsigned)v);
    int total;
    skv_rot_add_warps<NT>(r, 0, (int)w, &total);
    return (T)(unsigned)total;
}

// Bits that hold every count in [0, n].
__device__ __forceinline__ int skv_bits_for(int n) {
    int b = 1;
    while (b < 31 && (1 << b) <= n) ++b;
    return b;
}

// Exclusive prefix sum of one int per thread (any values), Hillis-Steele in shared memory.
// `tmp` is __shared__ int[NT].
template <int NT>
__device__ __forceinline__ int skv_block_scan_sum(int v, int* tmp, int* total) {
    const int t = threadIdx.x;
    tmp[t] = v;
    __syncthreads();
    for (int off = 1; off < NT; off <<= 1) {
        const int add = (t >= off) ? tmp[t - off] : 0;
        __syncthreads();
        tmp[t] += add;
        __syncthreads();
    }
    const int inclusive = tmp[t];
    *total = tmp[NT - 1];
    __syncthreads();
    return inclusive - v;
}

// First index in sorted a[0, n) whose value is > key.
__device__ __forceinline__ int skv_upper_bound_i64(const i64* a, int n, i64 key) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] <= key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Whether sorted a[0, n) holds key.
__device__ __forceinline__ bool skv_contains_i32(const int* a, int n, int key) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo < n && a[lo] == key;
}

// Ascending bitonic sort of int a[0, n), n a power of two, by the whole block (any block
// size). The caller synchronised after writing a[]; ends with __syncthreads().
__device__ __forceinline__ void skv_block_sort_i32(int* a, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < (n >> 1); t += blockDim.x) {
                const int i = 2 * t - (t & (stride - 1));
                const int j = i + stride;
                const int x = a[i], y = a[j];
                if ((x > y) == ((i & size) == 0)) {
                    a[i] = y;
                    a[j] = x;
                }
            }
            __syncthreads();
        }
    }
}

__device__ __forceinline__ int skv_pow2(int n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}


// -- programmatic dependent launch (sm_90+) -----------------------------------------------
// A kernel launched with the programmatic stream-serialization attribute
// (daemon/residency/cuda/launch_ex.py) may start while the kernel before it on the stream
// still runs, once that kernel's blocks have all called skv_pdl_launch_dependents() or
// exited. skv_pdl_wait() returns once the kernel before has completed and its writes are
// visible; every read of what it wrote must come after it. Launched plainly, the wait
// returns at once and the trigger does nothing.
__device__ __forceinline__ void skv_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void skv_pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// -- doorbell words (flip-flops: one side sets 1, the other waits for 1 and resets 0) --------

// Set `bell` to 1 once `expect` blocks have passed this point, with all of their earlier
// global writes visible before it (a fence per block, then the counter `done`, 0 before
// and after, reset by the last block, which rings; null with expect <= 1). Must be
// reached by every thread of every block (no early return before it). kSystem: the
// arrivals come from several kernels, some on peer GPUs writing this GPU's memory (or a
// peer's) over NVLink, so the fences and the atomics are system-scope; otherwise only
// this grid's blocks arrive (skv_ring_when_done). The fence before the bell is
// system-scope too, unless `local`: the bell is read only on this GPU (a kernel or a
// stream wait there), where a device-scope fence orders the rows before it (a gather's
// ready word: ~1 us a layer less on the batch-1 step than a system-scope one). An engine's
// bells are system-scope where a TP group's leader may wait on them from another GPU, else
// local (skv_db_topk's `local_bell`: the daemon's attach reply says `bells_local`).
template <bool kSystem>
__device__ __forceinline__ void skv_ring_after(u32* done, u32* bell, const u32 expect, const bool local = false) {
    if (!bell) return;
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool system_bell = kSystem || !local;
        if (expect > 1 && done) {
            if (kSystem) __threadfence_system(); else __threadfence();
            const bool last = (kSystem ? atomicAdd_system(done, 1u) : atomicAdd(done, 1u)) == expect - 1;
            if (!last) return;
            if (kSystem) atomicExch_system(done, 0u); else atomicExch(done, 0u);
        }
        // One fence between this block's writes (or, for the last arrival, every block's,
        // seen through the counter) and the bell.
        if (system_bell) __threadfence_system(); else __threadfence();
        if (kSystem) atomicExch_system(bell, 1u); else atomicExch(bell, 1u);
    }
}

// `bell` set once every block of this grid has passed (see skv_ring_after; `local`: read
// only on this GPU).
__device__ __forceinline__ void skv_ring_when_done(u32* done, u32* bell, const bool local = false) {
    skv_ring_after<false>(done, bell, gridDim.x, local);
}

// -- prefetch marks (csrc/prefetch.cu) ------------------------------------------------------

// The prefetch counters: u64 [SKV_PF_COUNTERS], accumulated (one set for all groups).
#define SKV_PF_PREFETCHED 0  // rows a prefetch took a slot for
#define SKV_PF_HITS 1        // resolve hits on a fresh slot (each counted once)
#define SKV_PF_WASTED 2      // fresh slots emptied or refilled before any hit
#define SKV_PF_COUNTERS 4

// Clear the fresh mark (uint8) at fresh[at] and return whether it was set: one atomic on
// the aligned word holding it, so two blocks emptying the same slot count it once. The
// array's base is 4-aligned and its size padded to a multiple of 4 bytes.
__device__ __forceinline__ int skv_take_fresh(unsigned char* fresh, i64 at) {
    u32* word = (u32*)(fresh + (at & ~(i64)3));
    const int shift = (int)(at & 3) * 8;
    if (!((*(volatile u32*)word >> shift) & 0xffu)) return 0;  // the common case: no atomic
    return (int)((atomicAnd(word, ~(0xffu << shift)) >> shift) & 0xffu) ? 1 : 0;
}
