// Cross-layer prefetch (DESIGN.md §4, "prefetch(s, ids)"): one group's top-k rows
// prefetched into another group's regions, exactly as CpuResidency.prefetch does. State:
// owner / lru int32 and fresh uint8, each [groups, max_reqs, region_stride]. Built with
// the residency module's constants (daemon/kernels.py resolve_defines: the block size);
// the launch code: daemon/residency/cuda/residency.py.
#include "common.cuh"

#ifndef SKV_RESOLVE_THREADS
#define SKV_RESOLVE_THREADS 1024
#endif
#define SKV_PT SKV_RESOLVE_THREADS
#define SKV_PF_HASH 2  // hash entries per power-of-two column (load at most 1/2)
#define SKV_PF_NONE 0xffffffffu
#define SKV_PF_FREE 0x7fffffff
#define SKV_PF_NO_KEY 0xffffffffffffffffull

// Per-row workspace in dynamic shared memory, each part 16-aligned; mirrored by
// prefetch_workspace_bytes() (daemon/residency/cuda/device.py):
//   htab int[H kp], hcol int[H kp]  host row -> its lowest column (kp = pow2 >= k);
//                           htab reused as u64[kp] for the takes' keys of the plan
//   colw  int[k]            per column: 0 none (invalid or repeated), 1 wanted, 2 held
//   wcol  int[k]            the columns of the wanted ids, in column order
//   rmask u32[ceil(S/32)]   bit per slot: its owner is one of the ids (resident)
//   lcopy int[S]            the lru row before this batch row
//   taker u32[S]            per slot, the plan entry that took it last in this state row:
//                           batch row << 16 | entry (a later take drops the earlier entry)
struct SkvPfWs {
    int* htab;
    int* hcol;
    int* colw;
    int* wcol;
    u32* rmask;
    int* lcopy;
    u32* taker;
};

__device__ __forceinline__ SkvPfWs skv_pf_ws(unsigned char* base, int kp, int k, int S) {
    SkvPfWs w;
    u64 off = 0;
    w.htab = (int*)(base + off);
    off += skv_align16((u64)SKV_PF_HASH * kp * 4ull);
    w.hcol = (int*)(base + off);
    off += skv_align16((u64)SKV_PF_HASH * kp * 4ull);
    w.colw = (int*)(base + off);
    off += skv_align16((u64)k * 4ull);
    w.wcol = (int*)(base + off);
    off += skv_align16((u64)k * 4ull);
    w.rmask = (u32*)(base + off);
    off += skv_align16((u64)((S + 31) / 32) * 4ull);
    w.lcopy = (int*)(base + off);
    off += skv_align16((u64)S * 4ull);
    w.taker = (u32*)(base + off);
    return w;
}

__device__ __forceinline__ u32 skv_pf_hash(int g, int bits) { return ((u32)g * 2654435769u) >> (32 - bits); }

// The table entry holding host row g, or -1.
__device__ __forceinline__ int skv_pf_find(const SkvPfWs& w, int g, int bits) {
    const u32 mask = (1u << bits) - 1u;
    u32 h = skv_pf_hash(g, bits);
    while (true) {
        const int v = w.htab[h];
        if (v == -1) return -1;
        if (v == g) return (int)h;
        h = (h + 1) & mask;
    }
}

// Ascending bitonic sort of a[0, n), n a power of two, by the whole block (the caller
// synchronised after writing a[]; ends with __syncthreads()).
__device__ __forceinline__ void skv_pf_sort(u64* a, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < (n >> 1); t += SKV_PT) {
                const int i = 2 * t - (t & (stride - 1));
                const int j = i + stride;
                const u64 x = a[i], y = a[j];
                if ((x > y) == ((i & size) == 0)) {
                    a[i] = y;
                    a[j] = x;
                }
            }
            __syncthreads();
        }
    }
}

// [c0, c1): thread tid's contiguous chunk of n entries, `per` entries a thread.
__device__ __forceinline__ void skv_pf_chunk(int n, int* per, int* c0, int* c1) {
    *per = (n + SKV_PT - 1) / SKV_PT;
    *c0 = threadIdx.x * *per < n ? threadIdx.x * *per : n;
    *c1 = *c0 + *per < n ? *c0 + *per : n;
}

// Prefetch one top-k batch (of a source group) into the regions of the target group: the
// descriptor's plus group_offset (0 for a descriptor written for the prefetch; 1 to reuse
// the source group's own top-k block, as the doorbell step would).
//
// Grid: max_batch blocks, fixed; blocks at or past the descriptor's batch exit. The block
// of the first batch row naming a state row prefetches every batch row naming it, in batch
// order; padding rows (state row -1) get count 0 and touch no state. Per batch row b of
// state row s, with kept = S - min(top_k, S):
//   1. the row's ids in [0, host_rows) go into a shared hash table (an id repeated in the
//      row counts once, at its first column: the source's resolve refused such rows);
//   2. each slot looks its owner up: a slot owning one of the ids is resident (left
//      alone), the id held (not wanted);
//   3. candidates: lru positions [0, kept) whose slot is not resident, in order; wanted:
//      the ids no slot owns, in column order; wanted m takes candidate m (block scans);
//   4. new lru: the positions before kept not taken, then the taken slots, then the kept
//      part (unchanged); each taken slot's fresh mark is set (counted wasted if it was).
// Outputs: counts[b] entries of plan_rows[b] / plan_slots[b] (flat slot s * S + slot), in
// host-row order (a bitonic sort), the format skv_gather reads. A later batch row of s
// that takes a slot again drops the earlier entry (its row and slot become -1, which the
// gather skips), so no slot is copied twice. A corrupt lru (an entry outside [0, S)) never
// writes out of bounds: such an entry is not a candidate.
// pf_counters (u64, accumulated): [PREFETCHED] taken, [WASTED] fresh slots taken again.
extern "C" __global__ void __launch_bounds__(SKV_PT, 1) skv_prefetch(
    const int* __restrict__ desc,          // step descriptor (batch, k, group)
    const int group_offset,                // target group = desc group + group_offset
    int* __restrict__ owner_all,           // [groups, max_reqs, S]
    int* __restrict__ lru_all,             // [groups, max_reqs, S]
    unsigned char* __restrict__ fresh_all,  // [groups, max_reqs, S], padded to 4 bytes
    const int groups, const int max_reqs, const int S, const int host_rows,
    const int top_k,                       // the layout's: the kept part of the lru
    const int max_batch,
    const int* __restrict__ state_rows,    // [batch]
    const int* __restrict__ topk,          // [batch, k], contiguous: the source group's
    const int ld,                          // row stride of the plan (>= k)
    int* __restrict__ plan_rows,           // [max_batch, ld]
    int* __restrict__ plan_slots,          // [max_batch, ld]
    int* __restrict__ counts,              // [max_batch]
    u64* __restrict__ pf_counters,         // [SKV_PF_COUNTERS]
    int* __restrict__ err)                 // the error record
{
    __shared__ int sh_rot[2 * (SKV_PT / 32)];
    SkvRot rot = {sh_rot, 0};
    SKV_DYN_SMEM(skv_smem);
    __shared__ int sh_desc[SKV_DESC_INTS];
    __shared__ int sh_row[1];
    __shared__ int sh_list[SKV_PT];

    const int tid = threadIdx.x;
    const int b0 = blockIdx.x;
    // Control values read once into shared memory (see skv_resolve).
    if (tid < SKV_DESC_INTS) sh_desc[tid] = desc[tid];
    if (tid == 0) sh_row[0] = b0 < max_batch ? state_rows[b0] : -1;
    __syncthreads();
    const int batch = sh_desc[SKV_D_BATCH];
    const int k = sh_desc[SKV_D_K];
    const int group = sh_desc[SKV_D_GROUP] + group_offset;
    if (batch < 0 || batch > max_batch || k < 0 || k > ld || k > 65535 || group < 0 || group >= groups) {
        if (tid == 0) {
            counts[b0] = 0;
            if (b0 == 0) skv_report(err, SKV_E_BAD_STEP, -1, sh_desc);
        }
        return;
    }
    if (b0 >= batch) return;
    const int s = sh_row[0];
    if (s < 0 || s >= max_reqs) {
        if (tid == 0) {
            counts[b0] = 0;
            if (s != -1) skv_report(err, SKV_E_BAD_STATE_ROW, b0, sh_desc);
        }
        return;
    }
    const int sr_first = b0 + tid < batch ? state_rows[b0 + tid] : -1;
    int earlier = 0;
    for (int j = tid; j < b0; j += SKV_PT) earlier |= (state_rows[j] == s);
    if (__syncthreads_or(earlier)) return;

    int kp = 1;
    while (kp < k) kp <<= 1;
    int hbits = 1;
    while ((1 << hbits) < SKV_PF_HASH * kp) ++hbits;
    const int hsize = 1 << hbits;
    const SkvPfWs w = skv_pf_ws(skv_smem, kp, k, S);
    const i64 region = ((i64)group * max_reqs + s) * S;
    int* owner = owner_all + region;
    int* lru = lru_all + region;
    unsigned char* fresh = fresh_all + region;
    const int kept = S - (top_k < S ? top_k : S);
    const int mask_words = (S + 31) / 32;
    for (int j = tid; j < S; j += SKV_PT) w.taker[j] = SKV_PF_NONE;  // ordered by the tile scan
    u64 taken_sum = 0, wasted = 0;

    for (int tile0 = b0; tile0 < batch; tile0 += SKV_PT) {
    const int bt = tile0 + tid;
    const bool of_s = bt == b0 || (bt < batch && (tile0 == b0 ? sr_first : state_rows[bt]) == s);
    int n_of_s;
    const int at = skv_rot_scan_flag<SKV_PT>(rot, of_s, &n_of_s);
    if (of_s) sh_list[at] = bt;
    __syncthreads();
    for (int li = 0; li < n_of_s; ++li) {
        const int b = sh_list[li];
        const int* ids = topk + (i64)b * k;
        int* prow = plan_rows + (i64)b * ld;
        int* pslot = plan_slots + (i64)b * ld;
        for (int i = tid; i < hsize; i += SKV_PT) {
            w.htab[i] = -1;
            w.hcol[i] = SKV_PF_FREE;
        }
        for (int i = tid; i < mask_words; i += SKV_PT) w.rmask[i] = 0u;
        __syncthreads();
        // 1. the ids into the table; each entry keeps its lowest column
        for (int c = tid; c < k; c += SKV_PT) {
            const int g = ids[c];
            if (g < 0 || g >= host_rows) continue;
            u32 h = skv_pf_hash(g, hbits);
            while (true) {
                const int prev = atomicCAS(&w.htab[h], -1, g);
                if (prev == -1 || prev == g) {
                    atomicMin(&w.hcol[h], c);
                    break;
                }
                h = (h + 1) & (u32)(hsize - 1);
            }
        }
        __syncthreads();
        for (int c = tid; c < k; c += SKV_PT) {
            const int g = ids[c];
            const int h = (g >= 0 && g < host_rows) ? skv_pf_find(w, g, hbits) : -1;
            w.colw[c] = (h >= 0 && w.hcol[h] == c) ? 1 : 0;
        }
        __syncthreads();
        // 2. resident slots, held ids; the old lru copied
        for (int j = tid; j < S; j += SKV_PT) {
            w.lcopy[j] = lru[j];
            const int o = owner[j];
            if (o < 0 || o >= host_rows) continue;
            const int h = skv_pf_find(w, o, hbits);
            if (h < 0) continue;
            atomicOr(&w.rmask[j >> 5], 1u << (j & 31));
            w.colw[w.hcol[h]] = 2;
        }
        __syncthreads();
        // 3. the wanted columns, in column order
        int per, c0, c1;
        skv_pf_chunk(k, &per, &c0, &c1);
        int mine = 0;
        for (int c = c0; c < c1; ++c) mine += w.colw[c] == 1 ? 1 : 0;
        int n_want;
        int m = skv_rot_scan_count<SKV_PT>(rot, mine, skv_bits_for(per), &n_want);
        for (int c = c0; c < c1; ++c)
            if (w.colw[c] == 1) w.wcol[m++] = c;
        // the candidates, in lru order (the scan's barrier orders wcol for step 4)
        int i0, i1;
        skv_pf_chunk(kept, &per, &i0, &i1);
        auto candidate = [&](int sl) { return sl >= 0 && sl < S && !((w.rmask[sl >> 5] >> (sl & 31)) & 1u); };
        mine = 0;
        for (int i = i0; i < i1; ++i) mine += candidate(w.lcopy[i]) ? 1 : 0;
        int n_cand;
        int e = skv_rot_scan_count<SKV_PT>(rot, mine, skv_bits_for(per), &n_cand);
        const int n_take = n_want < n_cand ? n_want : n_cand;
        // 4. candidate e < n_take takes wanted e; the lru before kept rewritten; each
        // take's key (host row << 32 | slot) into the (now free) table
        u64* keys = (u64*)w.htab;
        for (int i = i0; i < i1; ++i) {
            const int sl = w.lcopy[i];
            const bool cand = candidate(sl);
            if (cand && e < n_take) {
                lru[kept - n_take + e] = sl;
                const int g = ids[w.wcol[e]];
                owner[sl] = g;
                if (fresh) {
                    wasted += fresh[sl] ? 1 : 0;
                    fresh[sl] = 1;
                }
                keys[e] = ((u64)(u32)g << 32) | (u32)sl;
            } else {
                lru[i - (e < n_take ? e : n_take)] = sl;
            }
            e += cand ? 1 : 0;
        }
        // 5. the plan in host-row order (the gather reads the pool in address order)
        const int np2 = skv_pow2(n_take > 0 ? n_take : 1);
        for (int q = n_take + tid; q < np2; q += SKV_PT) keys[q] = SKV_PF_NO_KEY;
        __syncthreads();
        skv_pf_sort(keys, np2);
        const int flat0 = s * S;
        for (int r = tid; r < n_take; r += SKV_PT) {
            const u64 key = keys[r];
            const int sl = (int)(u32)key;
            prow[r] = (int)(key >> 32);
            pslot[r] = flat0 + sl;
            __threadfence_block();  // the entry is written before another take may drop it
            const u32 prev = atomicExch(&w.taker[sl], ((u32)b << 16) | (u32)r);
            if (prev != SKV_PF_NONE) {  // taken before (an earlier token of s): that entry is dropped
                const i64 p = (i64)(prev >> 16) * ld + (prev & 0xffffu);
                plan_rows[p] = -1;
                plan_slots[p] = -1;
            }
        }
        if (tid == 0) counts[b] = n_take;
        taken_sum += (u64)n_take;
        __syncthreads();  // the next batch row of s reads lru, owner and the workspace
    }
    __syncthreads();  // every thread is done with sh_list before the next tile rewrites it
    }
    if (tid == 0 && taken_sum) atomicAdd(&pf_counters[SKV_PF_PREFETCHED], taken_sum);
    if (wasted) atomicAdd(&pf_counters[SKV_PF_WASTED], wasted);
}
