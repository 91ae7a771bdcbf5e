// rope_kv_store.cu — a layer's rope on q and k and its KV store in one
// kernel (kernels/backend.h's rope_kv_store): at a decode step each of the
// three is a few thousand values, so their launches, not their bytes, are
// what they cost. A block a token row, a thread a rotated pair (of every
// head; below). fp8_e4m3 KV: one thread per rotated pair of q, one warp per
// row of k (rotated in place, then stored with its scale) and of v.
#include "kernels/cuda/cuda_int.h"

// A block a token row: each pair's angle made once into shared memory (a sine and cosine a pair, not a pair and
// head: at a 4k prompt the thread-a-pair version spent most of its time in sincosf and 64-bit index arithmetic),
// then the row's q and k pairs of every head rotated by them, k's stored, and its v stored. head_dim <= 512.
template <typename T>
__global__ void k_rope_kv_store(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt,
                                uint32_t hd, float *q, float *k, const float *v, uint32_t n_heads,
                                const int32_t *slots, uint32_t n, const int32_t *pos, const float *freq, int neox)
{
    __shared__ float sn[256], cs[256];
    kc_pdl_wait();
    kc_pdl_release();
    const uint32_t t = blockIdx.x, half = hd / 2, slot = (uint32_t)slots[t];
    for (uint32_t p = threadIdx.x; p < half; p += blockDim.x)
        kc_rope_angle(pos[t], freq, p, &sn[p], &cs[p]);
    __syncthreads();
    float *qr = q + (size_t)t * n_heads * hd, *kr = k + (size_t)t * n_kv * hd;
    uint32_t ia, ib;
    for (uint32_t i = threadIdx.x; i < n_heads * half; i += blockDim.x) {
        const uint32_t h = i / half, p = i % half;
        kc_rope_rot(qr + h * hd, p, hd, sn[p], cs[p], neox, &ia, &ib);
    }
    for (uint32_t i = threadIdx.x; i < n_kv * half; i += blockDim.x) {
        const uint32_t h = i / half, p = i % half;
        kc_rope_store_k<T>(kr + h * hd, p, hd, sn[p], cs[p], neox, base, block_bytes, layer, n_kv, bt, slot, h);
    }
    const float *vr = v + (size_t)t * n_kv * hd;
    for (uint32_t i = threadIdx.x; i < n_kv * hd; i += blockDim.x)
        *kc_kv_dst<T>(base, block_bytes, layer, 1, n_kv, bt, hd, slot, i / hd, i % hd) = kc_from_float<T>(vr[i]);
}

// fp8_e4m3: the first qb blocks rotate q, a pair a thread; the rest take K and V rows, a warp each
__global__ void k_rope_kv_store_f8(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt,
                                   uint32_t hd, float *q, float *k, const float *v, uint32_t n_heads,
                                   const int32_t *slots, uint32_t n, const int32_t *pos, const float *freq, int neox,
                                   uint32_t qb)
{
    kc_pdl_wait();
    kc_pdl_release();
    const uint32_t half = hd / 2;
    uint32_t ia, ib;
    if (blockIdx.x < qb) {
        const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, th = i / half;
        if (i < (size_t)n * n_heads * half)
            kc_rope_pair(q + th * hd, (uint32_t)(i % half), hd, pos[th / n_heads], freq, neox, &ia, &ib);
        return;
    }
    const size_t w = ((blockIdx.x - qb) * (size_t)blockDim.x + threadIdx.x) / 32, per = (size_t)n * n_kv;
    if (w >= 2 * per) // a whole warp
        return;
    const uint32_t which = w >= per, t = (uint32_t)((w - which * per) / n_kv), h = (uint32_t)((w - which * per) % n_kv);
    float *kr = k + ((size_t)t * n_kv + h) * hd;
    if (!which) {
        for (uint32_t p = threadIdx.x & 31; p < half; p += 32)
            kc_rope_pair(kr, p, hd, pos[t], freq, neox, &ia, &ib);
        __syncwarp(); // the lanes' rotated pairs are seen by every lane
    }
    kc_kv8_store(base, block_bytes, layer, which, n_kv, bt, hd, (uint32_t)slots[t], h,
                 which ? v + ((size_t)t * n_kv + h) * hd : kr);
}

// Eight consecutive pairs of one head from p0 (p0 a multiple of 8) rotated in fp32 by the angles in sn and cs:
// the head's values at v, its fp16 row; the rotated values written to out (the same offsets of another row, or
// v's own). neox pairs (p, p + hd/2): two runs of eight values; else (2p, 2p + 1): sixteen values in a run.
__device__ __forceinline__ void rope8_half(const __half *v, __half *out, uint32_t p0, uint32_t hd, const float *sn,
                                           const float *cs, int neox)
{
    const uint32_t a = neox ? p0 : 2 * p0, b = neox ? p0 + hd / 2 : 2 * p0 + 8;
    uint4 ua = *(const uint4 *)(v + a), ub = *(const uint4 *)(v + b);
    __half2 *ha = (__half2 *)&ua, *hb = (__half2 *)&ub;
    float x[16];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 fa = __half22float2(ha[j]), fb = __half22float2(hb[j]);
        x[2 * j] = fa.x, x[2 * j + 1] = fa.y, x[8 + 2 * j] = fb.x, x[8 + 2 * j + 1] = fb.y;
    }
    float y[16];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        // pair j: neox (x[j], x[8 + j]); else the j-th adjacent two of the sixteen
        const int i0 = neox ? j : 2 * j, i1 = neox ? 8 + j : 2 * j + 1;
        const float s = sn[p0 + j], c = cs[p0 + j];
        y[i0] = x[i0] * c - x[i1] * s;
        y[i1] = x[i0] * s + x[i1] * c;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        ha[j] = __floats2half2_rn(y[2 * j], y[2 * j + 1]);
        hb[j] = __floats2half2_rn(y[8 + 2 * j], y[8 + 2 * j + 1]);
    }
    *(uint4 *)(out + a) = ua;
    *(uint4 *)(out + b) = ub;
}

// rope_kv_store over a prompt step's Q, K and V handed over in fp16 (matmul_fused's to_next: q, k, v its three
// parts, each row dense), fp16 KV: a block a token row, the pair angles made once into shared memory as above;
// a thread rotates eight pairs of a head at a time, 16-byte loads and stores; Q rotated in place, K into the pool,
// V copied there 8 values at a time. head_dim a multiple of 16, <= 512.
__global__ void k_rope_kv_store_h(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt,
                                  uint32_t hd, __half *q, const __half *k, const __half *v, uint32_t n_heads,
                                  const int32_t *slots, const int32_t *pos, const float *freq, int neox)
{
    __shared__ float sn[256], cs[256];
    kc_pdl_wait();
    kc_pdl_release();
    const uint32_t t = blockIdx.x, half = hd / 2, per = half / 8, slot = (uint32_t)slots[t];
    for (uint32_t p = threadIdx.x; p < half; p += blockDim.x)
        kc_rope_angle(pos[t], freq, p, &sn[p], &cs[p]);
    __syncthreads();
    __half *qr = q + (size_t)t * n_heads * hd;
    for (uint32_t i = threadIdx.x; i < n_heads * per; i += blockDim.x) {
        __half *qh = qr + (i / per) * hd;
        rope8_half(qh, qh, (i % per) * 8, hd, sn, cs, neox);
    }
    const __half *kr = k + (size_t)t * n_kv * hd, *vr = v + (size_t)t * n_kv * hd;
    for (uint32_t i = threadIdx.x; i < n_kv * per; i += blockDim.x) {
        const uint32_t h = i / per;
        rope8_half(kr + h * hd, kc_kv_dst<__half>(base, block_bytes, layer, 0, n_kv, bt, hd, slot, h, 0), (i % per) * 8,
                   hd, sn, cs, neox);
    }
    for (uint32_t i = threadIdx.x; i < n_kv * hd / 8; i += blockDim.x) {
        const uint32_t h = i / (hd / 8), d = (i % (hd / 8)) * 8;
        *(uint4 *)kc_kv_dst<__half>(base, block_bytes, layer, 1, n_kv, bt, hd, slot, h, d) =
            *(const uint4 *)(vr + h * hd + d);
    }
}

__global__ void k_from_half(const __half *x, float *y, size_t n)
{
    kc_pdl_wait();
    kc_pdl_release();
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = __half2float(x[i]);
}

bool kc_qkv_handed(const kern_cuda_t *c, const float *q, uint32_t n) { return q && q == c->qkvh_of && n == c->qkvh_n; }

static td_status_t from_half(kern_cuda_t *c, const __half *x, float *y, size_t n)
{
    return kc_launch(c, "from_half", k_from_half, kc_blocks(n, 256), 256, 0, x, y, n);
}

td_status_t kc_q_to_float(kern_cuda_t *c, float *q, size_t n) { return from_half(c, (const __half *)c->qkvh.p, q, n); }

td_status_t kc_rope_kv_store(kern_backend_t *b, const kern_kv_view_t *kv, float *q, float *k, const float *v,
                             uint32_t n_heads, const int32_t *slots, uint32_t n, const int32_t *pos, const float *freq,
                             kern_rope_style_t style)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    const td_kv_layout_t *g = kv->layout;
    if (kc_qkv_handed(c, q, n)) { // Q, K and V in fp16 (matmul_fused's to_next)
        c->qkvh_of = NULL;
        const __half *h = (const __half *)c->qkvh.p;
        const size_t nq = (size_t)n * c->qkvh_rows[0], nk = (size_t)n * c->qkvh_rows[1];
        if (g->dtype == TD_KV_F16 && g->head_dim % 16 == 0 && g->head_dim <= 512 &&
            c->qkvh_rows[0] == n_heads * g->head_dim && c->qkvh_rows[1] == g->n_kv_heads * g->head_dim &&
            c->qkvh_rows[2] == c->qkvh_rows[1]) {
            td_status_t rc = kc_launch(c, "rope_kv_store_h", k_rope_kv_store_h, n, 256, 0, (uint8_t *)kv->base,
                                       kv->block_bytes, kv->layer, g->n_kv_heads, g->block_tokens, g->head_dim,
                                       (__half *)h, h + nq, h + nq + nk, n_heads, slots, pos, freq,
                                       (int)(style == KERN_ROPE_NEOX));
            if (!rc)
                c->qh_of = q; // the rotated Q, in fp16, for the attention
            return rc;
        }
        // any other pool: the three back in fp32 first
        td_status_t rc = from_half(c, h, q, nq);
        if (!rc)
            rc = from_half(c, h + nq, k, nk);
        if (!rc)
            rc = from_half(c, h + nq + nk, (float *)v, nk);
        if (rc)
            return rc;
    }
    const size_t total =
        (size_t)n * (n_heads + g->n_kv_heads) * (g->head_dim / 2) + (size_t)n * g->n_kv_heads * g->head_dim;
    if (!total)
        return TD_OK;
    if (g->head_dim > 512) // (the angles' shared memory)
        return td_error(TD_ERR_UNSUPPORTED, "cuda: rope_kv_store: head_dim %u is past 512", g->head_dim);
    if (g->dtype == TD_KV_F8_E4M3) {
        const unsigned qb = kc_blocks((size_t)n * n_heads * (g->head_dim / 2), 256);
        return kc_launch((kern_cuda_t *)b, "rope_kv_store", k_rope_kv_store_f8,
                         qb + kc_blocks((size_t)2 * n * g->n_kv_heads * 32, 256), 256, 0, (uint8_t *)kv->base,
                         kv->block_bytes, kv->layer, g->n_kv_heads, g->block_tokens, g->head_dim, q, k, v, n_heads,
                         slots, n, pos, freq, (int)(style == KERN_ROPE_NEOX), qb);
    }
    return kc_launch((kern_cuda_t *)b, "rope_kv_store",
                     g->dtype == TD_KV_F16 ? k_rope_kv_store<__half> : k_rope_kv_store<float>, n, 256, 0,
                     (uint8_t *)kv->base, kv->block_bytes, kv->layer,
                     g->n_kv_heads, g->block_tokens, g->head_dim, q, k, v, n_heads, slots, n, pos, freq,
                     (int)(style == KERN_ROPE_NEOX));
}
