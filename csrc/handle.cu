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
//
// At batch 1 this kernel runs beside the query's matmuls, where every instruction it
// issues costs 1.6-3x its time alone (PERF.md runs BP, BR): the body is specialised on whether a
// resident table is given and whether the block size is a power of two (a shift, not a
// division), so the common path issues only the instructions it needs.
template <bool kResident, bool kPow2>
__device__ __forceinline__ void skv_db_topk_rows(int* __restrict__ rows, int* __restrict__ payload,
                                                 const int* __restrict__ req_ids, const int tokens,
                                                 const int* __restrict__ table, const int table_rows,
                                                 const int max_blocks, const int* __restrict__ resident,
                                                 const int res_blocks, const int* __restrict__ topk, const int k,
                                                 const int block_size) {
    const int shift = kPow2 ? __ffs(block_size) - 1 : 0;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const int req = req_ids[t];
        const bool live = req >= 0 && req < table_rows;
        if (threadIdx.x == 0) rows[t] = req < 0 ? -1 : req;  // the daemon checks the range
        const bool tab = live && max_blocks > 0;                // token-uniform, as the next
        const bool res = kResident && live && res_blocks > 0;
        const int* trow = table + (i64)(tab ? req : 0) * max_blocks;
        const int* rrow = kResident ? resident + (i64)(res ? req : 0) * res_blocks : nullptr;
        const int* tk = topk + (i64)t * k;
        int* pl = payload + (i64)t * k;
        // SKV_DB_UNROLL columns a thread in flight: every load of a tile is issued before
        // the first store, and no load waits on another's value (skv_entry_of).
        for (int j0 = 0; j0 < k; j0 += blockDim.x * SKV_DB_UNROLL) {
            int v[SKV_DB_UNROLL], tb[SKV_DB_UNROLL], rb[SKV_DB_UNROLL];
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                v[u] = j < k ? tk[j] : -1;
            }
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                tb[u] = skv_entry_of<kPow2>(trow, tab, max_blocks, v[u], block_size, shift);
                if (kResident) rb[u] = skv_entry_of<kPow2>(rrow, res, res_blocks, v[u], block_size, shift);
            }
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                int r = SKV_UNMAPPED;
                if (kResident && rb[u] >= 0) r = -1;  // resident on the engine's GPU
                else if (tb[u] >= 0)
                    r = skv_host_row_of((i64)tb[u] * block_size + skv_in_block<kPow2>(v[u], block_size));
                if (j < k) pl[j] = r;
            }
        }
    }
}

extern "C" __global__ void skv_db_topk(int* __restrict__ blk, const int* __restrict__ counter,
                                       const int* __restrict__ req_ids, const int tokens,
                                       const int* __restrict__ table, const int table_rows,
                                       const int max_blocks,
                                       const int* __restrict__ resident, const int res_blocks,
                                       const int* __restrict__ topk, const int k, const int block_size,
                                       const int group, const int max_batch,
                                       u32* done, u32* bell, const int local_bell) {
    // The descriptor, an int a thread (block 0).
    for (int i = threadIdx.x; blockIdx.x == 0 && i < SKV_DESC_INTS; i += blockDim.x) {
        int d = 0;
        if (i == SKV_D_SEQ || i == SKV_D_STEP) d = counter[0];
        else if (i == SKV_D_BATCH) d = tokens;
        else if (i == SKV_D_K) d = k;
        else if (i == SKV_D_GROUP) d = group;
        blk[i] = d;
    }
    int* rows = blk + SKV_DESC_INTS;
    int* payload = rows + 2 * max_batch;
    if (!table) {  // host rows already: copied as they are
        for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
            if (threadIdx.x == 0) rows[t] = req_ids[t] < 0 ? -1 : req_ids[t];
            for (int j = threadIdx.x; j < k; j += blockDim.x) payload[(i64)t * k + j] = topk[(i64)t * k + j];
        }
    } else {  // block-uniform choices: one path each
        const bool pow2 = (block_size & (block_size - 1)) == 0;
        if (resident) {
            if (pow2) skv_db_topk_rows<true, true>(rows, payload, req_ids, tokens, table, table_rows, max_blocks,
                                                   resident, res_blocks, topk, k, block_size);
            else skv_db_topk_rows<true, false>(rows, payload, req_ids, tokens, table, table_rows, max_blocks,
                                               resident, res_blocks, topk, k, block_size);
        } else if (pow2) {
            skv_db_topk_rows<false, true>(rows, payload, req_ids, tokens, table, table_rows, max_blocks, nullptr,
                                          0, topk, k, block_size);
        } else {
            skv_db_topk_rows<false, false>(rows, payload, req_ids, tokens, table, table_rows, max_blocks, nullptr,
                                           0, topk, k, block_size);
        }
    }
    // `local_bell`: only this GPU waits on the bell (the daemon's stream; no TP group's
    // leader on another GPU): a device-scope fence orders the block before it.
    skv_ring_when_done(done, bell, local_bell != 0);
}

// skv_db_indices' tokens: `gone` (the daemon or the TP group stopped) -> -1 everywhere.
// Specialised as skv_db_topk's rows: whether a resident table is given (without one the
// top-k and block size are not read) and whether the block size is a power of two.
template <bool kResident, bool kPow2>
__device__ __forceinline__ void skv_db_indices_rows(const int* slots, const int ld, const int* __restrict__ req_ids,
                                                    const int tokens, const int* __restrict__ topk, const int k,
                                                    const int* __restrict__ resident, const int res_blocks,
                                                    const int table_rows, const int block_size,
                                                    const int region_stride, const i64 hot_base,
                                                    const i64 resident_base, const bool gone,
                                                    int* __restrict__ out, int* __restrict__ valid) {
    __shared__ int count;
    const int shift = kPow2 ? __ffs(block_size) - 1 : 0;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        if (threadIdx.x == 0) count = 0;
        __syncthreads();
        const int req = req_ids[t];
        const bool live = !gone && req >= 0 && req < table_rows;
        const bool res = kResident && live && res_blocks > 0;  // token-uniform
        const int* rrow = kResident ? resident + (i64)(res ? req : 0) * res_blocks : nullptr;
        const i64 hot = hot_base + (i64)(live ? req : 0) * region_stride;  // the request's region
        const int* sl_row = slots + (i64)t * ld;
        const int* tk = kResident ? topk + (i64)t * k : nullptr;
        int* o_row = out + (i64)t * k;
        int mine = 0;
        // SKV_DB_UNROLL columns a thread in flight, as skv_db_topk.
        for (int j0 = 0; j0 < k; j0 += blockDim.x * SKV_DB_UNROLL) {
            int sl[SKV_DB_UNROLL], pos[SKV_DB_UNROLL], rb[SKV_DB_UNROLL];
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                const bool on = live && j < k;
                // Loaded whatever the others hold: no load waits on another's value.
                sl[u] = on ? __ldcg(sl_row + j) : -1;  // (written by the daemon while this kernel may poll)
                if (kResident) pos[u] = (on && res) ? tk[j] : -1;
            }
            if (kResident) {
#pragma unroll
                for (int u = 0; u < SKV_DB_UNROLL; ++u)
                    rb[u] = skv_entry_of<kPow2>(rrow, res, res_blocks, pos[u], block_size, shift);
            }
#pragma unroll
            for (int u = 0; u < SKV_DB_UNROLL; ++u) {
                const int j = j0 + u * blockDim.x + threadIdx.x;
                i64 v = -1;
                if (kResident && rb[u] >= 0)
                    v = resident_base + (i64)rb[u] * block_size + skv_in_block<kPow2>(pos[u], block_size);
                else if (sl[u] >= 0) v = hot + sl[u];
                const int o = v <= 0x7fffffffll ? (int)v : -1;  // an index past int32 is no row
                if (j < k) {
                    o_row[j] = o;
                    mine += o >= 0;
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
// `slots_ready` (optional, with `arrivals`): the group's TOPK block's SKV_D_SLOTS word,
// which the daemon's gather sets once the resolve's slots are written: the indices are
// made as soon as it (or the ready word) is set, while the rows still cross PCIe, and the
// kernel then waits for the ready word; if the daemon or the TP group stops meanwhile,
// they are -1 again. A daemon that never sets it leaves the plain wait.
// Grid: one block per token (grid-stride); blockDim a multiple of 32, at most 1024.
__device__ __forceinline__ bool skv_db_gone(const int* dead, const u32* stopped) {
    return (dead && *(volatile const int*)dead != 0) || (stopped && *(volatile const u32*)stopped != 0u);
}

// Thread 0 of each block: until `word` (or `also`, when given) is set, or the handle's dead
// word or the rank's stopped word is (each set before the ready words it releases): a poll
// that could never end must not outlive its process (MPS). Then the rows and slots
// written before the word are seen after it.
__device__ __forceinline__ void skv_db_poll(const u32* word, const int* also, const int* dead, const u32* stopped) {
    while (*(volatile const u32*)word == 0u && !(also && *(volatile const int*)also != 0) &&
           !skv_db_gone(dead, stopped))
        __nanosleep(64);
    __threadfence();
}

// Thread 0 of each block, once it has seen the ready word: the last block of the grid sets
// it and the arrival counter to 0 again.
__device__ __forceinline__ void skv_db_consume(u32* clear, u32* arrivals) {
    if (atomicAdd(arrivals, 1u) == gridDim.x - 1) {  // every block has seen it
        atomicExch(arrivals, 0u);
        atomicExch(clear, 0u);
    }
}

extern "C" __global__ void skv_db_indices(const int* slots, const int ld,
                                          const int* __restrict__ req_ids, const int tokens,
                                          const int* __restrict__ topk, const int k,
                                          const int* __restrict__ resident, const int res_blocks,
                                          const int table_rows, const int block_size,
                                          const int region_stride,
                                          const i64 hot_base, const i64 resident_base,
                                          const int* __restrict__ dead, const u32* __restrict__ stopped,
                                          int* __restrict__ out, int* __restrict__ valid,
                                          u32* clear, u32* arrivals, const int* slots_ready) {
    // The layer's ready word: clearing it here saves a stream operation. The daemon sets
    // it again only after the next bell, which this stream rings later.
    const bool polls = clear && arrivals;
    const bool early = polls && slots_ready;
    if (polls) {
        if (threadIdx.x == 0) {
            skv_db_poll(clear, early ? slots_ready : nullptr, dead, stopped);
            if (!early) skv_db_consume(clear, arrivals);
        }
        __syncthreads();
    } else if (clear && blockIdx.x == 0 && threadIdx.x == 0) {
        *(volatile u32*)clear = 0u;
    }
    const bool gone = skv_db_gone(dead, stopped);
    if (resident) {  // block-uniform: one path each (see skv_db_topk)
        if ((block_size & (block_size - 1)) == 0)
            skv_db_indices_rows<true, true>(slots, ld, req_ids, tokens, topk, k, resident, res_blocks, table_rows,
                                            block_size, region_stride, hot_base, resident_base, gone, out, valid);
        else
            skv_db_indices_rows<true, false>(slots, ld, req_ids, tokens, topk, k, resident, res_blocks, table_rows,
                                             block_size, region_stride, hot_base, resident_base, gone, out, valid);
    } else {
        skv_db_indices_rows<false, true>(slots, ld, req_ids, tokens, topk, k, nullptr, 0, table_rows, block_size,
                                         region_stride, hot_base, resident_base, gone, out, valid);
    }
    if (!early) return;
    // The indices are out; now the rows (the stream's next kernel reads them).
    __shared__ int sh_gone;
    if (threadIdx.x == 0) {
        skv_db_poll(clear, nullptr, dead, stopped);
        skv_db_consume(clear, arrivals);
        // Read again whatever `gone` said: each thread read it for itself, and a warp that
        // read it before the watcher set it made live indices to rows that may never come.
        sh_gone = skv_db_gone(dead, stopped);
    }
    __syncthreads();
    if (!sh_gone) return;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {  // gone while the rows came: -1 after all
        for (int j = threadIdx.x; j < k; j += blockDim.x) out[(i64)t * k + j] = -1;
        if (valid && threadIdx.x == 0) valid[t] = 0;
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
