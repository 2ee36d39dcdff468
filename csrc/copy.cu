// Row mover: one kernel for the gather (host pool -> hot slab), the prefill staging
// (host pool -> staging buffer) and the write mirror (device rows -> host pool).
//
// Rows are SKV_ROW_VECS * 16 bytes (row_bytes is a multiple of 16) and move with 16-byte
// loads and stores, SKV_COPY_UNROLL independent loads in flight per thread before the
// first store (host memory sits behind PCIe: latency is hidden by loads in flight, not by
// occupancy). The grid is sized by the caller (a bounded number of blocks: SMs and copy
// bandwidth are shared with attention) and strides over the work.
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
// How a 16-byte source vector is read: 0 plain load, 1 __ldg (ld.global.nc: the source is
// never written during the kernel), 2 __ldcs (streaming, evict-first), 3 / 4 ld.global.nc
// with the L2 told to fetch the 256 / 128 bytes around it (.L2::256B / .L2::128B).
#ifndef SKV_COPY_LOAD
#define SKV_COPY_LOAD 1
#endif

__device__ __forceinline__ uint4 skv_load16(const uint4* p) {
#if SKV_COPY_LOAD == 1
    return __ldg(p);
#elif SKV_COPY_LOAD == 2
    return __ldcs(p);
#elif SKV_COPY_LOAD == 3 || SKV_COPY_LOAD == 4
    uint4 v;
#if SKV_COPY_LOAD == 3
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
#else
    asm("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
#endif
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#else
    return *p;
#endif
}
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
// pref[nb] = the total, returned to every thread. The caller synchronises the block before
// reading pref.
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

// Copy, for each listed layer li in [0, n_layers), every entry e of a [nb, ld] index list:
//   src row  = src_idx ? src_idx[e] : e     of source layer (mode & 1 ? layers[li] : li)
//   dst row  = dst_idx ? dst_idx[e] : e     of dest layer   (mode & 2 ? layers[li] : li)
// (the destination laid out by `geo`, see SkvDstGeometry)
// With counts (int[nb]) only the first counts[b] entries of batch row b are copied (the
// compact per-row plan of skv_resolve); without, the first `total` of all nb * ld. Entries
// are numbered e = b * ld + i. A row or layer outside its buffer is skipped, never read or
// written. Dynamic shared memory: (nb + 1) * 8 bytes when counts is given, else 0.
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
    i64* pref = (i64*)skv_smem;  // pref[b] = entries of batch rows before b (counts mode)

    if (counts) {
        total = skv_plan_prefix(counts, nb, ld, pref);
        __syncthreads();
    }
    const i64 per_layer = total * SKV_ROW_VECS;
    const i64 step = (i64)gridDim.x * SKV_CT;

    for (int li = 0; li < n_layers; ++li) {
        const int lay = layers[li];
        const i64 sl = (mode & 1) ? lay : li;
        const i64 dl = (mode & 2) ? lay : li;
        if (sl < 0 || sl >= src_layers || dl < 0 || dl >= dst_layers) continue;
        const unsigned char* src_l = src + sl * src_layer_rows * (SKV_ROW_VECS * 16);
        unsigned char* dst_l = geo.layer_off ? dst + geo.layer_off[dl]
                                             : dst + dl * dst_layer_rows * (SKV_ROW_VECS * 16);

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
                    const i64 e = skv_entry(r, counts, pref, nb, ld);
                    const i64 sr = src_idx ? (i64)src_idx[e] : e;
                    const i64 dr = dst_idx ? (i64)dst_idx[e] : e;
                    if (sr >= 0 && sr < src_rows && dr >= 0 && dr < dst_rows) {
                        buf[u] = skv_load16((const uint4*)(src_l + (sr * SKV_ROW_VECS + vec) * 16));
                        const i64 at = geo.layer_off
                            ? (dr / geo.block_rows) * geo.block_stride
                                  + ((dr % geo.block_rows) * SKV_ROW_VECS + vec) * 16
                            : (dr * SKV_ROW_VECS + vec) * 16;
                        out[u] = (uint4*)(dst_l + at);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < SKV_COPY_UNROLL; ++u)
                if (out[u]) *out[u] = buf[u];
        }
    }
}

// -- the gather by the Tensor Memory Accelerator (SKV_COPY_TMA 1) ------------------------------
//
// Each thread is a small pipeline of SKV_TMA_STAGES one-row buffers in shared memory: a
// bulk asynchronous copy (cp.async.bulk, sm_90) brings a whole row from the pool into a
// buffer (completion counted on the buffer's mbarrier), a second one writes it to the
// slab, and the buffer takes the thread's next row once that write has read it. The SM
// issues two instructions a row instead of 41 loads and 41 stores, and the rows travel as
// whole-row requests (issue 8: what the copy engine's bulk reads reach, SM loads do not).
// Same rows, same order of work and same results as skv_copy_body; every address is
// 16-byte aligned (rows are a multiple of 16 bytes, the pool, slab and engine geometry are
// checked on the host). Dynamic shared memory: skv_tma_smem_bytes(nb) bytes.
#ifndef SKV_COPY_TMA
#define SKV_COPY_TMA 0
#endif
#ifndef SKV_TMA_STAGES
#define SKV_TMA_STAGES 2
#endif
#define SKV_ROW_BYTES (SKV_ROW_VECS * 16)
#define SKV_TMA_HEAD(nb) ((((nb) + 1) * 8 + 127) / 128 * 128)  // the per-row prefix, 128-aligned

#if SKV_COPY_TMA
__device__ __forceinline__ u32 skv_smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void skv_tma_load(u32 dst, const void* src, u32 bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"((u32)SKV_ROW_BYTES)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"((u32)SKV_ROW_BYTES), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void skv_mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
}

__device__ __forceinline__ void skv_tma_store(void* dst, u32 src) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src),
                 "r"((u32)SKV_ROW_BYTES)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// The copy of skv_copy_body (same arguments and meaning) by bulk copies; `smem` is the
// kernel's dynamic shared memory (prefix, then the stages, then their barriers).
__device__ __forceinline__ void skv_copy_body_tma(
    const unsigned char* __restrict__ src, const i64 src_layer_rows, const i64 src_rows,
    const int src_layers,
    unsigned char* __restrict__ dst, const i64 dst_layer_rows, const i64 dst_rows,
    const int dst_layers,
    const int* __restrict__ layers, const int n_layers, const int mode,
    const int* __restrict__ src_idx, const int* __restrict__ dst_idx,
    const int* __restrict__ counts, const int nb, const int ld, i64 total,
    const SkvDstGeometry geo, unsigned char* smem)
{
    i64* pref = (i64*)smem;
    unsigned char* stages = smem + SKV_TMA_HEAD(nb);
    u64* bars = (u64*)(stages + (i64)SKV_CT * SKV_TMA_STAGES * SKV_ROW_BYTES);
    const int tid = threadIdx.x;
    if (counts) total = skv_plan_prefix(counts, nb, ld, pref);  // (the barrier below orders pref)
    u32 buf[SKV_TMA_STAGES], bar[SKV_TMA_STAGES];
#pragma unroll
    for (int st = 0; st < SKV_TMA_STAGES; ++st) {
        buf[st] = skv_smem_u32(stages + ((i64)tid * SKV_TMA_STAGES + st) * SKV_ROW_BYTES);
        bar[st] = skv_smem_u32(bars + tid * SKV_TMA_STAGES + st);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar[st]) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();

    // Item it = li * total + r: entry r of listed layer li. Returns the slab address of the
    // row whose load it issued into stage st, or null (nothing to copy for this item).
    const i64 items = (i64)n_layers * total;
    auto issue = [&](i64 it, int st) -> unsigned char* {
        const int li = (int)(it / total);
        const i64 r = it - (i64)li * total;
        const int lay = layers[li];
        const i64 sl = (mode & 1) ? lay : li;
        const i64 dl = (mode & 2) ? lay : li;
        if (sl < 0 || sl >= src_layers || dl < 0 || dl >= dst_layers) return nullptr;
        const i64 e = skv_entry(r, counts, pref, nb, ld);
        const i64 sr = src_idx ? (i64)src_idx[e] : e;
        const i64 dr = dst_idx ? (i64)dst_idx[e] : e;
        if (sr < 0 || sr >= src_rows || dr < 0 || dr >= dst_rows) return nullptr;
        const unsigned char* s = src + (sl * src_layer_rows + sr) * SKV_ROW_BYTES;
        unsigned char* d = geo.layer_off
            ? dst + geo.layer_off[dl] + (dr / geo.block_rows) * geo.block_stride + (dr % geo.block_rows) * SKV_ROW_BYTES
            : dst + (dl * dst_layer_rows + dr) * SKV_ROW_BYTES;
        skv_tma_load(buf[st], s, bar[st]);
        return d;
    };
    const i64 step = (i64)gridDim.x * SKV_CT;
    i64 next = (i64)blockIdx.x * SKV_CT + tid;
    unsigned char* out[SKV_TMA_STAGES];
    int busy = 0;
#pragma unroll
    for (int st = 0; st < SKV_TMA_STAGES; ++st) {
        out[st] = nullptr;
        for (; next < items && !out[st]; next += step) out[st] = issue(next, st);
        busy += out[st] ? 1 : 0;
    }
    u32 parity = 0;  // bit st: the phase the next wait on stage st waits for
    while (busy) {
#pragma unroll
        for (int st = 0; st < SKV_TMA_STAGES; ++st) {
            if (!out[st]) continue;
            skv_mbar_wait(bar[st], (parity >> st) & 1u);
            parity ^= 1u << st;
            skv_tma_store(out[st], buf[st]);
            out[st] = nullptr;
            if (next < items) {
                // The buffer is refilled only once the write just issued has read it.
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                for (; next < items && !out[st]; next += step) out[st] = issue(next, st);
            }
            busy -= out[st] ? 0 : 1;
        }
    }
    // Every write done (and visible to this thread) before the block may signal.
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#endif

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

// The decode-step gather: the plan of the last skv_resolve (per batch row, misses[b]
// entries), pool -> slab, for every layer of the descriptor's group; the slab laid out
// by slab_layer_off / slab_block_rows / slab_block_stride when an engine owns it
// (SkvDstGeometry; null: the daemon's own [layers, slab_layer_rows] slab). The batch and the
// group come from the descriptor; the group's layers from `group_layers` ([groups,
// layers_stride]: count, then layer numbers). Grid: fixed. Dynamic shared memory:
// (max_batch + 1) * 8 bytes. A descriptor out of range copies nothing (skv_resolve
// reports it). With a `ready` word (the doorbell transport, daemon/cuda/doorbell.py), the
// last block to finish sets it to 1 once every block's rows are visible (`arrivals`: its
// counter, 0 before and after); null: nothing is signalled.
extern "C" __global__ void __launch_bounds__(SKV_CT, 1) skv_gather(
    const int* __restrict__ desc,
    const unsigned char* __restrict__ pool, const i64 host_rows, const int num_layers,
    unsigned char* __restrict__ slab, const i64 slab_layer_rows,
    const int* __restrict__ group_layers, const int layers_stride, const int groups,
    const int* __restrict__ plan_rows, const int* __restrict__ plan_slots,
    const int* __restrict__ misses, const int max_batch, const int ld,
    const i64* __restrict__ slab_layer_off, const i64 slab_block_rows, const i64 slab_block_stride,
    u32* ready, u32* arrivals)
{
    // Read once into shared memory: the loop bounds (and barriers) of the copy depend on
    // them, and a client may rewrite its step block while the kernel runs.
    __shared__ int sh_desc[SKV_DESC_INTS];
    if (threadIdx.x < SKV_DESC_INTS) sh_desc[threadIdx.x] = desc[threadIdx.x];
    __syncthreads();
    const int batch = sh_desc[SKV_D_BATCH];
    const int group = sh_desc[SKV_D_GROUP];
    const int k = sh_desc[SKV_D_K];
    // Uniform over the grid (from the shared copy): every thread reaches the signal below.
    if (!(batch <= 0 || batch > max_batch || group < 0 || group >= groups || k < 0 || k > ld)) {
        const int* g = group_layers + (i64)group * layers_stride;
        int n_layers = g[0];
        n_layers = n_layers < 0 ? 0 : (n_layers > layers_stride - 1 ? layers_stride - 1 : n_layers);
        const SkvDstGeometry geo = {slab_layer_off, slab_block_rows < 1 ? 1 : slab_block_rows, slab_block_stride};
#if SKV_COPY_TMA
        SKV_DYN_SMEM(tma_smem);
        skv_copy_body_tma(pool, host_rows, host_rows, num_layers, slab, slab_layer_rows, slab_layer_rows,
                          num_layers, g + 1, n_layers, 3, plan_rows, plan_slots, misses, batch, ld, 0, geo,
                          tma_smem);
#else
        skv_copy_body(pool, host_rows, host_rows, num_layers, slab, slab_layer_rows, slab_layer_rows,
                      num_layers, g + 1, n_layers, 3, plan_rows, plan_slots, misses, batch, ld, 0, geo);
#endif
    }
    skv_ring_when_done(arrivals, ready);
}

// A step block from pinned host memory (mapped) to its device copy: the descriptor, then
// the used part of each section. Block layout (int32): [desc: SKV_DESC_INTS]
// [rows: max_batch] [aux: max_batch] [payload: payload_cap]; payload entries used:
// batch * desc[SKV_D_K] (a TOPK block) or batch * desc[SKV_D_INV_N] (a STEP block, `step`
// != 0). Sizes come from the descriptor, clamped to the sections: the launch is fixed.
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

// -- the batch-wide plan -------------------------------------------------------------------
//
// skv_resolve leaves one plan per batch row, each sorted by host row. skv_merge_plan
// merges them into one list in host-row order, stable in batch order (the order the cpu
// backend's stable sort gives): entry i of row b, host row r, goes to
//     rank = i + sum_{b' < b} #{entries of b' <= r} + sum_{b' > b} #{entries of b' < r}
// (counts by binary search in the other rows' sorted lists). The whole batch's gather then
// walks the pool in address order, which is what keeps the GPU's host-memory translation
// warm (docs/PERF.md, "Gather order"). Nothing is sorted and nothing waits: the count of
// merged entries stays on the device (out_count) for skv_gather_merged.
//
// Grid: max_batch blocks (one per batch row, fixed), SKV_MERGE_THREADS threads. Dynamic
// shared memory: SKV_MERGE_SMEM bytes: the batch's offsets, this row's rank accumulators
// and, when they fit, every row's plan (else the lists are searched in global memory).
#ifndef SKV_MERGE_THREADS
#define SKV_MERGE_THREADS 1024
#endif

__device__ __forceinline__ int skv_count_below(const int* a, int n, int key, bool inclusive) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        const int v = a[mid];
        if (v < key || (inclusive && v == key)) lo = mid + 1; else hi = mid;
    }
    return lo;
}

extern "C" __global__ void __launch_bounds__(SKV_MERGE_THREADS) skv_merge_plan(
    const int* __restrict__ desc,
    const int* __restrict__ plan_rows, const int* __restrict__ plan_slots,
    const int* __restrict__ misses, const int max_batch, const int ld,
    int* __restrict__ out_rows, int* __restrict__ out_slots, int* __restrict__ out_count,
    const int smem_bytes)
{
    SKV_DYN_SMEM(merge_smem);
    int* off = (int*)merge_smem;            // [max_batch + 1]: entries of the rows before b
    int* acc = off + (max_batch + 1);     // [ld]: this row's ranks
    int* lists = acc + ld;                // every row's plan, compact, when it fits
    const int list_cap = smem_bytes / 4 - (max_batch + 1) - ld;
    __shared__ int sh_batch;
    if (threadIdx.x == 0) {
        int batch = desc[SKV_D_BATCH];
        const int k = desc[SKV_D_K];
        if (batch < 0 || batch > max_batch || k < 0 || k > ld) batch = 0;  // skv_resolve reports it
        sh_batch = batch;
    }
    __syncthreads();
    const int batch = sh_batch;
    if (threadIdx.x == 0) {
        int run = 0;
        for (int b = 0; b < batch; ++b) {
            off[b] = run;
            int c = misses[b];
            run += c < 0 ? 0 : (c > ld ? ld : c);
        }
        off[batch] = run;
        if (blockIdx.x == 0) *out_count = run;
    }
    __syncthreads();
    const int total = off[batch];
    const bool in_smem = total <= list_cap;
    if (in_smem) {
        for (int b = 0; b < batch; ++b) {
            const int n = off[b + 1] - off[b];
            for (int i = threadIdx.x; i < n; i += SKV_MERGE_THREADS) lists[off[b] + i] = plan_rows[(i64)b * ld + i];
        }
    }
    const int me = blockIdx.x;
    const int mine = me < batch ? off[me + 1] - off[me] : 0;
    for (int i = threadIdx.x; i < mine; i += SKV_MERGE_THREADS) acc[i] = i;
    __syncthreads();
    // Pairs (entry i of this row, other row o), entries fastest: a warp searches one list.
    const i64 pairs = (i64)mine * batch;
    for (i64 p = threadIdx.x; p < pairs; p += SKV_MERGE_THREADS) {
        const int o = (int)(p / mine);
        const int i = (int)(p - (i64)o * mine);
        if (o == me) continue;
        const int key = in_smem ? lists[off[me] + i] : plan_rows[(i64)me * ld + i];
        const int n = off[o + 1] - off[o];
        const int* a = in_smem ? lists + off[o] : plan_rows + (i64)o * ld;
        const int c = skv_count_below(a, n, key, o < me);
        if (c) atomicAdd(&acc[i], c);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < mine; i += SKV_MERGE_THREADS) {
        const int r = acc[i];
        out_rows[r] = in_smem ? lists[off[me] + i] : plan_rows[(i64)me * ld + i];
        out_slots[r] = plan_slots[(i64)me * ld + i];
    }
}

// The decode-step gather of the merged plan (skv_merge_plan): *count entries of
// rows/slots, pool -> slab, for every layer of the descriptor's group (as skv_gather).
// Grid: fixed. No dynamic shared memory.
extern "C" __global__ void __launch_bounds__(SKV_CT, 1) skv_gather_merged(
    const int* __restrict__ desc,
    const unsigned char* __restrict__ pool, const i64 host_rows, const int num_layers,
    unsigned char* __restrict__ slab, const i64 slab_layer_rows,
    const int* __restrict__ group_layers, const int layers_stride, const int groups,
    const int* __restrict__ rows, const int* __restrict__ slots, const int* __restrict__ count,
    const int cap,
    const i64* __restrict__ slab_layer_off, const i64 slab_block_rows, const i64 slab_block_stride)
{
    __shared__ int sh_desc[SKV_DESC_INTS];
    __shared__ int sh_count;
    if (threadIdx.x < SKV_DESC_INTS) sh_desc[threadIdx.x] = desc[threadIdx.x];
    if (threadIdx.x == 0) sh_count = *count;
    __syncthreads();
    const int group = sh_desc[SKV_D_GROUP];
    if (group < 0 || group >= groups) return;
    const int n = sh_count < 0 ? 0 : (sh_count > cap ? cap : sh_count);
    const int* g = group_layers + (i64)group * layers_stride;
    int n_layers = g[0];
    n_layers = n_layers < 0 ? 0 : (n_layers > layers_stride - 1 ? layers_stride - 1 : n_layers);
    const SkvDstGeometry geo = {slab_layer_off, slab_block_rows < 1 ? 1 : slab_block_rows, slab_block_stride};
    skv_copy_body(pool, host_rows, host_rows, num_layers, slab, slab_layer_rows, slab_layer_rows,
                  num_layers, g + 1, n_layers, 3, rows, slots, nullptr, 1, cap, n, geo);
}
