// sample.cu — the next token of each row of logits, on the GPU, so that only
// token ids cross back to the host (kernels/backend.h's kern_sample_t).
//
// One block per row. Greedy is the first largest logit (eng_sampler's tie
// rule). Otherwise the kept set is every logit at or above one threshold, the
// largest of three found on the block: top-k's (the largest value with at
// least k logits at or above it) and top-p's (the largest value whose kept
// mass, relative to the top-k set's, still reaches top_p) by bisection over
// the floats' ordered bit patterns (32 rounds at most, each a pass over the
// row), min-p's in closed form (mx + T·ln min_p). The draw walks the kept
// logits in vocabulary order to the point u of their mass: the same
// distribution as eng_sampler's (which walks them largest first), not the
// same token for the same u. A row with a mask (structured output: the
// grammar's allowed tokens, made on the host) takes part only with the
// tokens its mask allows, as if the others' logits were -inf.
#include "kernels/cuda/cuda_int.h"

#define SM_THREADS 1024

__device__ __forceinline__ uint32_t sm_key(float v)
{
    uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

__device__ __forceinline__ float sm_val(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

// The block's sum of v (every thread gets it).
__device__ float sm_sum(float v, float *sh)
{
    v = kc_warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0;
    for (uint32_t w = 0; w < blockDim.x / 32; w++)
        t += sh[w];
    return t;
}

__global__ void __launch_bounds__(SM_THREADS)
    k_sample(const float *logits, uint32_t vocab, const kern_sample_t *ps, const uint8_t *masks, int32_t *ids)
{
    __shared__ float sh[32];
    __shared__ uint32_t shk[32], shi[32];
    kc_pdl_wait();
    kc_pdl_release();
    const float *x = logits + (size_t)blockIdx.x * vocab;
    const kern_sample_t p = ps[blockIdx.x];
    // a logit that takes part: a number, and (structured output) one the row's mask allows
    const uint8_t *mrow = p.masked ? masks + (size_t)blockIdx.x * ((vocab + 7) / 8) : NULL;
    auto ok = [&](uint32_t i) { return x[i] == x[i] && (!mrow || (mrow[i >> 3] >> (i & 7)) & 1); };
    // this thread's contiguous slice (the draw walks slices in order)
    const uint32_t per = (vocab + blockDim.x - 1) / blockDim.x, lo = min(vocab, threadIdx.x * per),
                   hi = min(vocab, lo + per);
    // the largest, first on ties (read across the block, coalesced; the
    // reduction below breaks ties by index)
    uint32_t bk = 0, bi = UINT32_MAX;
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        uint32_t k = ok(i) ? sm_key(x[i]) : 0;
        if (k > bk || bi == UINT32_MAX)
            bk = k, bi = i;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        uint32_t ok = __shfl_xor_sync(0xffffffffu, bk, o), oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ok > bk || (ok == bk && oi < bi))
            bk = ok, bi = oi;
    }
    if ((threadIdx.x & 31) == 0)
        shk[threadIdx.x >> 5] = bk, shi[threadIdx.x >> 5] = bi;
    __syncthreads();
    bk = shk[0], bi = shi[0];
    for (uint32_t w = 1; w < blockDim.x / 32; w++)
        if (shk[w] > bk || (shk[w] == bk && shi[w] < bi))
            bk = shk[w], bi = shi[w];
    if (p.temperature == 0) {
        if (threadIdx.x == 0)
            ids[blockIdx.x] = (int32_t)bi;
        return;
    }
    const float mx = sm_val(bk), inv_t = 1.0f / p.temperature;
    uint32_t t = 0; // the threshold's key: everything kept so far
    if (p.top_k > 0 && (uint32_t)p.top_k < vocab) {
        uint32_t a = 0, b = bk;
        while (a < b) { // the largest key with at least top_k logits at or above it
            const uint32_t mid = a + (b - a + 1) / 2;
            float c = 0;
            for (uint32_t i = lo; i < hi; i++)
                c += ok(i) && sm_key(x[i]) >= mid;
            if (sm_sum(c, sh) >= (float)p.top_k)
                a = mid;
            else
                b = mid - 1;
        }
        t = a;
    }
    if (p.top_p < 1) {
        float z = 0;
        for (uint32_t i = lo; i < hi; i++)
            if (ok(i) && sm_key(x[i]) >= t)
                z += __expf((x[i] - mx) * inv_t);
        const float want = p.top_p * sm_sum(z, sh);
        uint32_t a = t, b = bk;
        while (a < b) { // the largest key whose mass at or above it still reaches top_p
            const uint32_t mid = a + (b - a + 1) / 2;
            float s = 0;
            for (uint32_t i = lo; i < hi; i++)
                if (ok(i) && sm_key(x[i]) >= mid)
                    s += __expf((x[i] - mx) * inv_t);
            if (sm_sum(s, sh) >= want)
                a = mid;
            else
                b = mid - 1;
        }
        t = a;
    }
    if (p.min_p > 0) {
        const uint32_t m = sm_key(mx + p.temperature * logf(p.min_p));
        t = m > t ? m : t;
    }
    // the draw: this slice's kept mass, the slices before it, then the walk
    float mine = 0;
    for (uint32_t i = lo; i < hi; i++)
        if (ok(i) && sm_key(x[i]) >= t)
            mine += __expf((x[i] - mx) * inv_t);
    __shared__ float pre[SM_THREADS];
    pre[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) { // prefix over the slices (1,024 adds)
        float acc = 0;
        for (uint32_t i = 0; i < blockDim.x; i++) {
            float v = pre[i];
            pre[i] = acc;
            acc += v;
        }
        sh[0] = acc;
    }
    __syncthreads();
    // the slice that holds r: the last non-empty one whose start is at or
    // below r and whose end is past it (or that has no non-empty one after it)
    const float total = sh[0], r = p.u * total, before = pre[threadIdx.x];
    const float end = threadIdx.x == blockDim.x - 1 ? total : pre[threadIdx.x + 1];
    if (mine > 0 && r >= before && (r < end || end >= total)) {
        float acc = before;
        uint32_t pick = bi, any = UINT32_MAX;
        for (uint32_t i = lo; i < hi; i++) {
            if (!(ok(i) && sm_key(x[i]) >= t))
                continue;
            any = i;
            acc += __expf((x[i] - mx) * inv_t);
            if (r < acc) {
                pick = i;
                break;
            }
        }
        ids[blockIdx.x] = (int32_t)(r < acc ? pick : any);
    }
}

td_status_t kc_sample(kern_backend_t *b, const float *logits, uint32_t n, uint32_t vocab, const kern_sample_t *p,
                      const uint8_t *masks, int32_t *ids)
{
    kc_bind(b);
    if (!n)
        return TD_OK;
    if (!vocab)
        return td_error(TD_ERR_INVALID_ARG, "cuda: sample: an empty vocabulary");
    return kc_launch((kern_cuda_t *)b, "sample", k_sample, n, SM_THREADS, 0, logits, vocab, p, masks, ids);
}
