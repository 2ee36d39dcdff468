// Shared helpers for the sparsekv kernels.
//
// Plain CUDA C++ that both nvcc and NVRTC accept: no includes at all (NVRTC has no host
// headers), only built-in types. daemon/kernels.py inlines this file into each .cu before
// compiling, so the source it hashes for the cache key is the whole program.
//
// Every block-wide helper here must be called by all threads of the block (block-uniform
// control flow): they contain __syncthreads().
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Dynamic shared memory. Overridable so the kernels can be compiled on the host by a test
// harness that emulates blocks with threads (it predefines this macro).
#ifndef SKV_DYN_SMEM
#define SKV_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// Bits of the error word (counters[3] of the resolve output). Documented in csrc/README.md.
#define SKV_ERR_DUPLICATE_IDS 1u  // a later duplicate id in a top-k row was treated as -1
#define SKV_ERR_CORRUPT_STATE 2u  // lru named a slot outside the region, or too few evictables
#define SKV_ERR_BAD_STATE_ROW 4u  // a state row outside [-1, max_reqs): row treated as padding

__device__ __forceinline__ u64 skv_align16(u64 x) { return (x + 15ull) & ~15ull; }

// Exclusive prefix count of a per-thread flag across the block, in thread order.
// `warp_tot` is __shared__ int[NT / 32]; `*total` receives the block's count.
template <int NT>
__device__ __forceinline__ int skv_block_scan_flag(bool flag, int* warp_tot, int* total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const u32 mask = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(mask & ((1u << lane) - 1u));
    if (lane == 0) warp_tot[warp] = __popc(mask);
    __syncthreads();
    int before = 0, sum = 0;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) {
        const int v = warp_tot[w];
        before += (w < warp) ? v : 0;
        sum += v;
    }
    __syncthreads();  // warp_tot is reused by the next call
    *total = sum;
    return before + in_warp;
}

// Sum of one int per thread across the block. `cell` is one __shared__ int.
__device__ __forceinline__ int skv_block_sum(int v, int* cell) {
    if (threadIdx.x == 0) *cell = 0;
    __syncthreads();
    if (v) atomicAdd(cell, v);
    __syncthreads();
    const int r = *cell;
    __syncthreads();  // the cell is reused by the next call
    return r;
}

// Exclusive prefix sum of one int per thread (any values), Hillis-Steele in shared memory.
// `tmp` is __shared__ int[NT]. Used once per launch, so simplicity beats speed here.
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

// First index in sorted a[0, n) whose value is >= key.
__device__ __forceinline__ int skv_lower_bound_u64(const u64* a, int n, u64 key) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
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
