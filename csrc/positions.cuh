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
template <typename T, typename I>
__device__ __forceinline__ i64 skv_position_row(const T* __restrict__ row_table, const int blocks, const I p,
                                                const I block_size) {
    if (!row_table || p < 0) return -1;
    const I blkno = p / block_size;
    if (blkno >= blocks) return -1;
    const i64 b = (i64)row_table[blkno];
    if (b < 0) return -1;
    if (b > 0x7fffffffll) return 0x80000000ll;
    return b * block_size + (i64)(p % block_size);
}

// The host row of position p as the residency takes it: int32, SKV_UNMAPPED where none.
template <typename T, typename I>
__device__ __forceinline__ int skv_host_row(const T* __restrict__ row_table, const int blocks, const I p,
                                            const I block_size) {
    const i64 row = skv_position_row(row_table, blocks, p, block_size);
    return (row >= 0 && row <= 0x7fffffffll) ? (int)row : SKV_UNMAPPED;
}
