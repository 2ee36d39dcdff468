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

// skv_block_of for a kernel that loads every column's entry before it uses any: the entry
// is loaded whatever p is (at index 0 when p < 0 or p / bs is past the table, then -1),
// and returned as loaded. With a branch around each load, the compiler widened each entry
// to 64 bits right where it was loaded, so a thread waited on its loads one after another
// (skv_db_topk at batch 1: 4.2 us alone, 3.3 with this; PERF.md run BN). `row_table`
// non-null, with `blocks` >= 1.
template <typename T, typename I>
__device__ __forceinline__ T skv_entry_of(const T* __restrict__ row_table, const int blocks, const I p,
                                          const I block_size) {
    const I blkno = p / block_size;
    const bool in = p >= 0 && blkno < blocks;
    const T e = row_table[in ? blkno : 0];
    return in ? e : (T)-1;
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
