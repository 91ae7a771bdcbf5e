// cuda_int.h — what the CUDA backend's files share: the backend's state, the
// error macros, and one launcher per op (each op in its own .cu file; the
// table in backend_cuda.cu). Internal to kernels/cuda/.
#ifndef KERN_CUDA_INT_H
#define KERN_CUDA_INT_H

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "common/log.h"
#include "common/status.h"
#include "kernels/backend.h"

// cuBLAS is loaded at run time (dlopen), so that a tandem binary built with
// CUDA starts without it and only a CUDA device asks for it.
typedef struct kc_blas_api {
    cublasStatus_t (*create)(cublasHandle_t *);
    cublasStatus_t (*destroy)(cublasHandle_t);
    cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t);
    cublasStatus_t (*set_workspace)(cublasHandle_t, void *, size_t);
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
                              const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *,
                              cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
} kc_blas_api_t;

// The newest captured step's edges (backend_cuda.cu's count_edges).
typedef struct kc_edge_count {
    size_t all, programmatic;
} kc_edge_count_t;

// Device memory that grows on demand (never shrinks).
typedef struct kc_scratch {
    void *p;
    size_t cap; // bytes
} kc_scratch_t;

// An allocation holding several weights side by side (weights_join), freed with the last of them.
typedef struct kc_join {
    char *base;
    size_t bytes;
    uint32_t live;    // its weights not yet released
    uint32_t f8_rows; // FP8-held weights: their rows together (the codes side by side, then the scales); 0: fp16
} kc_join_t;

// Rows up to which one GEMM over joined weights beats one a weight (bench/gpu/gemm_study.cu, the 7B layer on an
// H200: 10% faster at 256 rows, 3.6% slower at 1,024, even at 4,096)
#define KC_JOIN_MAXN 512

#define KC_GRAPHS 64
#define KC_BLAS_WS ((size_t)32 << 20)

// The decode attention reads K through shared memory only where the step's longest context has at least this
// many positions (kern_backend_ops_t.capture_ctx_split): at short contexts the smaller blocks of the register
// path were faster (gpu-2026-11-26c run 6)
#define KC_DEC_KS_CTX 512

typedef struct kern_cuda {
    kern_backend_t base;
    int device;
    cudaStream_t stream;
    const kc_blas_api_t *blas_api;
    cublasHandle_t blas;
    int sms;    // streaming multiprocessors (how wide a launch must be)
    kc_scratch_t xh; // fp16 activations for the GEMMs
    kc_scratch_t wh; // an FP8 matrix's fp16 copy for the GEMMs (matmul_fp8.cu)
    struct kc_f8_lt *f8_lt; // cuBLASLt and its plans for FP8 GEMMs (gemm_fp8.cu); NULL without it
    kc_scratch_t x8, f8d; // the FP8 GEMMs' activation codes and scales, their results before scaling
    // xh holds the fp16 form of this fp32 array's first xh_n values (a glu matmul_fused with to_next, or a prompt
    // step's attention, left it for the next call, which takes it instead of converting x); NULL when it holds
    // nothing reusable
    const float *xh_of;
    size_t xh_n;
    bool xh_x_too; // and the fp32 array holds those values too (the attention's output), not only xh
    // A prompt step's Q, K and V in fp16 (matmul_fused with to_next over three weights: kern_matmul_spec_t), Q's
    // rows, then K's, then V's, standing for the fp32 arrays whose first is qkvh_of (qkvh_n rows of qkvh_rows[i]
    // values); rope_kv_store takes them from there and leaves the rotated Q in place for the attention, which
    // takes it for the fp32 q qh_of. NULL: nothing handed over (every matmul_fused call starts so).
    kc_scratch_t qkvh;
    const float *qkvh_of, *qh_of;
    uint32_t qkvh_n, qkvh_rows[3];
    bool qkv_fp32; // not so: in fp32 as before (kern_cuda_set_qkv_half, for a comparison)
    kc_scratch_t ws; // attention's slices
    kc_scratch_t cnt; // attention's count of finished slices (zero between launches)
    kc_scratch_t dg; // kv_digest's block list and results
    // captured steps (backend_cuda.cu), newest replacing the oldest when full
    struct {
        uint64_t key;
        cudaGraphExec_t exec;
    } graphs[KC_GRAPHS];
    uint32_t n_graphs, next_graph;
    void *blas_ws; // cuBLAS's workspace, set once (a captured GEMM may not allocate)
    bool pdl_able; // the device has programmatic dependent launch (sm_90 and later)
    uint32_t wg_shape; // prompt attention on the warpgroup MMA (attention_wg.cu): its variant + 1, or 0
    bool pdl;      // kernels launched programmatically dependent (kc_launch): pdl_able unless turned off
    unsigned gv_grid; // the GEMV's blocks resident at once (its grid at most)
    unsigned gc_grid[2]; // the same for the column-split GEMV's two shapes (matmul_fused.cu's k_gemv_cols)
    unsigned f8_grid[2][2]; // the same for the FP8 GEMV's shapes, without and with glu (matmul_fp8.cu)
    // the decode attention's blocks resident at once when it reads K through shared memory, by head_dim (64, 128)
    // and query heads a KV head (1, 2, 4, 8)
    unsigned dec_ks_grid[2][4];
    kc_edge_count_t edges;
    kc_join_t *joins; // allocations of weights side by side (weights_join)
    uint32_t n_joins;
} kern_cuda_t;

// A CUDA runtime call that must succeed; else its error, naming the call.
#define CU(call)                                                                                                \
    do {                                                                                                        \
        cudaError_t e_ = (call);                                                                                \
        if (e_ != cudaSuccess)                                                                                  \
            return td_error(TD_ERR_INTERNAL, "cuda: %s failed: %s", #call, cudaGetErrorString(e_));              \
    } while (0)

// After a kernel launch: a launch error (bad configuration, or an earlier
// asynchronous fault, which CUDA keeps sticky) names the kernel.
static inline td_status_t kc_launched(const char *kernel)
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? TD_OK
                            : td_error(TD_ERR_INTERNAL, "cuda: kernel %s: %s", kernel, cudaGetErrorString(e));
}

// Makes the backend's device current on the calling thread (the engine
// thread is not the one that made the backend); every op begins with it.
static inline void kc_bind(kern_backend_t *b)
{
    int d = -1, want = ((kern_cuda_t *)b)->device;
    if (cudaGetDevice(&d) != cudaSuccess || d != want)
        cudaSetDevice(want);
}

#ifdef __CUDACC__
// silu(g) * u: SwiGLU's product, the one formula of every kernel that makes it
__device__ __forceinline__ float kc_silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// The sum of v over the warp's 32 lanes (every lane gets it).
__device__ __forceinline__ float kc_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// 1 / rms(xr[0..dim)) + eps's, by the whole block (up to 256 threads):
// every thread gets it. For the kernels that normalize a row per block.
__device__ __forceinline__ float kc_row_rms_scale(const float *xr, uint32_t dim, float eps)
{
    __shared__ float part[256];
    float s = 0;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        s += xr[i] * xr[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k)
            part[threadIdx.x] += part[threadIdx.x + k];
        __syncthreads();
    }
    return rsqrtf(part[0] / dim + eps);
}
#endif

#ifdef __CUDACC__
// Programmatic dependent launch (sm_90). kc_launch lets a kernel start while
// the kernel before it in the stream is still running, so that its blocks are
// resident (and may load what does not depend on that kernel, such as
// weights) when the earlier one ends. Every kernel it launches calls
// kc_pdl_wait() before it reads what the kernel just before wrote and before
// it writes anything, in every block, even one with nothing to do: the wait
// returns once the earlier kernel has finished and its writes are visible,
// and so orders it after every kernel before that one too. kc_pdl_release()
// lets the next kernel start, and every kernel calls it after its wait (one
// that never calls it releases as its blocks end): so when a kernel starts,
// every kernel before the one just before it has ended, and what those wrote
// (a KV row an earlier step stored) may be read before the wait.
__device__ __forceinline__ void kc_pdl_wait(void)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void kc_pdl_release(void)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel k on the backend's stream (programmatically dependent where
// the device has it); a launch error names the kernel.
template <typename... P, typename... A>
static inline td_status_t kc_launch(const kern_cuda_t *c, const char *name, void (*k)(P...), dim3 grid, dim3 block,
                                    size_t smem, A &&...args)
{
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cfg.attrs = at;
    cfg.numAttrs = c->pdl ? 1 : 0;
    cudaError_t e = cudaLaunchKernelEx(&cfg, k, static_cast<A &&>(args)...);
    if (e != cudaSuccess)
        return td_error(TD_ERR_INTERNAL, "cuda: kernel %s: %s", name, cudaGetErrorString(e));
    return kc_launched(name);
}
#endif

#ifdef __CUDACC__
// Rotates pair p of one head's vector v (head_dim hd) by the angle whose
// sine and cosine are s and c: (p, p + hd/2) for neox, else (2p, 2p + 1).
// Returns the pair's indices in *ia, *ib (the rotated values are written
// back to v).
__device__ __forceinline__ void kc_rope_rot(float *v, uint32_t p, uint32_t hd, float s, float c, int neox,
                                            uint32_t *ia, uint32_t *ib)
{
    const uint32_t a = neox ? p : 2 * p, b = neox ? p + hd / 2 : 2 * p + 1;
    const float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
    *ia = a, *ib = b;
}
// The sine and cosine of pair p's angle at position pos: pos * freq[p].
__device__ __forceinline__ void kc_rope_angle(int32_t pos, const float *freq, uint32_t p, float *s, float *c)
{
    sincosf((float)pos * freq[p], s, c);
}
// kc_rope_rot by pair p's angle at position pos.
__device__ __forceinline__ void kc_rope_pair(float *v, uint32_t p, uint32_t hd, int32_t pos, const float *freq,
                                             int neox, uint32_t *ia, uint32_t *ib)
{
    float s, c;
    kc_rope_angle(pos, freq, p, &s, &c);
    kc_rope_rot(v, p, hd, s, c, neox, ia, ib);
}

// Where value d of KV head h of the token at `slot` goes in layer `layer`'s
// K (which 0) or V (which 1) of the pool at base (common/kv_contract.h's
// canonical block layout), T being the pool's element type.
template <typename T>
__device__ __forceinline__ T *kc_kv_dst(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t which,
                                        uint32_t n_kv, uint32_t bt, uint32_t hd, uint32_t slot, uint32_t h, uint32_t d)
{
    const uint32_t blk = slot / bt, off = slot % bt;
    return (T *)(base + (size_t)blk * block_bytes) + (((size_t)layer * 2 + which) * n_kv + h) * bt * hd +
           (size_t)off * hd + d;
}
// fp8_e4m3 KV (common/kv_contract.h): a layer's rows, then their scales (fp32, one a row). Bytes from a block's
// start to the row of K (which 0) or V (which 1) of KV head h at offset off in the block, and to its scale.
__device__ __forceinline__ size_t kc_kv8_layer_bytes(uint32_t n_kv, uint32_t bt, uint32_t hd)
{
    return (size_t)2 * n_kv * bt * (hd + sizeof(float));
}
__device__ __forceinline__ size_t kc_kv8_row(uint32_t layer, uint32_t which, uint32_t n_kv, uint32_t bt, uint32_t hd,
                                             uint32_t h, uint32_t off)
{
    return layer * kc_kv8_layer_bytes(n_kv, bt, hd) + (((size_t)which * n_kv + h) * bt + off) * hd;
}
__device__ __forceinline__ size_t kc_kv8_scale(uint32_t layer, uint32_t which, uint32_t n_kv, uint32_t bt, uint32_t hd,
                                               uint32_t h, uint32_t off)
{
    return layer * kc_kv8_layer_bytes(n_kv, bt, hd) + (size_t)2 * n_kv * bt * hd +
           (((size_t)which * n_kv + h) * bt + off) * sizeof(float);
}
// One warp stores the row x [hd] of the token at `slot` as fp8_e4m3 codes and their scale, as
// kern_fp8_quantize_row makes them (amax / 448, each value over it rounded to nearest even, saturated): the CPU
// backend's bytes.
__device__ __forceinline__ void kc_kv8_store(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t which,
                                             uint32_t n_kv, uint32_t bt, uint32_t hd, uint32_t slot, uint32_t h,
                                             const float *x)
{
    const uint32_t lane = threadIdx.x & 31, off = slot % bt;
    uint8_t *blk = base + (size_t)(slot / bt) * block_bytes;
    float m = 0;
    for (uint32_t i = lane; i < hd; i += 32)
        m = fmaxf(m, fabsf(x[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float s = m > 0 ? __fdiv_rn(m, 448.0f) : 1.0f;
    uint8_t *row = blk + kc_kv8_row(layer, which, n_kv, bt, hd, h, off);
    for (uint32_t i = lane; i < hd; i += 32)
        row[i] = (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(x[i], s), __NV_SATFINITE, __NV_E4M3);
    if (lane == 0)
        *(float *)(blk + kc_kv8_scale(layer, which, n_kv, bt, hd, h, off)) = s;
}
template <typename T> __device__ __forceinline__ T kc_from_float(float f);
template <> __device__ __forceinline__ float kc_from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ __half kc_from_float<__half>(float f) { return __float2half_rn(f); }

// Rotates pair p of kr, KV head h's K row of the token at `slot`, by the angle of sine s and cosine c
// (kc_rope_rot), and stores the pair to layer `layer`'s K in the pool: rope_kv_store's work on K, which the
// decode attention also does for its row.
template <typename T>
__device__ __forceinline__ void kc_rope_store_k(float *kr, uint32_t p, uint32_t hd, float s, float c, int neox,
                                                uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv,
                                                uint32_t bt, uint32_t slot, uint32_t h)
{
    uint32_t ia, ib;
    kc_rope_rot(kr, p, hd, s, c, neox, &ia, &ib);
    *kc_kv_dst<T>(base, block_bytes, layer, 0, n_kv, bt, hd, slot, h, ia) = kc_from_float<T>(kr[ia]);
    *kc_kv_dst<T>(base, block_bytes, layer, 0, n_kv, bt, hd, slot, h, ib) = kc_from_float<T>(kr[ib]);
}
#endif

static inline unsigned kc_blocks(size_t n, unsigned threads) { return (unsigned)((n + threads - 1) / threads); }

// Grows sc to at least `bytes` (waiting for the stream first: the old
// memory may still be read by queued work).
td_status_t kc_scratch(kern_cuda_t *c, kc_scratch_t *sc, size_t bytes);
// y[i] = (half)x[i] on the backend's stream
td_status_t kc_to_half(kern_cuda_t *c, const float *x, __half *y, size_t n);

// y[n][rows] (+)= xh · Wᵀ: x already fp16 in c->xh; accumulate: beta 1
td_status_t kc_gemm(kern_cuda_t *c, const kern_weight_t *w, float *y, uint32_t n, bool accumulate);
// the same for fp16 rows a[rows][cols] into y's rows of ldy values
td_status_t kc_gemm_rows(kern_cuda_t *c, const __half *a, uint32_t rows, uint32_t cols, float *y, uint32_t ldy,
                         uint32_t n, bool accumulate);
// the same into fp16 rows (fp32 sums, rounded once): half the bytes written, for a product only an fp16 kernel reads
td_status_t kc_gemm_rows_half(kern_cuda_t *c, const __half *a, uint32_t rows, uint32_t cols, __half *y, uint32_t n);
td_status_t kc_matmul(kern_backend_t *b, const kern_weight_t *w, const float *x, float *y, uint32_t n);
td_status_t kc_matmul_multi(kern_backend_t *b, const kern_weight_t *const *w, float *const *y, uint32_t k,
                            const float *x, uint32_t n);
td_status_t kc_rmsnorm(kern_backend_t *b, const float *x, const float *w, float *y, uint32_t n, uint32_t dim,
                       float eps);
td_status_t kc_rope(kern_backend_t *b, float *x, uint32_t n, uint32_t heads, uint32_t head_dim, const int32_t *pos,
                    const float *freq, kern_rope_style_t style);
td_status_t kc_swiglu(kern_backend_t *b, const float *gate, const float *up, float *y, size_t n);
// y = (half)(silu(gate) * up), the same values kc_swiglu then kc_to_half make
td_status_t kc_swiglu_half(kern_cuda_t *c, const float *gate, const float *up, __half *y, size_t n);
// the same over n rows of width values, row r's gate at gate + r * stride and its up at up + r * stride (a joined
// product's rows: matmul_fused.cu), into y's dense rows
td_status_t kc_swiglu_half_rows(kern_cuda_t *c, const float *gate, const float *up, uint32_t stride, __half *y,
                                uint32_t n, uint32_t width);
// y = (half)(silu(gate) * up) from fp16 gate and up (n even)
td_status_t kc_swiglu_hh(kern_cuda_t *c, const __half *gate, const __half *up, __half *y, size_t n);
td_status_t kc_add(kern_backend_t *b, float *x, const float *y, size_t n);
td_status_t kc_embed(kern_backend_t *b, const kern_weight_t *table, const int32_t *ids, uint32_t n, float *out);
td_status_t kc_kv_store(kern_backend_t *b, const kern_kv_view_t *kv, const float *k, const float *v,
                        const int32_t *slots, uint32_t n);
// Q, K and V of a prompt step in fp16 (c->qkvh), as kc_rope_kv_store takes them (rope_kv_store.cu): true when
// q is what they stand for
bool kc_qkv_handed(const kern_cuda_t *c, const float *q, uint32_t n);
// The handed Q (rotated) back in the fp32 q it stands for, for a kernel that reads fp32 (rope_kv_store.cu)
td_status_t kc_q_to_float(kern_cuda_t *c, float *q, size_t n);
td_status_t kc_rope_kv_store(kern_backend_t *b, const kern_kv_view_t *kv, float *q, float *k, const float *v,
                             uint32_t n_heads, const int32_t *slots, uint32_t n, const int32_t *pos, const float *freq,
                             kern_rope_style_t style);
td_status_t kc_attention(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *out, uint32_t n_heads,
                         const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs, uint32_t n_seqs, float scale);
td_status_t kc_rope_kv_attention(kern_backend_t *b, const kern_kv_view_t *kv, const kern_rope_kv_t *r, float *out,
                                 const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs, uint32_t n_seqs,
                                 float scale);
td_status_t kc_matmul_fused(kern_backend_t *b, const kern_matmul_spec_t *s);
// Sizes the GEMV's grid to what the device holds at once (once, at creation).
td_status_t kc_matmul_fused_init(kern_cuda_t *c);
// A matrix without a file filled with its seeded values (fill.cu; kern_weight_t.fill) into dst [rows][cols].
td_status_t kc_fill(kern_cuda_t *c, const kern_weight_t *w, __half *dst);
// FP8 matrices (matmul_fp8.cu): held at weight_prepare; the GEMV of one row where kc_fp8_gemv_takes says; the
// fp16 copy the GEMMs read (in c->wh, valid until the next call); sizing the GEMV's grid once, at creation.
td_status_t kc_fp8_prepare(kern_cuda_t *c, kern_weight_t *w);
bool kc_fp8_gemv_takes(const kern_matmul_spec_t *s);
td_status_t kc_fp8_gemv(kern_cuda_t *c, const kern_matmul_spec_t *s);
td_status_t kc_fp8_half(kern_cuda_t *c, const kern_weight_t *w, const __half **out);
td_status_t kc_fp8_init(kern_cuda_t *c);
// where the scales begin in an FP8 matrix's buffer (matmul_fp8.cu)
size_t kc_fp8_scales_at(const kern_weight_t *w);
// The fused matmul of more than one row over FP8 matrices on the FP8 tensor cores (gemm_fp8.cu); TD_ERR_UNSUPPORTED,
// quietly, where cuBLASLt is missing or has no algorithm (the caller takes the fp16 copy). init loads cuBLASLt where
// it can.
td_status_t kc_fp8_matmul(kern_cuda_t *c, const kern_matmul_spec_t *s);
// An FP8-held matrix's row scales on the device: after its codes, or where weights_join put them
const float *kc_fp8_scales(const kern_cuda_t *c, const kern_weight_t *w);
// The joined product side [n][total] (weights_join) out to s's y[i]; with xs (FP8 sums), each value times its
// token's scale xs[t] and its row's ws[r] (the joined weights' scales, in their order)
td_status_t kc_split_rows(kern_cuda_t *c, const kern_matmul_spec_t *s, const float *side, const float *xs,
                          const float *ws);
// Whether s's weights are all held as hold (0: fp16; KERN_TYPE_F8_E4M3) and lie side by side in one allocation
// (weights_join), each row count a multiple of 4 (kc_split_rows moves 16 bytes at a time)
bool kc_side_by_side(const kern_matmul_spec_t *s, uint32_t hold);
td_status_t kc_fp8_gemm_init(kern_cuda_t *c);
void kc_fp8_gemm_destroy(kern_cuda_t *c);
td_status_t kc_weight_scale_cols(kern_backend_t *b, kern_weight_t *w, const float *s, bool apply, bool *fits);
td_status_t kc_sample(kern_backend_t *b, const float *logits, uint32_t n, uint32_t vocab, const kern_sample_t *p,
                      const uint8_t *masks, int32_t *ids);
// Drops every captured step (memory one of them uses is about to move).
void kc_graphs_drop(kern_cuda_t *c);
td_status_t kc_kv_digest(kern_backend_t *b, const void *base, size_t block_bytes, const int32_t *blocks, uint32_t n,
                         uint64_t *out);
// Sets the shared-memory limits the kernels need (once, at creation).
td_status_t kc_attention_init(kern_cuda_t *c);
// The prompt attention's kernel: 0 the mma.sync one, 1.. a variant of attention_wg.cu's (where the device has it);
// returns the one in use before
uint32_t kc_attention_wg_pick(kern_cuda_t *c, uint32_t variant);

#endif
