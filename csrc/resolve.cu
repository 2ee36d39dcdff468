// Residency kernels: resolve (the exact contract of DESIGN.md §4), begin step, reset,
// invalidate. State: owner and lru are int32 [groups, max_reqs, region_stride]. The
// algorithm: csrc/README.md; the launch code: daemon/residency/cuda/residency.py.
#include "common.cuh"

#ifndef SKV_RESOLVE_THREADS
#define SKV_RESOLVE_THREADS 1024
#endif
#define SKV_RT SKV_RESOLVE_THREADS
// The hash table's entries per power-of-two column: 2 (load at most 1/2) or 4 (1/4:
// shorter probe runs, twice the shared memory).
#ifndef SKV_HASH_SCALE
#define SKV_HASH_SCALE 2
#endif
static_assert(SKV_HASH_SCALE == 2 || SKV_HASH_SCALE == 4, "SKV_HASH_SCALE is 2 or 4");
// Where the lru partition writes the new lru: 1 into the workspace (lnew), then one
// coalesced copy to global memory; 0 scattered to global memory at once.
#ifndef SKV_LRU_SMEM
#define SKV_LRU_SMEM 0
#endif
// Where the hit lookup reads the region's owners: 1 from a copy in the workspace (ocopy,
// loaded with the lru row in phase 1: the global loads in one burst), 0 from global memory.
#ifndef SKV_OWNER_SMEM
#define SKV_OWNER_SMEM 0
#endif
// Where the workspace is: 1 dynamic shared memory (ws_global must be null), so its
// accesses compile to shared-memory instructions; 0 decided per launch (generic accesses).
#ifndef SKV_WS_SMEM
#define SKV_WS_SMEM 0
#endif
#define SKV_P1_WAVE 3     // phase 1 loads this many entries a thread per wave
#define SKV_RANK_MAX 512  // the plan ranks up to this many misses by counting, sorts more

#define SKV_NONE (-1)
#define SKV_PENDING 0x7fffffff       // a valid column not (yet) known to hit
#define SKV_MISS_TAG 0x40000000      // colv = MISS_TAG | slot once a miss got its slot
#define SKV_SLOT_MASK 0x3fffffff
#define SKV_NO_KEY 0xffffffffffffffffull

// Per-row workspace, in dynamic shared memory when it fits, else in a global scratch slice
// per block. Byte layout (each part 16-aligned), mirrored by resolve_workspace_bytes()
// (daemon/residency/cuda/device.py):
//   keys  u64[kp]          (host row << 32 | column) in column order; kp = pow2 >= k
//   colv  int[k]           per column: NONE, PENDING, hit slot, or MISS_TAG | slot
//   evict int[k]           the oldest evictable slots, in LRU order (miss m takes evict[m])
//   hmask u32[ceil(S/32)]  bit per slot: a hit this step
//   smask u32[ceil(S/32)]  bit per slot: seen in the lru (finds repeated entries)
//   fmask u32[ceil(S/32)]  bit per slot: its prefetch mark was set (read with the lru row)
//   lcopy int[S]           the lru row as it was before this resolve
//   lnew  int[S]           only with SKV_LRU_SMEM 1: the new lru row, copied out whole
//   ocopy int[S]           only with SKV_OWNER_SMEM 1: the owner row as it was
//   htab  int[H kp], hcol int[H kp]  (H = SKV_HASH_SCALE) host row -> column table;
//                          then the plan's: the misses' host rows (hcol[0, kp)) and slots
//                          (hcol[kp, 2 kp)), their ranks (htab), or u64[kp] sort keys (htab)
struct SkvWs {
    u64* keys;
    int* colv;
    int* evict;
    u32* hmask;
    u32* smask;
    u32* fmask;
    int* lcopy;
    int* lnew;
    int* ocopy;
    int* htab;
    int* hcol;
};

__device__ __forceinline__ SkvWs skv_ws(unsigned char* base, int kp, int k, int S) {
    SkvWs w;
    u64 off = 0;
    w.keys = (u64*)(base + off);
    off += skv_align16((u64)kp * 8ull);
    w.colv = (int*)(base + off);
    off += skv_align16((u64)k * 4ull);
    w.evict = (int*)(base + off);
    off += skv_align16((u64)k * 4ull);
    w.hmask = (u32*)(base + off);
    off += skv_align16((u64)((S + 31) / 32) * 4ull);
    w.smask = (u32*)(base + off);
    off += skv_align16((u64)((S + 31) / 32) * 4ull);
    w.fmask = (u32*)(base + off);
    off += skv_align16((u64)((S + 31) / 32) * 4ull);
    w.lcopy = (int*)(base + off);
    off += skv_align16((u64)S * 4ull);
    w.lnew = (int*)(base + off);
    off += SKV_LRU_SMEM ? skv_align16((u64)S * 4ull) : 0;
    w.ocopy = (int*)(base + off);
    off += SKV_OWNER_SMEM ? skv_align16((u64)S * 4ull) : 0;
    w.htab = (int*)(base + off);
    w.hcol = w.htab + SKV_HASH_SCALE * kp;
    return w;
}

__device__ __forceinline__ void skv_clear_masks(const SkvWs& w, int mask_words) {
    for (int i = threadIdx.x; i < mask_words; i += SKV_RT) {
        w.hmask[i] = 0u;
        w.smask[i] = 0u;
        w.fmask[i] = 0u;
    }
}

// The home slot of host row g in a table of (1 << bits) entries (Fibonacci hashing: a
// request's rows come in runs of consecutive numbers, which it spreads).
__device__ __forceinline__ u32 skv_hash_slot(int g, int bits) {
    return ((u32)g * 2654435769u) >> (32 - bits);
}

// Whether old lru entry sl (a slot) is a hit of this step: in [0, S) and in the hit mask.
__device__ __forceinline__ bool skv_lru_hit(const SkvWs& w, int sl, int S) {
    return sl >= 0 && sl < S && ((w.hmask[sl >> 5] >> (sl & 31)) & 1u);
}

// Where old lru entry i (slot sl) goes in the new lru = evictables[n_take:] +
// evictables[:n_take] + hits, stable; `e` evictables come before it. The first n_take
// evictables also go to evict[] (the misses take them in column order).
__device__ __forceinline__ int skv_lru_pos(const SkvWs& w, int sl, bool hit, int i, int e, int n_evict,
                                           int n_take) {
    if (hit) return n_evict + (i - e);
    if (e < n_take) {
        w.evict[e] = sl;
        return n_evict - n_take + e;
    }
    return e - n_take;
}

// Column c's slot once the lru is partitioned: its hit slot, or for the m-th miss the
// m-th evictable, which it now owns (owner, colv = MISS_TAG | slot); -1 for an invalid
// column and for a miss without a valid evictable (corrupt: *bad_slot = 1, not planned).
__device__ __forceinline__ int skv_slot_of(const SkvWs& w, int c, int m, int n_take, int S,
                                           int* __restrict__ owner, int* bad_slot) {
    const int v = w.colv[c];
    if (v >= 0 && v < S) return v;
    if (v != SKV_PENDING) return SKV_NONE;
    const int sl = m < n_take ? w.evict[m] : -1;
    if (sl >= 0 && sl < S) {
        owner[sl] = (int)(w.keys[c] >> 32);  // the host row the plan gathers (a pending column's key)
        w.colv[c] = SKV_MISS_TAG | sl;
        return sl;
    }
    w.colv[c] = SKV_NONE;
    *bad_slot = 1;
    return SKV_NONE;
}

// [c0, c1): thread tid's contiguous chunk of n entries, `per` entries a thread.
__device__ __forceinline__ void skv_chunk(int n, int* per, int* c0, int* c1) {
    *per = (n + SKV_RT - 1) / SKV_RT;
    *c0 = threadIdx.x * *per < n ? threadIdx.x * *per : n;
    *c1 = *c0 + *per < n ? *c0 + *per : n;
}

// Ascending bitonic sort of a[0, n), n a power of two, by the whole block (the caller
// synchronised after writing a[]; ends with __syncthreads()). Pair t compares a[i] and
// a[i + stride], i = 2t - (t & (stride - 1)): for strides up to 32 a warp's pairs stay
// inside its 64 elements (SKV_RT is a multiple of 32), so two such stages in a row only
// need __syncwarp(); a larger stride, and the stage after it, need the whole block.
__device__ __forceinline__ void skv_bitonic_sort(u64* a, int n) {
    const int half = n >> 1;
    int prev_stride = 1;
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            if (stride <= 32 && prev_stride <= 32) __syncwarp();
            else __syncthreads();
            prev_stride = stride;
            for (int t = threadIdx.x; t < half; t += SKV_RT) {
                const int i = 2 * t - (t & (stride - 1));
                const int j = i + stride;
                const u64 x = a[i];
                const u64 y = a[j];
                const bool ascending = (i & size) == 0;
                if ((x > y) == ascending) {
                    a[i] = y;
                    a[j] = x;
                }
            }
        }
    }
    __syncthreads();
}


// Resolve one top-k batch of one index group, as the step descriptor says.
//
// Grid: max_batch blocks, fixed; blocks at or past the descriptor's batch exit. The block
// of the first batch row naming a state row resolves every batch row naming it, in batch
// order (several query tokens of one request); the other blocks of that state row exit.
// Padding rows (state row -1) get slots -1 and 0 misses and touch no state.
// Per batch row b: slots_out[b] (a slot per column; -1: none, past k), misses[b], the misses
// in host-row order at the front of plan_rows[b] / plan_slots[b] (flat slot s * S + slot).
// A refused row (DUPLICATE_IDS; TOO_MANY_TOKENS: the t-th row of s with t > S / top_k,
// which could evict an earlier token's slots) gets slots -1 and 0 misses, changes no state
// and counts nothing. Corrupt state (an lru entry outside [0, S) or repeated, or fewer
// evictables than misses) never writes out of bounds: a miss without a valid evictable
// resolves to -1 and is not counted or planned. The error record says which row.
//
// counters (u64, accumulated): hits, misses, out_of_range (ids < -1 or >= host_rows of
// resolved rows), at counters + group * counters_per_group (0: one set for all groups).
// `clear` (optional): a word set to 0 first thing (the doorbell bell the stream waited on).
//
// __launch_bounds__(..., 1): one block per SM (one block per batch row, rarely more rows
// than SMs). Without the 1, ptxas caps the registers at 32 and spills.
extern "C" __global__ void __launch_bounds__(SKV_RT, 1) skv_resolve(
    const int* __restrict__ desc,       // step descriptor (batch, k, group, step)
    int* __restrict__ owner_all,        // [groups, max_reqs, S]
    int* __restrict__ lru_all,          // [groups, max_reqs, S]
    const int groups, const int max_reqs, const int S, const int host_rows,
    const int top_k,                    // the layout's top_k: S / top_k tokens per state row
    const int max_batch,
    const int* __restrict__ state_rows,  // [batch]
    const int* __restrict__ topk,       // [batch, k], contiguous
    const int out_k,                    // row stride of the outputs (>= k)
    int* __restrict__ slots_out,        // [max_batch, out_k]
    int* __restrict__ misses_out,       // [max_batch]
    int* __restrict__ plan_rows,        // [max_batch, out_k]
    int* __restrict__ plan_slots,       // [max_batch, out_k]
    u64* __restrict__ counters,         // [3] per group (see above)
    const int counters_per_group,       // 0 or 4
    int* __restrict__ err,              // the error record
    unsigned char* __restrict__ ws_global,  // null: workspace in dynamic shared memory
    const i64 ws_stride,                // bytes of one block's global workspace
    u32* clear,                         // a doorbell word this launch consumes (set to 0), or null
    unsigned char* __restrict__ fresh_all,  // [groups, max_reqs, S] prefetch marks, or null (prefetch off)
    u64* __restrict__ pf_counters)      // [SKV_PF_COUNTERS] with fresh_all (common.cuh)
{
    __shared__ int sh_rot[2 * (SKV_RT / 32)];
    SkvRot rot = {sh_rot, 0};
    // The gather after this kernel (launched programmatically) may take its SMs and read
    // its descriptor now; it waits for this grid's end before it reads the plan.
    skv_pdl_launch_dependents();
    // The doorbell's group bell: clearing it here saves a stream operation. The engine
    // rings it again only after this step's ready word, set after this kernel.
    if (clear && blockIdx.x == 0 && threadIdx.x == 0) *(volatile u32*)clear = 0u;
    SKV_DYN_SMEM(skv_smem);

    __shared__ int sh_desc[SKV_DESC_INTS];
    __shared__ int sh_row[1];
    __shared__ int sh_list[SKV_RT];  // batch rows of this block's state row (one tile)
    __shared__ int sh_bad[1];        // 1 a miss left without a slot, 2 a corrupt lru

    const int tid = threadIdx.x;
    const int b0 = blockIdx.x;
    // Every value that steers control flow is read once, by one thread, into shared
    // memory: a client may rewrite its step block while the kernel runs, and threads of
    // one block that saw different values would diverge around the barriers.
    if (tid < SKV_DESC_INTS) sh_desc[tid] = desc[tid];
    // Loaded with the descriptor, before the batch is known (one round trip fewer before
    // phase 1): the first tile's state rows (thread 0's is this block's own), and the rows
    // before b0 (the check below).
    const int sr_pre = b0 + tid < max_batch ? state_rows[b0 + tid] : -1;
    const int sr_low = tid < b0 && tid < max_batch ? state_rows[tid] : -1;
    if (tid == 0) sh_row[0] = sr_pre;
    __syncthreads();
    const int batch = sh_desc[SKV_D_BATCH];
    const int k = sh_desc[SKV_D_K];
    const int group = sh_desc[SKV_D_GROUP];
    // k < 65536 also keeps the packed hit/miss sum below exact (proto: top_k <= 32768).
    if (batch < 0 || batch > max_batch || k < 0 || k > out_k || k > 65535 || group < 0 || group >= groups) {
        // Nothing is resolved: every row gets slots -1 and 0 misses (the gather then
        // copies nothing, and no stale result of the ring entry is left for the client).
        for (int c = tid; c < out_k; c += SKV_RT) slots_out[(i64)b0 * out_k + c] = SKV_NONE;
        if (tid == 0) {
            misses_out[b0] = 0;
            if (b0 == 0) skv_report(err, SKV_E_BAD_STEP, -1, sh_desc);
        }
        return;
    }
    if (b0 >= batch) return;
    const int kp = skv_pow2(k);
    int* owner_g = owner_all + (i64)group * max_reqs * S;
    int* lru_g = lru_all + (i64)group * max_reqs * S;
    u64* cnt = counters + (i64)group * counters_per_group;
    const int s = sh_row[0];
    if (s < 0 || s >= max_reqs) {
        for (int c = tid; c < out_k; c += SKV_RT) slots_out[(i64)b0 * out_k + c] = SKV_NONE;
        if (tid == 0) {
            misses_out[b0] = 0;
            if (s != -1) skv_report(err, SKV_E_BAD_STATE_ROW, b0, sh_desc);
        }
        return;
    }
#if SKV_WS_SMEM
    unsigned char* base = skv_smem;
#else
    unsigned char* base = ws_global ? ws_global + (i64)b0 * ws_stride : skv_smem;
#endif
    const SkvWs w = skv_ws(base, kp, k, S);
    const int mask_words = (S + 31) / 32;
    skv_clear_masks(w, mask_words);  // ordered by the tile scan's barrier
    int* owner = owner_g + (i64)s * S;
    int* lru = lru_g + (i64)s * S;
    unsigned char* fresh = fresh_all ? fresh_all + ((i64)group * max_reqs + s) * S : nullptr;
    u64 pf_hits = 0, pf_wasted = 0;

    // Phase 1's keys and column states of column i < kp (id g when i < k); returns
    // (g out of range << 16) | (g valid): summed over a row, each count fits 16 bits.
    auto column = [&](int i, int g) -> int {
        u64 key = SKV_NO_KEY;
        int counts = 0;
        if (i < k) {
            const bool valid = g >= 0 && g < host_rows;
            counts = ((g < -1 || g >= host_rows) ? 1 << 16 : 0) | (valid ? 1 : 0);
            if (valid) key = ((u64)(u32)g << 32) | (u64)(u32)i;
            w.colv[i] = valid ? SKV_PENDING : SKV_NONE;
        }
        w.keys[i] = key;
        return counts;
    };
    const int sr_first = b0 + tid < batch ? sr_pre : -1;
    // Only the first batch row naming s works; it walks the later ones in order
    // (b0 < batch <= max_batch: the first SKV_RT of rows [0, b0) are in sr_low).
    int earlier = tid < b0 && sr_low == s;
    for (int j = tid + SKV_RT; j < b0; j += SKV_RT) earlier |= (state_rows[j] == s);
    if (__syncthreads_or(earlier)) return;

    u64 sum_hits = 0, sum_misses = 0, sum_oor = 0;
    int tokens = 0;

    // The batch rows of s, found by the whole block at once (a tile of SKV_RT rows per
    // pass, in batch order, into sh_list), then resolved one after another.
    for (int tile0 = b0; tile0 < batch; tile0 += SKV_RT) {
    const int bt = tile0 + tid;
    const bool of_s = bt == b0 || (bt < batch && (tile0 == b0 ? sr_first : state_rows[bt]) == s);
    int n_of_s;
    const int at = skv_rot_scan_flag<SKV_RT>(rot, of_s, &n_of_s);
    if (of_s) sh_list[at] = bt;
    __syncthreads();
    for (int li = 0; li < n_of_s; ++li) {
        const int b = sh_list[li];
        const int* ids = topk + (i64)b * k;
        int* out_slots = slots_out + (i64)b * out_k;
        ++tokens;
        if ((i64)tokens * top_k > S) {  // tokens > S / top_k, without the division
            for (int c = tid; c < out_k; c += SKV_RT) out_slots[c] = SKV_NONE;
            if (tid == 0) {
                misses_out[b] = 0;
                skv_report(err, SKV_E_TOO_MANY_TOKENS, b, sh_desc);
            }
            continue;
        }

        // 1a. Waves: the wave's loads of the top-k, lru and owner rows all issued before
        // its first shared store (one round trip a wave). Each lru entry is marked seen as
        // it is copied: with every entry in range, the lru repeats an entry iff a slot's
        // bit is missing (S entries, S slots), checked after the next barrier.
        const int hsize = SKV_HASH_SCALE * kp;  // a power of two >= 2
        const int hbits = __ffs(hsize) - 1;
        int oor = 0;
        int lru_bad = 0;
        const int span = kp > S ? kp : S;
        for (int base_i = 0; base_i < span; base_i += SKV_RT * SKV_P1_WAVE) {
            int vk[SKV_P1_WAVE], vl[SKV_P1_WAVE], vo[SKV_P1_WAVE], vf[SKV_P1_WAVE];
#pragma unroll
            for (int u = 0; u < SKV_P1_WAVE; ++u) {
                const int i = base_i + u * SKV_RT + tid;
                vk[u] = i < k ? ids[i] : 0;
                vl[u] = i < S ? lru[i] : 0;
                vo[u] = (SKV_OWNER_SMEM && i < S) ? owner[i] : 0;
                vf[u] = (fresh && i < S) ? fresh[i] : 0;  // the marks, read here (not in phase 4)
            }
            if (base_i == 0)  // hsize >= 4 but for k <= 1 (16-aligned): 16-byte stores
                for (int i = 4 * tid; i < hsize; i += 4 * SKV_RT) {
                    if (i + 4 <= hsize) *reinterpret_cast<int4*>(w.htab + i) = make_int4(-1, -1, -1, -1);
                    else for (int j = i; j < hsize; ++j) w.htab[j] = -1;
                }
#pragma unroll
            for (int u = 0; u < SKV_P1_WAVE; ++u) {
                const int i = base_i + u * SKV_RT + tid;
                if (i < kp) oor += column(i, vk[u]);
                if (i < S) {
                    const int v = vl[u];
                    w.lcopy[i] = v;
                    if (v < 0 || v >= S) lru_bad = 1;
                    else atomicOr(&w.smask[v >> 5], 1u << (v & 31));
                    if (SKV_OWNER_SMEM) w.ocopy[i] = vo[u];
                    if (vf[u]) atomicOr(&w.fmask[i >> 5], 1u << (i & 31));
                }
            }
        }
        if (tid == 0) sh_bad[0] = 0;
        const u32 col_counts = skv_rot_sum<SKV_RT, u32>(rot, (u32)oor);  // also orders the writes above
        const int n_oor = (int)(col_counts >> 16);
        const int n_valid = (int)(col_counts & 0xffffu);

        // 1b. every valid column into the table; a host row found there already is a
        // duplicate. With 2 or 4 times the entries of the columns a free one is always
        // found, and two threads inserting one host row meet at the same entry.
        int dup = 0;
        for (int i = tid; i < k; i += SKV_RT) {
            const u64 key = w.keys[i];
            if (key == SKV_NO_KEY) continue;
            const int g = (int)(key >> 32);
            u32 h = skv_hash_slot(g, hbits);
            while (true) {
                const int prev = atomicCAS(&w.htab[h], -1, g);
                if (prev == -1) {
                    w.hcol[h] = i;
                    break;
                }
                if (prev == g) {
                    dup = 1;
                    break;
                }
                h = (h + 1) & (u32)(hsize - 1);
            }
        }
        if (__syncthreads_or(dup)) {  // a barrier: nobody reads the workspace after it
            for (int c = tid; c < out_k; c += SKV_RT) out_slots[c] = SKV_NONE;
            if (tid == 0) {
                misses_out[b] = 0;
                skv_report(err, SKV_E_DUPLICATE_IDS, b, sh_desc);
            }
            continue;  // the seen marks stay: the next row marks the same, unchanged lru
        }

        // The seen marks are complete (a barrier since): every slot's bit must be set.
        for (int i = tid; i < mask_words; i += SKV_RT) {
            const u32 full = (i == mask_words - 1 && (S & 31)) ? (1u << (S & 31)) - 1u : 0xffffffffu;
            if (w.smask[i] != full) lru_bad = 1;
        }
        if (lru_bad) atomicOr(sh_bad, 2);  // read after the slots pass's barrier
        // 2. the reversed hit lookup: slot j looks owner[j] up; the lowest j wins a column
        // (atomicMin: the NumPy engine's stable argsort + searchsorted on a corrupt owner
        // row, whose marks are then redone from the column states below).
        int nh_found = 0, twice = 0;
        for (int j = tid; j < S; j += SKV_RT) {
            const int o = SKV_OWNER_SMEM ? w.ocopy[j] : owner[j];
            if (o < 0 || o >= host_rows) continue;
            u32 h = skv_hash_slot(o, hbits);
            while (true) {
                const int v = w.htab[h];
                if (v == -1) break;
                if (v == o) {
                    const int prev = atomicMin(&w.colv[w.hcol[h]], j);
                    if (prev == SKV_PENDING) {
                        atomicOr(&w.hmask[j >> 5], 1u << (j & 31));
                        ++nh_found;
                    } else {
                        twice = 1;
                    }
                    break;
                }
                h = (h + 1) & (u32)(hsize - 1);
            }
        }
        // One block sum for both (k <= 32768 columns: each count fits in 16 bits); the
        // misses are the valid columns less the hits.
        const u32 found = skv_rot_sum<SKV_RT, u32>(rot, ((u32)nh_found << 16) | (u32)twice);
        u32 both = (found & 0xffff0000u) | (u32)(n_valid - (int)(found >> 16));  // (hits << 16) | misses
        if (found & 0xffffu) {  // a host row owned twice: the marks from the column states
            for (int i = tid; i < mask_words; i += SKV_RT) w.hmask[i] = 0u;
            __syncthreads();
            int nh = 0, nm = 0;
            for (int c = tid; c < k; c += SKV_RT) {
                const int v = w.colv[c];
                if (v >= 0 && v < S) {
                    atomicOr(&w.hmask[v >> 5], 1u << (v & 31));
                    ++nh;
                } else if (v == SKV_PENDING) {
                    ++nm;
                }
            }
            both = skv_rot_sum<SKV_RT, u32>(rot, ((u32)nh << 16) | (u32)nm);
        }
        const int n_hit = (int)(both >> 16);
        const int n_miss = (int)(both & 0xffffu);
        int* const lru_out = SKV_LRU_SMEM ? w.lnew : lru;

        // 3. one pass over the old lru, each thread a chunk of it: new lru =
        // evictables[n_take:] + evictables[:n_take] + hits (stable). Counting the
        // evictables (not S - n_hit) keeps it a permutation even when the state is corrupt.
        int per, i0, i1;
        skv_chunk(S, &per, &i0, &i1);
        // Chunks of 4 (S = 4096): one 16-byte load, no bank conflicts; chunks of up to 4
        // otherwise (S = 2560: 3) unrolled, each entry predicated; longer ones a loop.
        const int n_chunk = i1 - i0;
        const bool vec = per == 4 && n_chunk == 4;  // block-uniform but for the last chunks
        const bool few = per <= 4;               // block-uniform
        int ev = 0;
        if (vec) {
            const int4 q = *reinterpret_cast<const int4*>(w.lcopy + i0);
            ev = !skv_lru_hit(w, q.x, S) + !skv_lru_hit(w, q.y, S) + !skv_lru_hit(w, q.z, S) +
                 !skv_lru_hit(w, q.w, S);
        } else if (few) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (r < n_chunk) ev += skv_lru_hit(w, w.lcopy[i0 + r], S) ? 0 : 1;
        } else {
            for (int i = i0; i < i1; ++i) ev += skv_lru_hit(w, w.lcopy[i], S) ? 0 : 1;
        }
        int n_evict;
        int e = skv_rot_scan_count<SKV_RT>(rot, ev, skv_bits_for(per), &n_evict);
        const int n_take = n_miss < n_evict ? n_miss : n_evict;
        int corrupt = n_take < n_miss;
        if (vec) {
            const int4 q = *reinterpret_cast<const int4*>(w.lcopy + i0);
            const int v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const bool hit = skv_lru_hit(w, v[r], S);
                lru_out[skv_lru_pos(w, v[r], hit, i0 + r, e, n_evict, n_take)] = v[r];
                e += hit ? 0 : 1;
            }
        } else if (few) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                if (r >= n_chunk) break;
                const int sl = w.lcopy[i0 + r];
                const bool hit = skv_lru_hit(w, sl, S);
                lru_out[skv_lru_pos(w, sl, hit, i0 + r, e, n_evict, n_take)] = sl;
                e += hit ? 0 : 1;
            }
        } else {
            for (int i = i0; i < i1; ++i) {
                const int sl = w.lcopy[i];
                const bool hit = skv_lru_hit(w, sl, S);
                lru_out[skv_lru_pos(w, sl, hit, i, e, n_evict, n_take)] = sl;
                e += hit ? 0 : 1;
            }
        }
        __syncthreads();
#if SKV_LRU_SMEM
        // After the partition's barrier; the next row of s reads lru after this row's last.
        for (int i = tid; i < S; i += SKV_RT) lru[i] = w.lnew[i];
#endif

        // 4. miss m (column order) takes evict[m]; every column's slot written; each miss's
        // host row and slot into the (now free) table at its number among the misses.
        int* const mrow = w.hcol;
        int* const mslot = w.hcol + kp;
        int* const mrank = w.htab;
        int bad_slot = 0;
        int total_pending = 0;
        {
            int c0, c1;
            skv_chunk(k, &per, &c0, &c1);
            int pend = 0;
            for (int c = c0; c < c1; ++c) pend += w.colv[c] == SKV_PENDING ? 1 : 0;
            int m = skv_rot_scan_count<SKV_RT>(rot, pend, skv_bits_for(per), &total_pending);
            for (int c = c0; c < c1; ++c) {
                const bool pending = w.colv[c] == SKV_PENDING;
                const int sl = skv_slot_of(w, c, m, n_take, S, owner, &bad_slot);
                out_slots[c] = sl;
                if (fresh && sl >= 0 && ((w.fmask[sl >> 5] >> (sl & 31)) & 1u)) {  // a prefetched row used, or evicted unused
                    fresh[sl] = 0;
                    if (pending) ++pf_wasted; else ++pf_hits;
                }
                if (pending) {
                    mrow[m] = (int)(w.keys[c] >> 32);
                    mslot[m] = sl;
                    mrank[m] = 0;  // counted below
                }
                m += pending ? 1 : 0;
            }
        }
        for (int c = k + tid; c < out_k; c += SKV_RT) out_slots[c] = SKV_NONE;
        if (bad_slot) atomicOr(sh_bad, 1);
        __syncthreads();
        const int bad = *(volatile int*)sh_bad;
        if (bad) corrupt = 1;
        const bool plan_ready = !(bad & 1);  // unless a miss went without a slot
        // Nothing reads the masks after that barrier: cleared for the next row of s.
        skv_clear_masks(w, mask_words);
        if (corrupt && tid == 0) skv_report(err, SKV_E_CORRUPT_STATE, b, sh_desc);

        // 5. plan: misses in host-row order, compacted.
        int* prow = plan_rows + (i64)b * out_k;
        int* pslot = plan_slots + (i64)b * out_k;
        const int flat0 = s * S;
        int n_plan = total_pending;  // every pending column took a slot
        if (!plan_ready) {  // the misses that took a slot, compacted again
            int c0, c1;
            skv_chunk(k, &per, &c0, &c1);
            int mine = 0;
            for (int c = c0; c < c1; ++c) {
                const int v = w.colv[c];
                mine += (v >= SKV_MISS_TAG && v != SKV_PENDING) ? 1 : 0;
            }
            int q = skv_rot_scan_count<SKV_RT>(rot, mine, skv_bits_for(per), &n_plan);
            for (int c = c0; c < c1; ++c) {
                const int v = w.colv[c];
                if (v >= SKV_MISS_TAG && v != SKV_PENDING) {
                    mrow[q] = (int)(w.keys[c] >> 32);
                    mslot[q] = v & SKV_SLOT_MASK;
                    mrank[q++] = 0;
                }
            }
            __syncthreads();
        }
        if (n_plan <= SKV_RANK_MAX) {
            // A miss's rank is the count of smaller host rows (distinct: no duplicate ids).
            // G threads a miss (a power of two <= 32, block-uniform) each count every G-th
            // row into its rank (mrank, zeroed above).
            int lg = 0;
            while (lg < 5 && (n_plan << (lg + 1)) <= SKV_RT) ++lg;
            const int part = tid & ((1 << lg) - 1);
            for (int q2 = tid >> lg; q2 < n_plan; q2 += SKV_RT >> lg) {
                const int row = mrow[q2];
                int r = 0;
#pragma unroll 4
                for (int j = part; j < n_plan; j += 1 << lg) r += mrow[j] < row ? 1 : 0;
                atomicAdd(&mrank[q2], r);
            }
            __syncthreads();
            for (int q2 = tid >> lg; q2 < n_plan && part == 0; q2 += SKV_RT >> lg) {
                const int r = mrank[q2];
                prow[r] = mrow[q2];
                pslot[r] = flat0 + mslot[q2];
            }
        } else {
            // Sorted as (host row << 32 | slot) keys in the table's first 2 kp ints (the
            // rows and slots are in hcol: no overlap).
            u64* mkeys = (u64*)w.htab;
            const int np2 = skv_pow2(n_plan);
            for (int i = tid; i < np2; i += SKV_RT)
                mkeys[i] = i < n_plan ? ((u64)(u32)mrow[i] << 32) | (u64)(u32)mslot[i] : SKV_NO_KEY;
            __syncthreads();
            skv_bitonic_sort(mkeys, np2);
            for (int q2 = tid; q2 < n_plan; q2 += SKV_RT) {
                const u64 key = mkeys[q2];
                prow[q2] = (int)(key >> 32);
                pslot[q2] = flat0 + (int)(u32)key;
            }
        }
        if (tid == 0) misses_out[b] = n_plan;
        sum_hits += (u64)n_hit;
        sum_misses += (u64)n_plan;
        sum_oor += (u64)n_oor;
        __syncthreads();  // the next batch row of s reuses the workspace
    }
    __syncthreads();  // every thread is done with sh_list before the next tile rewrites it
    }
    if (tid == 0) {
        if (sum_hits) atomicAdd(&cnt[0], sum_hits);
        if (sum_misses) atomicAdd(&cnt[1], sum_misses);
        if (sum_oor) atomicAdd(&cnt[2], sum_oor);
    }
    if (pf_hits) atomicAdd(&pf_counters[SKV_PF_HITS], pf_hits);
    if (pf_wasted) atomicAdd(&pf_counters[SKV_PF_WASTED], pf_wasted);
}

// Every group's region of each listed state row: owner = -1, lru = 0..S-1; with `fresh`
// (prefetch marks, or null), the marks cleared and counted in pf_counters[WASTED].
// Entries outside [0, max_reqs) are skipped. Grid-stride over n * groups * S.
extern "C" __global__ void skv_reset(int* __restrict__ owner, int* __restrict__ lru,
                                     const int groups, const int max_reqs, const int S,
                                     const int* __restrict__ state_rows, const int n,
                                     unsigned char* __restrict__ fresh, u64* __restrict__ pf_counters) {
    const i64 total = (i64)n * groups * S;
    u64 wasted = 0;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (i64)gridDim.x * blockDim.x) {
        const int slot = (int)(t % S);
        const i64 rest = t / S;
        const int g = (int)(rest % groups);
        const int s = state_rows[rest / groups];
        if (s < 0 || s >= max_reqs) continue;
        const i64 at = ((i64)g * max_reqs + s) * S + slot;
        owner[at] = -1;
        lru[at] = slot;
        if (fresh) wasted += skv_take_fresh(fresh, at);
    }
    if (wasted) atomicAdd(&pf_counters[SKV_PF_WASTED], wasted);
}

// Empty every slot whose owner is one of `rows` = [n, r_0 .. r_{n-1}] (r ascending, a
// negative r never matches; n read on the device, clamped to [0, rows_cap]): in every
// (group, state row), or with state_rows only in those (entries outside [0, max_reqs)
// skipped). The lru is unchanged.
// counter (u64, may be null) accumulates how many slots were emptied; with `fresh`
// (prefetch marks, or null) an emptied slot's mark is cleared and counted in
// pf_counters[WASTED]. Grid: fixed, strides over the regions (the write path: rows written
// on one rank, dropped in all).
extern "C" __global__ void skv_invalidate(int* __restrict__ owner, const int groups,
                                          const int max_reqs, const int S,
                                          const int* __restrict__ state_rows, const int n_state,
                                          const int* __restrict__ rows, const int rows_cap,
                                          u64* __restrict__ counter, unsigned char* __restrict__ fresh,
                                          u64* __restrict__ pf_counters) {
    int n_rows = rows[0];
    n_rows = n_rows < 0 ? 0 : (n_rows > rows_cap ? rows_cap : n_rows);
    const int* rows_sorted = rows + 1;
    const i64 n_regions = state_rows ? (i64)groups * n_state : (i64)groups * max_reqs;
    const i64 total = n_rows ? n_regions * S : 0;
    u64 emptied = 0, wasted = 0;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (i64)gridDim.x * blockDim.x) {
        i64 at = t;
        if (state_rows) {
            const int slot = (int)(t % S);
            const i64 rest = t / S;
            const int g = (int)(rest % groups);
            const int s = state_rows[rest / groups];
            if (s < 0 || s >= max_reqs) continue;
            at = ((i64)g * max_reqs + s) * S + slot;
        }
        const int o = owner[at];
        if (o >= 0 && skv_contains_i32(rows_sorted, n_rows, o)) {
            owner[at] = -1;
            ++emptied;
            if (fresh) wasted += skv_take_fresh(fresh, at);
        }
    }
    if (counter && emptied) atomicAdd(counter, emptied);
    if (wasted) atomicAdd(&pf_counters[SKV_PF_WASTED], wasted);
}

// The start of a decode step, from a STEP block: for each batch row b (state row s =
// state_rows[b], every group), reset[b] != 0 empties the region and sets lru = 0..S-1;
// else the slots owning one of inv[b, 0:n] (n = desc[INV_N]) become empty, lru unchanged.
// Both only write -1 to owners, so items of one state row in different blocks commute:
// the result is the NumPy engine's (resets first, then invalidations).
// Grid: fixed; blocks stride over the (batch row, group) items. Dynamic shared memory:
// inv_cap_p2 ints (the sorted invalidate row). A state row outside [-1, max_reqs) is
// skipped and reported (BAD_STATE_ROW); a descriptor out of range does nothing (BAD_STEP).
// With `fresh` (prefetch marks, or null), each emptied slot's mark is cleared and counted
// once in pf_counters[WASTED] (an atomic per marked slot: items of one state row commute).
extern "C" __global__ void skv_begin_step(const int* __restrict__ desc, int* __restrict__ owner,
                                          int* __restrict__ lru, const int groups,
                                          const int max_reqs, const int S, const int max_batch,
                                          const int* __restrict__ state_rows,
                                          const int* __restrict__ reset,
                                          const int* __restrict__ inv, const int inv_cap,
                                          int* __restrict__ err, unsigned char* __restrict__ fresh,
                                          u64* __restrict__ pf_counters) {
    SKV_DYN_SMEM(skv_smem);
    __shared__ int sh_desc[SKV_DESC_INTS];
    __shared__ int sh_item[2];  // state row and reset flag of the current item
    int* sorted = (int*)skv_smem;
    // Control values are read once into shared memory (see skv_resolve).
    if (threadIdx.x < SKV_DESC_INTS) sh_desc[threadIdx.x] = desc[threadIdx.x];
    __syncthreads();
    const int batch = sh_desc[SKV_D_BATCH];
    const int n = sh_desc[SKV_D_INV_N];
    if (batch < 0 || batch > max_batch || n < 0 || n > inv_cap) {
        if (blockIdx.x == 0 && threadIdx.x == 0) skv_report(err, SKV_E_BAD_STEP, -1, sh_desc);
        return;
    }
    const int np2 = skv_pow2(n > 0 ? n : 1);
    const i64 items = (i64)batch * groups;
    u64 wasted = 0;
    for (i64 t = blockIdx.x; t < items; t += gridDim.x) {  // block-uniform
        const int b = (int)(t / groups);
        const int g = (int)(t % groups);
        __syncthreads();  // every thread has read the previous item's cells
        if (threadIdx.x == 0) {
            sh_item[0] = state_rows[b];
            sh_item[1] = reset[b];
        }
        __syncthreads();
        const int s = sh_item[0];
        if (s < 0 || s >= max_reqs) {
            if (s != -1 && g == 0 && threadIdx.x == 0) skv_report(err, SKV_E_BAD_STATE_ROW, b, sh_desc);
            continue;
        }
        const i64 base = ((i64)g * max_reqs + s) * S;
        if (sh_item[1]) {
            for (int j = threadIdx.x; j < S; j += blockDim.x) {
                owner[base + j] = -1;
                lru[base + j] = j;
                if (fresh) wasted += skv_take_fresh(fresh, base + j);
            }
            continue;
        }
        if (n == 0) continue;
        for (int i = threadIdx.x; i < np2; i += blockDim.x)
            sorted[i] = i < n ? inv[(i64)b * n + i] : 0x7fffffff;
        __syncthreads();
        skv_block_sort_i32(sorted, np2);
        for (int j = threadIdx.x; j < S; j += blockDim.x) {
            const int o = owner[base + j];
            if (o >= 0 && skv_contains_i32(sorted, n, o)) {
                owner[base + j] = -1;
                if (fresh) wasted += skv_take_fresh(fresh, base + j);
            }
        }
        __syncthreads();  // the next item reuses `sorted`
    }
    if (wasted) atomicAdd(&pf_counters[SKV_PF_WASTED], wasted);
}
