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
// never written during the kernel), 2 __ldcs (streaming, evict-first).
#ifndef SKV_COPY_LOAD
#define SKV_COPY_LOAD 1
#endif

__device__ __forceinline__ uint4 skv_load16(const uint4* p) {
#if SKV_COPY_LOAD == 1
    return __ldg(p);
#elif SKV_COPY_LOAD == 2
    return __ldcs(p);
#else
    return *p;
#endif
}
#define SKV_CT SKV_COPY_THREADS

// Copy, for each listed layer li in [0, n_layers), every entry e of a [nb, ld] index list:
//   src row  = src_idx ? src_idx[e] : e     of source layer (mode & 1 ? layers[li] : li)
//   dst row  = dst_idx ? dst_idx[e] : e     of dest layer   (mode & 2 ? layers[li] : li)
// With counts (int[nb]) only the first counts[b] entries of batch row b are copied (the
// compact per-row plan of skv_resolve); without, all nb * ld. Entries are numbered
// e = b * ld + i. A row or layer outside its buffer is skipped, never read or written.
// Dynamic shared memory: (nb + 1) * 8 bytes when counts is given, else 0.
// __launch_bounds__(..., 1) lets ptxas keep all loads in flight in registers (no spills).
extern "C" __global__ void __launch_bounds__(SKV_CT, 1) skv_copy_rows(
    const unsigned char* __restrict__ src, const i64 src_layer_rows, const i64 src_rows,
    const int src_layers,
    unsigned char* __restrict__ dst, const i64 dst_layer_rows, const i64 dst_rows,
    const int dst_layers,
    const int* __restrict__ layers, const int n_layers, const int mode,
    const int* __restrict__ src_idx, const int* __restrict__ dst_idx,
    const int* __restrict__ counts, const int nb, const int ld)
{
    __shared__ int sh_scan[SKV_CT];
    SKV_DYN_SMEM(skv_smem);
    i64* pref = (i64*)skv_smem;  // pref[b] = entries of batch rows before b (counts mode)

    i64 total;
    if (counts) {
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
        __syncthreads();
        total = carry;
    } else {
        total = (i64)nb * ld;
    }
    const i64 per_layer = total * SKV_ROW_VECS;
    const i64 step = (i64)gridDim.x * SKV_CT;

    for (int li = 0; li < n_layers; ++li) {
        const int lay = layers[li];
        const i64 sl = (mode & 1) ? lay : li;
        const i64 dl = (mode & 2) ? lay : li;
        if (sl < 0 || sl >= src_layers || dl < 0 || dl >= dst_layers) continue;
        const unsigned char* src_l = src + sl * src_layer_rows * (SKV_ROW_VECS * 16);
        unsigned char* dst_l = dst + dl * dst_layer_rows * (SKV_ROW_VECS * 16);

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
                    i64 e;
                    if (counts) {
                        const int b = skv_upper_bound_i64(pref, nb + 1, r) - 1;
                        e = (i64)b * ld + (r - pref[b]);
                    } else {
                        e = r;
                    }
                    const i64 sr = src_idx ? (i64)src_idx[e] : e;
                    const i64 dr = dst_idx ? (i64)dst_idx[e] : e;
                    if (sr >= 0 && sr < src_rows && dr >= 0 && dr < dst_rows) {
                        buf[u] = skv_load16((const uint4*)(src_l + (sr * SKV_ROW_VECS + vec) * 16));
                        out[u] = (uint4*)(dst_l + (dr * SKV_ROW_VECS + vec) * 16);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < SKV_COPY_UNROLL; ++u)
                if (out[u]) *out[u] = buf[u];
        }
    }
}
