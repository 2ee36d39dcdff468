// Row mover: one kernel for the gather (host pool -> hot slab), the prefill staging
// (host pool -> staging buffer) and the write mirror (device rows -> host pool).
//
// Rows are SKV_ROW_VECS * 16 bytes and move with 16-byte loads and stores,
// SKV_COPY_UNROLL loads in flight per thread before the first store (host memory sits
// behind PCIe: loads in flight, not occupancy, hide its latency). The caller bounds the
// grid (SMs and the link are shared with attention); it strides over the work.
//
// The decode step's gather (skv_gather) copies the plan batch row by batch row: block
// blockIdx.x takes rows blockIdx.x, + gridDim.x, ..., its threads striding over each
// row's (entry, vector) pairs. On plans scattered over a request's window it moves 1.34x
// the bytes a second of the flat split over all rows (which searches each vector's row in
// a prefix of the counts; docs/DESIGN.md §8 has the variants measured against it).
//
// Striped (a TP group's ranks share one plan): with N stripes, stripe s of a batch row of
// m entries (m clamped to [0, ld]) is its entries [m * s / N, m * (s + 1) / N) (i64;
// every entry in exactly one stripe, each a contiguous run of the row's sorted host rows).
// GPU s gathers its stripe pool -> its own slab (skv_gather with stripe, stripes), then
// copies the same entries from that slab into each peer's slab at the same slots
// (skv_push, device to device: NVLink or one GPU); one ready word and one arrival
// counter per destination slab count the blocks of all N kernels that write it.
#include "common.cuh"

#ifndef SKV_ROW_VECS
#define SKV_ROW_VECS 41  // 656-byte rows (DeepSeek fp8_ds_mla)
#endif
#ifndef SKV_COPY_THREADS
#define SKV_COPY_THREADS 256
#endif
#ifndef SKV_COPY_UNROLL
#define SKV_COPY_UNROLL 4
#endif
#define SKV_CT SKV_COPY_THREADS

// Where a destination row goes. Without `layer_off` (null): row r of layer l is at
// dst + (l * layer_rows + r) * row_bytes. With it (an engine-owned slab, proto/slab.py):
// at dst + layer_off[l] + (r / block_rows) * block_stride + (r % block_rows) * row_bytes.
struct SkvDstGeometry {
    const i64* layer_off;
    i64 block_rows;
    i64 block_stride;
};

// pref[b] = entries of the batch rows before b, each row's count clamped to [0, ld];
// pref[nb] = the total, returned to every thread. Synchronise before reading pref.
__device__ __forceinline__ i64 skv_plan_prefix(const int* __restrict__ counts, const int nb, const int ld,
                                               i64* pref) {
    __shared__ int sh_scan[SKV_CT];
    i64 carry = 0;
    for (int base = 0; base < nb; base += SKV_CT) {
        const int b = base + threadIdx.x;
        int c = b < nb ? counts[b] : 0;
        c = c < 0 ? 0 : (c > ld ? ld : c);
        int tile;
        const int ex = skv_block_scan_sum<SKV_CT>(c, sh_scan, &tile);
        if (b < nb) pref[b] = carry + ex;
        carry += tile;
    }
    if (threadIdx.x == 0) pref[nb] = carry;
    return carry;
}

// The index-list entry of a layer's r-th copied row: with counts, row b's pref[b]-th onwards
// are its first entries (e = b * ld + (r - pref[b])); without, e = r.
__device__ __forceinline__ i64 skv_entry(i64 r, const int* counts, const i64* pref, int nb, int ld) {
    if (!counts) return r;
    const int b = skv_upper_bound_i64(pref, nb + 1, r) - 1;
    return (i64)b * ld + (r - pref[b]);
}

// A 16-byte vector of the source. __ldg (ld.global.nc): the rows a kernel reads are
// never written while it runs (skv_push: peers write other stripes' slots of its source
// slab meanwhile, never a vector of its own; a vector lies inside one row).
__device__ __forceinline__ uint4 skv_load_vec(const uint4* p) {
    return __ldg(p);
}

// One layer's source and destination (the destination laid out by `geo`).
struct SkvLayerCopy {
    const unsigned char* src;
    i64 src_rows;
    unsigned char* dst;
    i64 dst_rows;
    const int* src_idx;
    const int* dst_idx;
    const int* keep_idx;  // or null: entry e is copied only if keep_idx[e] is in [0, keep_rows)
    i64 keep_rows;
    SkvDstGeometry geo;
};

// Vector `vec` of index-list entry e: its source in *from, and its destination, or null
// when either row lies outside its buffer (nothing to copy).
__device__ __forceinline__ uint4* skv_vec_at(const SkvLayerCopy& c, const i64 e, const int vec,
                                             const uint4** from) {
    if (c.keep_idx && (c.keep_idx[e] < 0 || c.keep_idx[e] >= c.keep_rows)) return 0;
    const i64 sr = c.src_idx ? (i64)c.src_idx[e] : e;
    const i64 dr = c.dst_idx ? (i64)c.dst_idx[e] : e;
    if (sr < 0 || sr >= c.src_rows || dr < 0 || dr >= c.dst_rows) return 0;
    *from = (const uint4*)(c.src + (sr * SKV_ROW_VECS + vec) * 16);
    const i64 at = c.geo.layer_off
        ? (dr / c.geo.block_rows) * c.geo.block_stride + ((dr % c.geo.block_rows) * SKV_ROW_VECS + vec) * 16
        : (dr * SKV_ROW_VECS + vec) * 16;
    return (uint4*)(c.dst + at);
}

// The layer li of a copy: false when the source or destination layer is outside its buffer.
__device__ __forceinline__ bool skv_layer(
    SkvLayerCopy* c, const unsigned char* src, const i64 src_layer_rows, const i64 src_rows, const int src_layers,
    unsigned char* dst, const i64 dst_layer_rows, const i64 dst_rows, const int dst_layers,
    const int* layers, const int li, const int mode, const int* src_idx, const int* dst_idx,
    const SkvDstGeometry geo)
{
    const int lay = layers[li];
    const i64 sl = (mode & 1) ? lay : li;
    const i64 dl = (mode & 2) ? lay : li;
    if (sl < 0 || sl >= src_layers || dl < 0 || dl >= dst_layers) return false;
    c->src = src + sl * src_layer_rows * (SKV_ROW_VECS * 16);
    c->src_rows = src_rows;
    c->dst = geo.layer_off ? dst + geo.layer_off[dl] : dst + dl * dst_layer_rows * (SKV_ROW_VECS * 16);
    c->dst_rows = dst_rows;
    c->src_idx = src_idx;
    c->dst_idx = dst_idx;
    c->keep_idx = 0;
    c->keep_rows = 0;
    c->geo = geo;
    return true;
}

// Copy, for each listed layer li in [0, n_layers), every entry e = b * ld + i of a
// [nb, ld] index list (the destination laid out by `geo`):
//   src row  = src_idx ? src_idx[e] : e     of source layer (mode & 1 ? layers[li] : li)
//   dst row  = dst_idx ? dst_idx[e] : e     of dest layer   (mode & 2 ? layers[li] : li)
// With counts (int[nb]) only the first counts[b] entries of batch row b (skv_resolve's
// plan); without, the first `total` of all nb * ld. A row or layer outside its buffer is
// skipped. Dynamic shared memory: (nb + 1) * 8 bytes when counts is given, else 0.
__device__ __forceinline__ void skv_copy_body(
    const unsigned char* __restrict__ src, const i64 src_layer_rows, const i64 src_rows,
    const int src_layers,
    unsigned char* __restrict__ dst, const i64 dst_layer_rows, const i64 dst_rows,
    const int dst_layers,
    const int* __restrict__ layers, const int n_layers, const int mode,
    const int* __restrict__ src_idx, const int* __restrict__ dst_idx,
    const int* __restrict__ counts, const int nb, const int ld, i64 total,
    const SkvDstGeometry geo)
{
    SKV_DYN_SMEM(skv_smem);
    i64* pref = (i64*)skv_smem;  // counts mode: see skv_plan_prefix

    if (counts) {
        total = skv_plan_prefix(counts, nb, ld, pref);
        __syncthreads();
    }
    const i64 per_layer = total * SKV_ROW_VECS;
    const i64 step = (i64)gridDim.x * SKV_CT;

    for (int li = 0; li < n_layers; ++li) {
        SkvLayerCopy c;
        if (!skv_layer(&c, src, src_layer_rows, src_rows, src_layers, dst, dst_layer_rows, dst_rows, dst_layers,
                       layers, li, mode, src_idx, dst_idx, geo)) continue;
        for (i64 v0 = (i64)blockIdx.x * SKV_CT + threadIdx.x; v0 < per_layer;
             v0 += step * SKV_COPY_UNROLL) {
            uint4 buf[SKV_COPY_UNROLL];
            uint4* out[SKV_COPY_UNROLL];
#pragma unroll
            for (int u = 0; u < SKV_COPY_UNROLL; ++u) {
                const i64 v = v0 + u * step;
                out[u] = 0;
                if (v < per_layer) {
                    const i64 r = v / SKV_ROW_VECS;  // entry number within this layer
                    const int vec = (int)(v - r * SKV_ROW_VECS);
                    const uint4* from;
                    out[u] = skv_vec_at(c, skv_entry(r, counts, pref, nb, ld), vec, &from);
                    if (out[u]) buf[u] = skv_load_vec(from);
                }
            }
#pragma unroll
            for (int u = 0; u < SKV_COPY_UNROLL; ++u)
                if (out[u]) *out[u] = buf[u];
        }
    }
}

// A plan copied batch row by batch row, stripe `stripe` of `stripes` of each row's first
// counts[b] entries (clamped to [0, ld]; see the top of this file; 0 of 1: all of them),
// an entry only when keep_idx (or null) names a row in [0, keep_rows): with at least as
// many rows as blocks, block blockIdx.x takes rows blockIdx.x,
// + gridDim.x, ...; with fewer (small batches, where one block a row would leave the
// link idle), each row gets s = gridDim.x / nb blocks, block blockIdx.x row blockIdx.x / s
// and every s-th chunk of SKV_CT * SKV_COPY_UNROLL of its (entry, vector) pairs from
// chunk blockIdx.x % s. Threads over the pairs, SKV_COPY_UNROLL loads in flight a thread.
__device__ __forceinline__ void skv_gather_rows(
    const unsigned char* __restrict__ src, const i64 src_layer_rows, const i64 src_rows, const int src_layers,
    unsigned char* __restrict__ dst, const i64 dst_layer_rows, const i64 dst_rows, const int dst_layers,
    const int* __restrict__ layers, const int n_layers, const int* __restrict__ src_idx,
    const int* __restrict__ dst_idx, const int* __restrict__ keep_idx, const i64 keep_rows,
    const int* __restrict__ counts, const int nb, const int ld, const SkvDstGeometry geo,
    const int stripe, const int stripes)
{
    for (int li = 0; li < n_layers; ++li) {
        SkvLayerCopy c;
        if (!skv_layer(&c, src, src_layer_rows, src_rows, src_layers, dst, dst_layer_rows, dst_rows, dst_layers,
                       layers, li, 3, src_idx, dst_idx, geo)) continue;
        c.keep_idx = keep_idx;
        c.keep_rows = keep_rows;
        const int s = nb > 0 && (int)gridDim.x > nb ? (int)gridDim.x / nb : 1;  // blocks a row
        const i64 chunk = (i64)SKV_CT * SKV_COPY_UNROLL;
        for (int b = blockIdx.x / s; b < nb; b += gridDim.x / s) {
            int m = counts[b];
            m = m < 0 ? 0 : (m > ld ? ld : m);
            const i64 lo = (i64)m * stripe / stripes;  // the stripe's entries [lo, hi) of the row
            const i64 hi = (i64)m * (stripe + 1) / stripes;
            const i64 e0 = (i64)b * ld + lo;
            const i64 n = (hi - lo) * SKV_ROW_VECS;
            for (i64 v0 = (i64)(blockIdx.x % s) * chunk + threadIdx.x; v0 < n; v0 += (i64)s * chunk) {
                uint4 buf[SKV_COPY_UNROLL];
                uint4* out[SKV_COPY_UNROLL];
#pragma unroll
                for (int u = 0; u < SKV_COPY_UNROLL; ++u) {
                    const i64 v = v0 + (i64)u * SKV_CT;
                    out[u] = 0;
                    if (v < n) {
                        const i64 r = v / SKV_ROW_VECS;
                        const uint4* from;
                        out[u] = skv_vec_at(c, e0 + r, (int)(v - r * SKV_ROW_VECS), &from);
                        if (out[u]) buf[u] = skv_load_vec(from);
                    }
                }
#pragma unroll
                for (int u = 0; u < SKV_COPY_UNROLL; ++u)
                    if (out[u]) *out[u] = buf[u];
            }
        }
    }
}

// The general copy (staging, write mirror, host-driven gathers). count_dev, when given,
// caps the entries at *count_dev read on the device (the write mirror: the grid is fixed,
// the row count lives in device memory next to the rows).
// __launch_bounds__(..., 1) lets ptxas keep all loads in flight in registers (no spills).
extern "C" __global__ void __launch_bounds__(SKV_CT, 1) skv_copy_rows(
    const unsigned char* __restrict__ src, const i64 src_layer_rows, const i64 src_rows,
    const int src_layers,
    unsigned char* __restrict__ dst, const i64 dst_layer_rows, const i64 dst_rows,
    const int dst_layers,
    const int* __restrict__ layers, const int n_layers, const int mode,
    const int* __restrict__ src_idx, const int* __restrict__ dst_idx,
    const int* __restrict__ counts, const int nb, const int ld,
    const int* __restrict__ count_dev,
    const i64* __restrict__ dst_layer_off, const i64 dst_block_rows, const i64 dst_block_stride)
{
    i64 total = (i64)nb * ld;
    if (count_dev) {
        const i64 c = count_dev[0];
        total = c < 0 ? 0 : (c < total ? c : total);
    }
    const SkvDstGeometry geo = {dst_layer_off, dst_block_rows < 1 ? 1 : dst_block_rows, dst_block_stride};
    skv_copy_body(src, src_layer_rows, src_rows, src_layers, dst, dst_layer_rows, dst_rows,
                  dst_layers, layers, n_layers, mode, src_idx, dst_idx, counts, nb, ld, total, geo);
}

// The descriptor's part of a plan (skv_gather, skv_push): for every layer of the
// descriptor's group (`group_layers`, [groups, layers_stride]: count, then layer
// numbers), stripe `stripe` of `stripes` of each batch row's misses[b] entries, source
// row src_idx[e] -> destination row dst_idx[e] (see skv_gather_rows). A descriptor or a
// stripe out of range copies nothing. Every thread returns (the signal after it).
// `mark_slots`: see skv_gather (set whatever the descriptor holds: the slots the resolve
// wrote for it are final, -1 included).
__device__ __forceinline__ void skv_plan_copy(
    const int* __restrict__ desc, const unsigned char* __restrict__ src, const i64 src_layer_rows,
    unsigned char* __restrict__ dst, const i64 dst_layer_rows, const int num_layers,
    const int* __restrict__ group_layers, const int layers_stride, const int groups,
    const int* __restrict__ src_idx, const int* __restrict__ dst_idx, const int* __restrict__ keep_idx,
    const i64 keep_rows, const int* __restrict__ misses, const int max_batch, const int ld,
    const SkvDstGeometry geo, const int stripe, const int stripes, const int mark_slots)
{
    // Read once into shared memory: the loop bounds (and barriers) of the copy depend on
    // them, and a client may rewrite its step block while the kernel runs.
    __shared__ int sh_desc[SKV_DESC_INTS];
    if (threadIdx.x < SKV_DESC_INTS) sh_desc[threadIdx.x] = desc[threadIdx.x];
    __syncthreads();
    const int batch = sh_desc[SKV_D_BATCH];
    const int group = sh_desc[SKV_D_GROUP];
    const int k = sh_desc[SKV_D_K];
    // Uniform over the grid (from the shared copy): every thread reaches the caller's signal.
    const bool ok = !(batch <= 0 || batch > max_batch || group < 0 || group >= groups || k < 0 || k > ld ||
                      stripes < 1 || stripe < 0 || stripe >= stripes);
    // The descriptor (written before the resolve ran) and the group's layer table (fixed)
    // are read before the wait; the plan and the counts, the resolve's, after it. Every
    // path waits: the caller's signal must not come before the resolve's slots.
    const int* g = ok ? group_layers + (i64)group * layers_stride : nullptr;
    int n_layers = ok ? g[0] : 0;
    skv_pdl_wait();
    // The resolve's slots are written and visible now: an engine may read them before the
    // rows are in (skv_db_indices, csrc/handle.cu). Ordered before this block's arrival,
    // so before the ready word.
    if (mark_slots && blockIdx.x == 0 && threadIdx.x == 0) {
        __threadfence();
        atomicExch((int*)desc + SKV_D_SLOTS, 1);
    }
    if (!ok) return;
    n_layers = n_layers < 0 ? 0 : (n_layers > layers_stride - 1 ? layers_stride - 1 : n_layers);
    skv_gather_rows(src, src_layer_rows, src_layer_rows, num_layers, dst, dst_layer_rows, dst_layer_rows,
                    num_layers, g + 1, n_layers, src_idx, dst_idx, keep_idx, keep_rows, misses, batch, ld, geo,
                    stripe, stripes);
}

// The decode-step gather: the plan of the last skv_resolve (per batch row, misses[b]
// entries; of each row, stripe `stripe` of `stripes`: 0 of 1 for all), pool -> slab, for
// every layer of the descriptor's group; an engine's slab is laid out by slab_layer_off /
// _block_rows / _block_stride (SkvDstGeometry; null: the daemon's [layers,
// slab_layer_rows] slab). Grid: fixed (skv_gather_rows: a block per batch row and grid).
// `ready` (or null): set to 1 by the last block once every block's rows are visible
// (`arrivals`: its counter, 0 before and after): expect 0, after this grid's blocks
// (skv_ring_when_done, device-scope: the word and the slab are this GPU's, read by its
// engine's kernels and stream waits only); otherwise after `expect` blocks of this and
// other kernels (the pushes of peers into the same slab, skv_push), system-scope.
// `mark_slots`: desc[SKV_D_SLOTS] is set to 1 once the resolve's slots are visible (after
// the programmatic wait, before any row is copied): a doorbell TOPK block's first gather.
extern "C" __global__ void __launch_bounds__(SKV_CT, 1) skv_gather(
    const int* __restrict__ desc,
    const unsigned char* __restrict__ pool, const i64 host_rows, const int num_layers,
    unsigned char* __restrict__ slab, const i64 slab_layer_rows,
    const int* __restrict__ group_layers, const int layers_stride, const int groups,
    const int* __restrict__ plan_rows, const int* __restrict__ plan_slots,
    const int* __restrict__ misses, const int max_batch, const int ld,
    const i64* __restrict__ slab_layer_off, const i64 slab_block_rows, const i64 slab_block_stride,
    const int stripe, const int stripes, u32* ready, u32* arrivals, const u32 expect, const int mark_slots)
{
    const SkvDstGeometry geo = {slab_layer_off, slab_block_rows < 1 ? 1 : slab_block_rows, slab_block_stride};
    skv_plan_copy(desc, pool, host_rows, slab, slab_layer_rows, num_layers, group_layers, layers_stride, groups,
                  plan_rows, plan_slots, 0, 0, misses, max_batch, ld, geo, stripe, stripes, mark_slots);
    if (expect) skv_ring_after<true>(arrivals, ready, expect);
    else skv_ring_when_done(arrivals, ready, true);
}

// A stripe of the plan, slab -> slab: the entries skv_gather with the same stripe copied
// into `src_slab` (the daemon's layout, [num_layers, slab_layer_rows], on this GPU),
// copied at the same flat slots (plan_slots) into `dst_slab` (a peer's over NVLink, or
// another slab of this GPU; laid out as skv_gather's destination). An entry whose host
// row (plan_rows) lies outside [0, host_rows) is skipped, as the gather skipped it. Grid
// and descriptor as skv_gather's. `ready` (or null) is set once `expect` blocks (0: this
// grid's) have arrived at `arrivals` (system-scope: the local gather's and the other
// peers' pushes into the same slab count there too, e.g. N kernels x grid).
extern "C" __global__ void __launch_bounds__(SKV_CT, 1) skv_push(
    const int* __restrict__ desc, const i64 host_rows, const int num_layers,
    const unsigned char* __restrict__ src_slab, unsigned char* __restrict__ dst_slab, const i64 slab_layer_rows,
    const int* __restrict__ group_layers, const int layers_stride, const int groups,
    const int* __restrict__ plan_rows, const int* __restrict__ plan_slots,
    const int* __restrict__ misses, const int max_batch, const int ld,
    const i64* __restrict__ dst_layer_off, const i64 dst_block_rows, const i64 dst_block_stride,
    const int stripe, const int stripes, u32* ready, u32* arrivals, const u32 expect)
{
    const SkvDstGeometry geo = {dst_layer_off, dst_block_rows < 1 ? 1 : dst_block_rows, dst_block_stride};
    skv_plan_copy(desc, src_slab, slab_layer_rows, dst_slab, slab_layer_rows, num_layers, group_layers,
                  layers_stride, groups, plan_slots, plan_slots, plan_rows, host_rows, misses, max_batch, ld, geo,
                  stripe, stripes, 0);
    skv_ring_after<true>(arrivals, ready, expect ? expect : gridDim.x);
}

// A step block ([desc] [rows: max_batch] [aux: max_batch] [payload: payload_cap], int32)
// from pinned host memory (mapped) to its device copy: the descriptor, then the used part
// of each section, clamped to it: payload batch * desc[SKV_D_K] (TOPK) or, with `step`,
// batch * desc[SKV_D_INV_N] (STEP).
extern "C" __global__ void skv_fetch(const int* __restrict__ src, int* __restrict__ dst,
                                     const int max_batch, const int payload_cap, const int step) {
    __shared__ int sh_desc[SKV_DESC_INTS];
    if (threadIdx.x < SKV_DESC_INTS) sh_desc[threadIdx.x] = src[threadIdx.x];
    __syncthreads();
    int batch = sh_desc[SKV_D_BATCH];
    batch = batch < 0 ? 0 : (batch > max_batch ? max_batch : batch);
    const int cols = sh_desc[step ? SKV_D_INV_N : SKV_D_K];
    i64 used = (i64)batch * (cols < 0 ? 0 : cols);
    used = used > payload_cap ? payload_cap : used;
    const i64 head = SKV_DESC_INTS + 2 * (i64)max_batch;
    const i64 total = head + used;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        if (i < SKV_DESC_INTS) {
            dst[i] = sh_desc[i];
        } else if (i < head) {
            const i64 j = (i - SKV_DESC_INTS) % max_batch;
            if (j < batch) dst[i] = src[i];
        } else {
            dst[i] = src[i];
        }
    }
}
