// The engine side of the doorbell transport: kernels that run on the ENGINE's stream
// (client/doorbell.py), between its own kernels, inside its CUDA graph. They write the
// step blocks the daemon's stream reads (through CUDA IPC, in the daemon's arena) and
// turn the daemon's slots into the indices the engine's sparse attention reads; and
// skv_map_positions_*, for a top-k that goes to the daemon in a TOPK message
// (client/swap_in.py).
//
// With a `bell` (signalling by kernels, client/doorbell.py), skv_db_begin and skv_db_topk
// ring it themselves once the whole block is written (skv_ring_when_done; `done` is the
// topk's arrival counter, one per group); null: the caller rings with a stream operation.
//
// Launch shapes come from the engine's tensor shapes (fixed in its graph); every value is
// checked again by the daemon's kernels. Step numbers come from a device counter the
// engine's stream bumps in skv_db_begin, so a replayed graph describes each step right.
#include "positions.cuh"

// Columns a thread of skv_db_topk / skv_db_indices keeps in flight (loads before stores).
#ifndef SKV_DB_UNROLL
#define SKV_DB_UNROLL 8
#endif

// The STEP block: desc, rows = state_rows, aux = reset (0/1), payload = invalidate [n, inv_n].
// counter[0] is the engine's step number (bumped here, once per step).
extern "C" __global__ void skv_db_begin(int* __restrict__ blk, int* __restrict__ counter,
                                        const int* __restrict__ state_rows, const int n,
                                        const unsigned char* __restrict__ reset,
                                        const int* __restrict__ invalidate, const int inv_n,
                                        const int max_batch, u32* bell) {
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    const int stride = gridDim.x * blockDim.x;
    if (tid == 0) {
        const int step = counter[0] + 1;
        counter[0] = step;
        for (int i = 0; i < SKV_DESC_INTS; ++i) blk[i] = 0;
        blk[SKV_D_SEQ] = step;
        blk[SKV_D_STEP] = step;
        blk[SKV_D_BATCH] = n;
        blk[SKV_D_INV_N] = inv_n;
    }
    int* rows = blk + SKV_DESC_INTS;
    int* aux = rows + max_batch;
    int* payload = aux + max_batch;
    for (int b = tid; b < n; b += stride) {
        rows[b] = state_rows[b];
        aux[b] = reset ? (reset[b] ? 1 : 0) : 0;
    }
    const i64 total = (i64)n * inv_n;
    for (i64 i = tid; i < total; i += stride) payload[i] = invalidate[i];
    skv_ring_when_done(nullptr, bell);  // one block: rings once its writes are visible
}

// The TOPK block of a group, from the leader layer's logical top-k. Column j of token t
// holds position p; its host row is skv_host_row through the table row of req = req_ids[t]
// (a req outside the table -> SKV_UNMAPPED). A position whose block the engine still holds
// on its GPU (resident[req, p / bs] >= 0, when `resident` is given) -> -1: no host row,
// not a miss, not counted; skv_db_indices points it at the resident copy.
// Without a table (null), the top-k holds host rows and is copied as it is.
// Grid: one block per token (grid-stride), any block size.
extern "C" __global__ void skv_db_topk(int* __restrict__ blk, const int* __restrict__ counter,
                                       const int* __restrict__ req_ids, const int tokens,
                                       const int* __restrict__ table, const int table_rows,
                                       const int max_blocks,
                                       const int* __restrict__ resident, const int res_blocks,
                                       const int* __restrict__ topk, const int k, const int block_size,
                                       const int group, const int max_batch,
                                       u32* done, u32* bell) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        for (int i = 0; i < SKV_DESC_INTS; ++i) blk[i] = 0;
        blk[SKV_D_SEQ] = counter[0];
        blk[SKV_D_STEP] = counter[0];
        blk[SKV_D_BATCH] = tokens;
        blk[SKV_D_K] = k;
        blk[SKV_D_GROUP] = group;
    }
    int* rows = blk + SKV_DESC_INTS;
    int* payload = rows + 2 * max_batch;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const int req = req_ids[t];
        const bool live = req >= 0 && req < table_rows;
        if (threadIdx.x == 0) rows[t] = req < 0 ? -1 : req;  // the daemon checks the range
        const int* trow = table ? table + (i64)(live ? req : 0) * max_blocks : nullptr;
        const int* rrow = resident ? resident + (i64)(live ? req : 0) * res_blocks : nullptr;
        const int* tk = topk + (i64)t * k;
        int* pl = payload + (i64)t * k;
        // SKV_DB_UNROLL columns a thread in flight: every load of a tile is issued before
        // the first store (a batch-1 step waits on this kernel's latency, not its bytes).
        for (int j0 = 0; j0 < k; j0 += blockDim.x * SKV_DB_UNROLL) {
            int v[SKV_DB_UNROLL];
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                v[u] = j < k ? tk[j] : -1;
            }
            if (trow) {  // block-uniform
                // Both tables' entries of every column loaded (none waiting on another; no
                // branch around a load, skv_entry_of), then each column's row.
                int rb[SKV_DB_UNROLL], tb[SKV_DB_UNROLL];
                if (live && rrow && res_blocks > 0) {  // token-uniform, as the next
#pragma unroll
                    for (int u = 0; u < SKV_DB_UNROLL; ++u) rb[u] = skv_entry_of(rrow, res_blocks, v[u], block_size);
                } else {
#pragma unroll
                    for (int u = 0; u < SKV_DB_UNROLL; ++u) rb[u] = -1;
                }
                if (live && max_blocks > 0) {
#pragma unroll
                    for (int u = 0; u < SKV_DB_UNROLL; ++u) tb[u] = skv_entry_of(trow, max_blocks, v[u], block_size);
                } else {
#pragma unroll
                    for (int u = 0; u < SKV_DB_UNROLL; ++u) tb[u] = -1;
                }
#pragma unroll
                for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                    const int p = v[u];
                    if (!live) v[u] = SKV_UNMAPPED;
                    else if (skv_row_in_block((i64)rb[u], p, block_size) >= 0) v[u] = -1;  // resident on the engine's GPU
                    else v[u] = skv_host_row_of(skv_row_in_block((i64)tb[u], p, block_size));
                }
            }
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                if (j < k) pl[j] = v[u];
            }
        }
    }
    skv_ring_when_done(done, bell);
}

// Attention indices of one layer: out[t, j] =
//   resident copy:  resident_base + resident[req, p / bs] * bs + p % bs
//   hot slot s >= 0: hot_base + req * region_stride + s
//   otherwise -1 (and -1 everywhere once `dead[0]` is set: the daemon is gone; or once
//   `stopped[0]` is, the rank's word in the daemon's arena: its TP group stopped; -1 for
//   an index that would not fit int32: a resident block number far out of range).
// `slots` is the group's [max_batch, ld] result. valid[t] (optional) = entries >= 0.
// `clear` (optional): the layer's ready word. Without `arrivals` the stream waited for it
// already and block 0 sets it to 0 first thing. With `arrivals` (a zeroed counter of the
// layer) this kernel is the wait: thread 0 of every block polls the word until it is set
// (or `dead` is), and the last block to see it sets it and the counter to 0 again. Its
// launcher polls with one block only: a polling block holds an SM that the daemon's
// resolve (a whole SM's registers a block) cannot share.
// Grid: one block per token (grid-stride); blockDim a multiple of 32, at most 1024.
extern "C" __global__ void skv_db_indices(const int* slots, const int ld,
                                          const int* __restrict__ req_ids, const int tokens,
                                          const int* __restrict__ topk, const int k,
                                          const int* __restrict__ resident, const int res_blocks,
                                          const int table_rows, const int block_size,
                                          const int region_stride,
                                          const i64 hot_base, const i64 resident_base,
                                          const int* __restrict__ dead, const u32* __restrict__ stopped,
                                          int* __restrict__ out, int* __restrict__ valid,
                                          u32* clear, u32* arrivals) {
    __shared__ int count;
    // The layer's ready word: clearing it here saves a stream operation. The daemon sets
    // it again only after the next bell, which this stream rings later.
    if (clear && arrivals) {
        if (threadIdx.x == 0) {
            // Or until the handle's dead word or the rank's stopped word is set (each set
            // before the ready words it releases): a poll that could never end must not
            // outlive its process (MPS).
            while (*(volatile u32*)clear == 0u && !(dead && *(volatile const int*)dead != 0)
                   && !(stopped && *(volatile const u32*)stopped != 0u)) __nanosleep(64);
            __threadfence();  // the rows and slots written before the word, seen after it
            if (atomicAdd(arrivals, 1u) == gridDim.x - 1) {  // every block has seen it
                atomicExch(arrivals, 0u);
                atomicExch(clear, 0u);
            }
        }
        __syncthreads();
    } else if (clear && blockIdx.x == 0 && threadIdx.x == 0) {
        *(volatile u32*)clear = 0u;
    }
    const bool gone = (dead && *(volatile const int*)dead != 0) || (stopped && *(volatile const u32*)stopped != 0u);
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        if (threadIdx.x == 0) count = 0;
        __syncthreads();
        const int req = req_ids[t];
        const bool live = !gone && req >= 0 && req < table_rows;
        const int* rrow = (resident && live) ? resident + (i64)req * res_blocks : nullptr;
        int mine = 0;
        // SKV_DB_UNROLL columns a thread in flight, as skv_db_topk.
        for (int j0 = 0; j0 < k; j0 += blockDim.x * SKV_DB_UNROLL) {
            int o[SKV_DB_UNROLL], sl[SKV_DB_UNROLL], pos[SKV_DB_UNROLL], rb[SKV_DB_UNROLL];
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                const bool on = live && j < k;
                // Loaded whatever the others hold: no load waits on another's value.
                pos[u] = (on && rrow) ? topk[(i64)t * k + j] : -1;  // (topk may be null without resident)
                sl[u] = on ? __ldcg(slots + (i64)t * ld + j) : -1;  // (written by the daemon while this kernel may poll)
            }
            if (rrow && res_blocks > 0) {  // token-uniform; no branch around a load (skv_entry_of)
#pragma unroll
                for (int u = 0; u < SKV_DB_UNROLL; ++u) rb[u] = skv_entry_of(rrow, res_blocks, pos[u], block_size);
            } else {
#pragma unroll
                for (int u = 0; u < SKV_DB_UNROLL; ++u) rb[u] = -1;
            }
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                o[u] = -1;
                if (live && j < k) {
                    const i64 r = skv_row_in_block((i64)rb[u], pos[u], block_size);
                    i64 v = -1;
                    if (r >= 0) v = resident_base + r;
                    else if (sl[u] >= 0) v = hot_base + (i64)req * region_stride + sl[u];
                    if (v <= 0x7fffffffll) o[u] = (int)v;  // an index past int32 is no row (-1)
                }
            }
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                if (j < k) {
                    out[(i64)t * k + j] = o[u];
                    mine += o[u] >= 0;
                }
            }
        }
        if (valid) {
            if (mine) atomicAdd(&count, mine);
            __syncthreads();
            if (threadIdx.x == 0) valid[t] = count;
        }
        __syncthreads();
    }
}

// Host rows of logical positions into out[t, j] (int32 [tokens, k]): skv_host_row for
// positions P and a block table T of int32 or int64 (what a torch engine holds); a token
// whose req_ids[t] is outside [0, table_rows) maps nothing. Grid: one block per token
// (grid-stride), any block size.
template <typename P, typename T>
__device__ __forceinline__ void skv_map_positions(int* __restrict__ out, const int* __restrict__ req_ids,
                                                  const int tokens, const T* __restrict__ table,
                                                  const int table_rows, const int max_blocks,
                                                  const P* __restrict__ topk, const int k, const i64 block_size) {
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const int req = req_ids[t];
        const bool live = req >= 0 && req < table_rows;
        const T* trow = live ? table + (i64)req * max_blocks : nullptr;
        for (int j = threadIdx.x; j < k; j += blockDim.x)
            out[(i64)t * k + j] = skv_host_row(trow, max_blocks, (i64)topk[(i64)t * k + j], block_size);
    }
}

#define SKV_MAP_POSITIONS(NAME, P, T)                                                                  \
    extern "C" __global__ void NAME(int* __restrict__ out, const int* __restrict__ req_ids,            \
                                    const int tokens, const T* __restrict__ table, const int table_rows, \
                                    const int max_blocks, const P* __restrict__ topk, const int k,     \
                                    const i64 block_size) {                                            \
        skv_map_positions<P, T>(out, req_ids, tokens, table, table_rows, max_blocks, topk, k, block_size); \
    }
SKV_MAP_POSITIONS(skv_map_positions_i32_i32, int, int)
SKV_MAP_POSITIONS(skv_map_positions_i64_i32, i64, int)
SKV_MAP_POSITIONS(skv_map_positions_i32_i64, int, i64)
SKV_MAP_POSITIONS(skv_map_positions_i64_i64, i64, i64)
