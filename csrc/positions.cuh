// Logical token positions -> rows through a per-request block table: the device side of
// proto/positions.py's rule (DESIGN §6), used by every kernel of csrc/handle.cu.
#pragma once
#include "common.cuh"

#define SKV_UNMAPPED (-2)  // a position that maps to no host row: counted as out of range

// The row of position p through `row_table` (one request's row of a block table, `blocks`
// entries, -1 = no block; null: no table) with `block_size` positions per block:
// row_table[p / bs] * bs + p % bs. -1 when p < 0, p / bs is past the table or its block is
// -1; a value past int32 (never wrapped) for a block whose rows all pass int32. I is the
// positions' integer type: the doorbell's int positions divide in 32 bits (a 64-bit
// division is many instructions on the GPU, for every column of every leader layer).
// The two halves of the rule, for a kernel that issues every column's table load before it
// uses any (csrc/handle.cu): the table entry of p (-1 when there is no table, p < 0 or
// p / bs is past it), then p's row from that entry (-1 for an entry < 0).
template <typename T, typename I>
__device__ __forceinline__ i64 skv_block_of(const T* __restrict__ row_table, const int blocks, const I p,
                                            const I block_size) {
    if (!row_table || p < 0) return -1;
    const I blkno = p / block_size;
    return blkno < blocks ? (i64)row_table[blkno] : -1;
}

// For the engine's kernels (csrc/handle.cu), whose block size is fixed for a launch: the
// block number and the offset in its block of a position p >= 0, a shift and a mask when
// the block size is a power of two (kPow2: block_size == 1 << shift), else a division.
template <bool kPow2>
__device__ __forceinline__ int skv_blkno(const int p, const int block_size, const int shift) {
    return kPow2 ? p >> shift : p / block_size;
}

template <bool kPow2>
__device__ __forceinline__ int skv_in_block(const int p, const int block_size) {
    return kPow2 ? (p & (block_size - 1)) : p % block_size;
}

// skv_block_of for a kernel that loads every column's entry before it uses any: the entry
// is loaded whatever p is (at index 0 when p < 0 or p / bs is past the table, then -1):
// no branch on p around the load. With a branch around each load, the compiler widened
// each entry to 64 bits right where it was loaded, so a thread waited on its loads one
// after another (PERF.md run BN). `on` (uniform over the token): the row exists, with
// `blocks` >= 1 entries; otherwise nothing is loaded and the entry is -1.
template <bool kPow2>
__device__ __forceinline__ int skv_entry_of(const int* __restrict__ row_table, const bool on, const int blocks,
                                            const int p, const int block_size, const int shift) {
    const int b = skv_blkno<kPow2>(p, block_size, shift);
    const bool in = p >= 0 && b < blocks;
    const int e = on ? row_table[in ? b : 0] : -1;
    return in ? e : -1;
}

template <typename I>
__device__ __forceinline__ i64 skv_row_in_block(const i64 b, const I p, const I block_size) {
    if (b < 0) return -1;
    if (b > 0x7fffffffll) return 0x80000000ll;
    return b * block_size + (i64)(p % block_size);
}

template <typename T, typename I>
__device__ __forceinline__ i64 skv_position_row(const T* __restrict__ row_table, const int blocks, const I p,
                                                const I block_size) {
    return skv_row_in_block(skv_block_of(row_table, blocks, p, block_size), p, block_size);
}

// A row as the residency takes it: int32, SKV_UNMAPPED where there is none.
__device__ __forceinline__ int skv_host_row_of(const i64 row) {
    return (row >= 0 && row <= 0x7fffffffll) ? (int)row : SKV_UNMAPPED;
}

// The host row of position p as the residency takes it: int32, SKV_UNMAPPED where none.
template <typename T, typename I>
__device__ __forceinline__ int skv_host_row(const T* __restrict__ row_table, const int blocks, const I p,
                                            const I block_size) {
    return skv_host_row_of(skv_position_row(row_table, blocks, p, block_size));
}
