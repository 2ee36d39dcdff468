// A TP group's ranks on the doorbell, resolving once (DESIGN §5.6): the checks that a
// follower rank sent what the leader rank sent, and the leader's answer handed to it.
// Ranks of one engine send the same steps and top-k batches; the leader's are resolved on
// the group's shared residency, and every rank whose blocks equal the leader's gets the
// leader's slots. A follower whose step or top-k differs is refused row by row (slots -1,
// 0 misses, TP_MISMATCH in its error record): it never gets slots of another batch.
#include "common.cuh"

#ifndef SKV_TP_THREADS
#define SKV_TP_THREADS 256
#endif

__device__ __forceinline__ bool skv_tp_desc_equal(const int* a, const int* b, bool step_block) {
    return a[SKV_D_STEP] == b[SKV_D_STEP] && a[SKV_D_BATCH] == b[SKV_D_BATCH] &&
           (step_block ? a[SKV_D_INV_N] == b[SKV_D_INV_N]
                       : a[SKV_D_K] == b[SKV_D_K] && a[SKV_D_GROUP] == b[SKV_D_GROUP]);
}

// A follower's STEP block against the leader's: *bad = 0 when the descriptors agree on
// step, batch and invalidate columns (each within [0, max_batch] / [0, inv_cap]) and the
// state rows, resets and invalidate lists of every batch row are equal; else *bad = 1 and
// one TP_MISMATCH is counted (row -1). One block: the step's arrays are small.
// Block layout of both: [desc][rows: max_batch][aux (resets): max_batch][payload: inv lists].
extern "C" __global__ void skv_tp_check_step(const int* __restrict__ lead, const int* __restrict__ foll,
                                             const int max_batch, const int inv_cap, u32* __restrict__ bad,
                                             int* __restrict__ err) {
    __shared__ int sh_lead[SKV_DESC_INTS], sh_foll[SKV_DESC_INTS];
    const int tid = threadIdx.x;
    if (tid < SKV_DESC_INTS) {
        sh_lead[tid] = lead[tid];
        sh_foll[tid] = foll[tid];
    }
    __syncthreads();
    const int batch = sh_lead[SKV_D_BATCH], n = sh_lead[SKV_D_INV_N];
    bool differs = !skv_tp_desc_equal(sh_lead, sh_foll, true) || batch < 0 || batch > max_batch || n < 0 ||
                   n > inv_cap;
    if (!__syncthreads_or(differs)) {
        const int* lr = lead + SKV_DESC_INTS;
        const int* fr = foll + SKV_DESC_INTS;
        for (int i = tid; i < batch; i += blockDim.x)  // state rows, then resets
            differs |= lr[i] != fr[i] || (lr[max_batch + i] != 0) != (fr[max_batch + i] != 0);
        const int* lp = lr + 2 * max_batch;
        const int* fp = fr + 2 * max_batch;
        for (i64 i = tid; i < (i64)batch * n; i += blockDim.x) differs |= lp[i] != fp[i];
    }
    const bool any = __syncthreads_or(differs);
    if (tid == 0) {
        *bad = any ? 1u : 0u;
        if (any) skv_report(err, SKV_E_TP_MISMATCH, -1, sh_foll);
    }
}

// A follower's TOPK block of one group against the leader's, row by row: batch row b of
// the follower (b < its batch) gets the leader's slots[b] (out_k columns) and misses[b]
// when the descriptors agree on step, batch, k and group (within [0, max_batch] and
// [0, out_k]), the follower's step passed skv_tp_check_step (*step_bad == 0), and row b's
// state row and k ids are the leader's; else slots -1 and 0 misses, and TP_MISMATCH is
// counted with the row. Rows past the follower's batch are not written (its engine reads
// none of them). Grid: max_batch blocks, one per batch row.
// Block layout of both: [desc][rows: max_batch][aux: max_batch][payload: max_batch x k].
extern "C" __global__ void skv_tp_follow(const int* __restrict__ lead, const int* __restrict__ foll,
                                         const int* __restrict__ lead_slots, const int* __restrict__ lead_misses,
                                         int* __restrict__ slots, int* __restrict__ misses, const int out_k,
                                         const int max_batch, const u32* __restrict__ step_bad,
                                         int* __restrict__ err) {
    __shared__ int sh_lead[SKV_DESC_INTS], sh_foll[SKV_DESC_INTS];
    __shared__ int sh_ok[1];
    const int tid = threadIdx.x, b = blockIdx.x;
    if (tid < SKV_DESC_INTS) {
        sh_lead[tid] = lead[tid];
        sh_foll[tid] = foll[tid];
    }
    if (tid == 0) sh_ok[0] = step_bad == nullptr || *(volatile const u32*)step_bad == 0u;
    __syncthreads();
    const int fb = sh_foll[SKV_D_BATCH];
    if (b >= max_batch || b >= fb) return;  // (fb beyond max_batch: every row up to max_batch is refused)
    const int batch = sh_lead[SKV_D_BATCH], k = sh_lead[SKV_D_K];
    bool differs = !sh_ok[0] || !skv_tp_desc_equal(sh_lead, sh_foll, false) || batch < 0 || batch > max_batch ||
                   k < 0 || k > out_k;
    if (!__syncthreads_or(differs)) {
        const int* lr = lead + SKV_DESC_INTS;
        const int* fr = foll + SKV_DESC_INTS;
        differs = tid == 0 && lr[b] != fr[b];
        const int* lp = lr + 2 * max_batch + (i64)b * k;
        const int* fp = fr + 2 * max_batch + (i64)b * k;
        for (int c = tid; c < k; c += blockDim.x) differs |= lp[c] != fp[c];
        differs = __syncthreads_or(differs);
    }
    int* out = slots + (i64)b * out_k;
    if (differs) {
        for (int c = tid; c < out_k; c += blockDim.x) out[c] = -1;
        if (tid == 0) {
            misses[b] = 0;
            skv_report(err, SKV_E_TP_MISMATCH, b, sh_foll);
        }
        return;
    }
    const int* in = lead_slots + (i64)b * out_k;
    for (int c = tid; c < out_k; c += blockDim.x) out[c] = in[c];
    if (tid == 0) misses[b] = lead_misses[b];
}
