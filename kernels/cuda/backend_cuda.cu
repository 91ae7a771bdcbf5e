// backend_cuda.cu — the CUDA backend's table (kernels/backend.h): device
// memory, one stream, the weights, cuBLAS loaded at run time; each op lives
// in its own file (cuda_int.h lists them).
//
// Weights: weight_prepare uploads the file's bytes and decodes them on the
// GPU (kernels/cuda/dequant.cu: F32, F16, BF16, Q4_0, Q4_1, Q8_0; other
// formats are decoded on the host) into fp16 rows, which every matmul and
// the embedding read. Quantized weights so cost 2 bytes a value in device
// memory and per decode step (Q4_1 tensors: 3.2x their 0.625 bytes a value).
// A matrix asked for in FP8, or an FP8 file's, is held in FP8 (matmul_fp8.cu).
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cuda_int.h"
#include "kernels/cuda/dequant.h"
#include "kernels/quant.h"

static td_status_t cu_alloc(kern_backend_t *b, size_t bytes, void **ptr)
{
    kc_bind(b);
    (void)b;
    cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 64);
    if (e != cudaSuccess)
        return td_error(e == cudaErrorMemoryAllocation ? TD_ERR_NO_MEMORY : TD_ERR_INTERNAL,
                        "cuda: cannot allocate %zu bytes of device memory: %s", bytes, cudaGetErrorString(e));
    return TD_OK;
}

static void cu_free(kern_backend_t *b, void *ptr)
{
    kc_bind(b);
    (void)b;
    cudaFree(ptr);
}

static td_status_t cu_host_alloc(kern_backend_t *b, size_t bytes, void **ptr)
{
    kc_bind(b);
    cudaError_t e = cudaHostAlloc(ptr, bytes ? bytes : 64, cudaHostAllocPortable);
    if (e != cudaSuccess)
        return td_error(e == cudaErrorMemoryAllocation ? TD_ERR_NO_MEMORY : TD_ERR_INTERNAL,
                        "cuda: cannot allocate %zu bytes of page-locked host memory: %s", bytes, cudaGetErrorString(e));
    return TD_OK;
}

static void cu_host_free(kern_backend_t *b, void *ptr)
{
    kc_bind(b);
    cudaFreeHost(ptr);
}

static td_status_t cu_upload(kern_backend_t *b, void *dst, const void *src, size_t n)
{
    kc_bind(b);
    CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, ((kern_cuda_t *)b)->stream));
    return TD_OK;
}

static td_status_t cu_download(kern_backend_t *b, void *dst, const void *src, size_t n)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, c->stream));
    CU(cudaStreamSynchronize(c->stream));
    return TD_OK;
}

static td_status_t cu_copy(kern_backend_t *b, void *dst, const void *src, size_t n)
{
    kc_bind(b);
    CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, ((kern_cuda_t *)b)->stream));
    return TD_OK;
}

static td_status_t cu_sync(kern_backend_t *b)
{
    kc_bind(b);
    CU(cudaStreamSynchronize(((kern_cuda_t *)b)->stream));
    return TD_OK;
}

// The formats the GPU decodes; the rest go through the host's decoders.
static bool gpu_decodes(uint32_t type)
{
    return type == KERN_TYPE_F32 || type == KERN_TYPE_F16 || type == KERN_TYPE_BF16 || type == KERN_TYPE_Q4_0 ||
           type == KERN_TYPE_Q4_1 || type == KERN_TYPE_Q8_0;
}

// Host decode, row by row, into fp16 (the formats the GPU does not decode).
static td_status_t prepare_on_host(kern_cuda_t *c, kern_weight_t *w, __half *dst)
{
    const kern_type_info_t *info = kern_type_info(w->type);
    size_t n = (size_t)w->rows * w->cols, rb = kern_type_row_bytes(info, w->cols);
    float *row = (float *)malloc(w->cols * sizeof(float));
    __half *h = (__half *)malloc(n * sizeof(__half));
    td_status_t rc = row && h ? TD_OK
                              : td_error(TD_ERR_NO_MEMORY, "cuda: no host memory to convert a %ux%u matrix", w->rows,
                                         w->cols);
    for (uint32_t r = 0; r < w->rows && !rc; r++) {
        rc = kern_dequant_row(w->type, (const uint8_t *)w->data + r * rb, row, w->cols);
        for (uint32_t k = 0; k < w->cols && !rc; k++)
            h[(size_t)r * w->cols + k] = __float2half_rn(row[k]);
    }
    if (!rc) {
        cudaError_t e = cudaMemcpyAsync(dst, h, n * sizeof(__half), cudaMemcpyHostToDevice, c->stream);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess)
            rc = td_error(TD_ERR_INTERNAL, "cuda: weight upload failed: %s", cudaGetErrorString(e));
    }
    free(row);
    free(h);
    return rc;
}

// Upload the file's bytes, decode on the GPU in slices of rows into an fp32
// scratch, round to fp16.
static td_status_t prepare_on_gpu(kern_cuda_t *c, kern_weight_t *w, __half *dst)
{
    const kern_type_info_t *info = kern_type_info(w->type);
    size_t rb = kern_type_row_bytes(info, w->cols), raw_bytes = rb * w->rows;
    if (w->type == KERN_TYPE_F16) { // already the form kept: copied on the backend's stream, which is
        // non-blocking: a plain cudaMemcpy from pageable memory may return before its copy lands, and is not
        // ordered before the stream's next kernel
        CU(cudaMemcpyAsync(dst, w->data, raw_bytes, cudaMemcpyHostToDevice, c->stream));
        CU(cudaStreamSynchronize(c->stream));
        return TD_OK;
    }
    size_t slice_rows = ((size_t)8 << 20) / w->cols + 1;
    if (slice_rows > w->rows)
        slice_rows = w->rows;
    void *raw = NULL;
    float *f = NULL;
    cudaError_t e = cudaSuccess;
    td_status_t rc = cu_alloc(&c->base, raw_bytes, &raw);
    if (!rc)
        rc = cu_alloc(&c->base, slice_rows * w->cols * 4, (void **)&f);
    if (!rc && (e = cudaMemcpyAsync(raw, w->data, raw_bytes, cudaMemcpyHostToDevice, c->stream)) != cudaSuccess)
        rc = td_error(TD_ERR_INTERNAL, "cuda: weight upload failed: %s", cudaGetErrorString(e));
    for (size_t r0 = 0; r0 < w->rows && !rc; r0 += slice_rows) {
        size_t nr = w->rows - r0 < slice_rows ? w->rows - r0 : slice_rows, ne = nr * w->cols;
        rc = kern_cuda_dequant(w->type, (const uint8_t *)raw + r0 * rb, f, ne, c->stream);
        if (rc)
            rc = td_error(rc, "cuda: decoding a %s weight failed", info->name);
        else
            rc = kc_to_half(c, f, dst + r0 * w->cols, ne);
    }
    if (!rc && (e = cudaStreamSynchronize(c->stream)) != cudaSuccess)
        rc = td_error(TD_ERR_INTERNAL, "cuda: weight decode failed: %s", cudaGetErrorString(e));
    cudaFree(raw);
    cudaFree(f);
    return rc;
}

static td_status_t cu_weight_prepare(kern_backend_t *b, kern_weight_t *w)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    if (w->hold == KERN_TYPE_F8_E4M3 || w->type == KERN_TYPE_F8_E4M3)
        return kc_fp8_prepare(c, w);
    void *dst;
    td_status_t rc = cu_alloc(b, (size_t)w->rows * w->cols * sizeof(__half), &dst);
    if (rc)
        return rc;
    rc = !w->data && w->type == KERN_TYPE_F16 ? kc_fill(c, w, (__half *)dst)
         : gpu_decodes(w->type)                ? prepare_on_gpu(c, w, (__half *)dst)
                                               : prepare_on_host(c, w, (__half *)dst);
    if (rc) {
        cudaFree(dst);
        return rc;
    }
    w->priv = dst;
    return TD_OK;
}

static void cu_weight_release(kern_backend_t *b, kern_weight_t *w)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    for (uint32_t i = 0; i < c->n_joins; i++) {
        kc_join_t *j = &c->joins[i];
        if ((char *)w->priv >= j->base && (char *)w->priv < j->base + j->bytes) { // a part of a joined allocation
            if (--j->live == 0) {
                cu_free(b, j->base);
                *j = c->joins[--c->n_joins];
            }
            w->priv = NULL;
            return;
        }
    }
    cu_free(b, w->priv);
    w->priv = NULL;
}

// weights_join: rows of one width and one form copied side by side into one allocation, the separate ones freed:
// fp16 rows; FP8-held ones as their codes side by side, then their scales side by side (kc_fp8_scales finds a
// part's). matmul_fused.cu and gemm_fp8.cu multiply them with one GEMM where the caller gives room for the
// product. Short of memory for the copy, they stay apart.
static td_status_t cu_weights_join(kern_backend_t *b, kern_weight_t *const *w, uint32_t k)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    const bool f8 = w[0]->hold == KERN_TYPE_F8_E4M3;
    const size_t cols = w[0]->cols, esz = f8 ? 1 : sizeof(__half);
    size_t rows = 0;
    for (uint32_t i = 0; i < k; i++) {
        if (w[i]->hold != w[0]->hold || (w[i]->hold && !f8) || !w[i]->priv || w[i]->cols != cols)
            return TD_OK;
        for (uint32_t j = 0; j < c->n_joins; j++) // joined once only
            if ((char *)w[i]->priv >= c->joins[j].base && (char *)w[i]->priv < c->joins[j].base + c->joins[j].bytes)
                return TD_OK;
        rows += w[i]->rows;
    }
    if (k < 2)
        return TD_OK;
    const size_t codes = f8 ? (rows * cols + 255) & ~(size_t)255 : rows * cols * esz, bytes = codes + (f8 ? rows * 4 : 0);
    kc_join_t *grown = (kc_join_t *)realloc(c->joins, (c->n_joins + 1) * sizeof *grown);
    if (!grown)
        return td_error(TD_ERR_NO_MEMORY, "cuda: no memory to join %u weights", k);
    c->joins = grown;
    char *dst;
    if (cudaMalloc((void **)&dst, bytes) != cudaSuccess) {
        cudaGetLastError();
        TD_INFO("cuda: no room to join %u weights of %zu bytes; they stay apart", k, bytes);
        return TD_OK;
    }
    size_t at = 0, r0 = 0;
    for (uint32_t i = 0; i < k; i++) {
        const size_t wb = (size_t)w[i]->rows * cols * esz;
        cudaError_t e = cudaMemcpyAsync(dst + at, w[i]->priv, wb, cudaMemcpyDeviceToDevice, c->stream);
        if (e == cudaSuccess && f8)
            e = cudaMemcpyAsync(dst + codes + r0 * 4, kc_fp8_scales(c, w[i]), (size_t)w[i]->rows * 4,
                                cudaMemcpyDeviceToDevice, c->stream);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess) {
            cudaFree(dst);
            return td_error(TD_ERR_INTERNAL, "cuda: joining weights failed: %s", cudaGetErrorString(e));
        }
        at += wb;
        r0 += w[i]->rows;
    }
    at = 0;
    for (uint32_t i = 0; i < k; i++) {
        cu_free(b, w[i]->priv);
        w[i]->priv = dst + at;
        at += (size_t)w[i]->rows * cols * esz;
    }
    c->joins[c->n_joins++] = kc_join_t{dst, bytes, k, f8 ? (uint32_t)rows : 0};
    return TD_OK;
}

static void *cu_queue(kern_backend_t *b) { return ((kern_cuda_t *)b)->stream; }

// ---- captured steps: a CUDA graph per key, replayed with one launch ----

void kc_graphs_drop(kern_cuda_t *c)
{
    for (uint32_t i = 0; i < c->n_graphs; i++)
        cudaGraphExecDestroy(c->graphs[i].exec);
    c->n_graphs = c->next_graph = 0;
}

static td_status_t cu_capture_begin(kern_backend_t *b)
{
    kc_bind(b);
    CU(cudaStreamBeginCapture(((kern_cuda_t *)b)->stream, cudaStreamCaptureModeThreadLocal));
    return TD_OK;
}

// Counts a captured step's edges, and of them the programmatic ones (the
// kernel after may start while the one before ends: stream capture keeps
// kc_launch's kind of dependency), into c->edges for tandem-cuda-check.
static void count_edges(kern_cuda_t *c, cudaGraph_t g)
{
    size_t n = 0;
    c->edges = (kc_edge_count_t){0, 0};
    if (cudaGraphGetEdges(g, NULL, NULL, NULL, &n) != cudaSuccess || !n) {
        cudaGetLastError();
        return;
    }
    cudaGraphNode_t *from = (cudaGraphNode_t *)malloc(n * sizeof *from);
    cudaGraphNode_t *to = (cudaGraphNode_t *)malloc(n * sizeof *to);
    cudaGraphEdgeData *ed = (cudaGraphEdgeData *)calloc(n, sizeof *ed);
    if (from && to && ed && cudaGraphGetEdges(g, from, to, ed, &n) == cudaSuccess) {
        c->edges.all = n;
        for (size_t i = 0; i < n; i++)
            c->edges.programmatic += ed[i].type == cudaGraphDependencyTypeProgrammatic;
    }
    cudaGetLastError();
    free(from), free(to), free(ed);
}

extern "C" void kern_cuda_graph_edges(kern_backend_t *b, size_t *all, size_t *programmatic)
{
    const kern_cuda_t *c = (const kern_cuda_t *)b;
    *all = c->edges.all, *programmatic = c->edges.programmatic;
}

static td_status_t cu_capture_end(kern_backend_t *b, uint64_t key, bool keep)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    cudaGetLastError(); // a capture that failed leaves its error; it is reported here, not at the next op
    if (e != cudaSuccess || !keep) {
        if (g)
            cudaGraphDestroy(g);
        return e == cudaSuccess ? TD_OK
                                : td_error(TD_ERR_INTERNAL, "cuda: capturing a step failed: %s", cudaGetErrorString(e));
    }
    count_edges(c, g);
    cudaGraphExec_t x = NULL;
    e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess)
        return td_error(TD_ERR_INTERNAL, "cuda: instantiating a captured step failed: %s", cudaGetErrorString(e));
    uint32_t i = 0;
    while (i < c->n_graphs && c->graphs[i].key != key)
        i++;
    if (i == c->n_graphs && c->n_graphs < KC_GRAPHS) {
        c->n_graphs++;
    } else {
        if (i == c->n_graphs) { // full: the oldest goes
            i = c->next_graph;
            c->next_graph = (c->next_graph + 1) % KC_GRAPHS;
        }
        cudaGraphExecDestroy(c->graphs[i].exec);
    }
    c->graphs[i].key = key;
    c->graphs[i].exec = x;
    return TD_OK;
}

static td_status_t cu_replay(kern_backend_t *b, uint64_t key)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    for (uint32_t i = 0; i < c->n_graphs; i++)
        if (c->graphs[i].key == key) {
            CU(cudaGraphLaunch(c->graphs[i].exec, c->stream));
            return TD_OK;
        }
    return TD_ERR_NOT_FOUND; /* an answer, not a failure (nothing logged): the caller captures the step again */
}

static td_status_t cu_device_id(kern_backend_t *b, char *out, size_t cap)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, c->device);
    if (e != cudaSuccess)
        return td_error(TD_ERR_UNSUPPORTED, "cuda: device %d: %s", c->device, cudaGetErrorString(e));
    const unsigned char *u = (const unsigned char *)p.uuid.bytes;
    snprintf(out, cap, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
             u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    return TD_OK;
}

static const kern_backend_ops_t kern_cuda_ops = {
    .name = "cuda",
    .supported = KERN_OPS_ALL | KERN_OPS_OPTIONAL,
    .kv_dtypes = (1u << TD_KV_F32) | (1u << TD_KV_F16) | (1u << TD_KV_F8_E4M3),
    .destroy = kern_cuda_backend_destroy,
    .device_id = cu_device_id,
    .alloc = cu_alloc,
    .free = cu_free,
    .upload = cu_upload,
    .download = cu_download,
    .host_alloc = cu_host_alloc,
    .host_free = cu_host_free,
    .copy = cu_copy,
    .sync = cu_sync,
    .queue = cu_queue,
    .kv_digest = kc_kv_digest,
    .weight_prepare = cu_weight_prepare,
    .weight_release = cu_weight_release,
    .weights_join = cu_weights_join,
    .matmul = kc_matmul,
    .matmul_multi = kc_matmul_multi,
    .rmsnorm = kc_rmsnorm,
    .rope = kc_rope,
    .swiglu = kc_swiglu,
    .add = kc_add,
    .embed = kc_embed,
    .kv_store = kc_kv_store,
    .attention = kc_attention,
    .matmul_fused = kc_matmul_fused,
    .rope_kv_store = kc_rope_kv_store,
    .rope_kv_attention = kc_rope_kv_attention,
    .weight_scale_cols = kc_weight_scale_cols,
    .sample = kc_sample,
    .capture_begin = cu_capture_begin,
    .capture_end = cu_capture_end,
    .replay = cu_replay,
    .capture_ctx_split = KC_DEC_KS_CTX,
};

// cuBLAS, once per process: the library CUDA 13 installs, by soname.
static kc_blas_api_t g_blas;
static const char *g_blas_error;
static void load_blas(void)
{
    void *h = dlopen("libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        g_blas_error = dlerror();
        return;
    }
    g_blas.create = (cublasStatus_t(*)(cublasHandle_t *))dlsym(h, "cublasCreate_v2");
    g_blas.destroy = (cublasStatus_t(*)(cublasHandle_t))dlsym(h, "cublasDestroy_v2");
    g_blas.set_stream = (cublasStatus_t(*)(cublasHandle_t, cudaStream_t))dlsym(h, "cublasSetStream_v2");
    g_blas.set_workspace = (cublasStatus_t(*)(cublasHandle_t, void *, size_t))dlsym(h, "cublasSetWorkspace_v2");
    *(void **)&g_blas.gemm_ex = dlsym(h, "cublasGemmEx");
    if (!g_blas.create || !g_blas.destroy || !g_blas.set_stream || !g_blas.set_workspace || !g_blas.gemm_ex)
        g_blas_error = "libcublas.so.13 lacks cublasCreate_v2, cublasSetStream_v2, cublasSetWorkspace_v2 or cublasGemmEx";
}

extern "C" td_status_t kern_cuda_backend_create(int device, kern_backend_t **out)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, load_blas);
    if (g_blas_error)
        return td_error(TD_ERR_UNSUPPORTED, "cuda: cannot load cuBLAS: %s", g_blas_error);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess)
        return td_error(TD_ERR_UNSUPPORTED, "cuda: no usable CUDA device: %s", cudaGetErrorString(e));
    if (device < 0 || device >= count)
        return td_error(TD_ERR_INVALID_ARG, "cuda: device %d does not exist (this machine has %d)", device, count);
    kern_cuda_t *c = (kern_cuda_t *)calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "cuda: no memory");
    c->base.ops = &kern_cuda_ops;
    c->device = device;
    c->blas_api = &g_blas;
    e = cudaSetDevice(device);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(c);
        return td_error(TD_ERR_UNSUPPORTED, "cuda: device %d: %s", device, cudaGetErrorString(e));
    }
    cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, device);
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    c->pdl = c->pdl_able = major >= 9;
    td_status_t rc = kc_attention_init(c);
    if (!rc)
        rc = kc_matmul_fused_init(c);
    if (!rc)
        rc = kc_fp8_init(c);
    if (!rc)
        rc = kc_fp8_gemm_init(c);
    if (!rc && (e = cudaMalloc(&c->blas_ws, KC_BLAS_WS)) != cudaSuccess)
        rc = td_error(TD_ERR_NO_MEMORY, "cuda: no device memory for cuBLAS's workspace: %s", cudaGetErrorString(e));
    if (!rc && (g_blas.create(&c->blas) != CUBLAS_STATUS_SUCCESS ||
                g_blas.set_stream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS ||
                g_blas.set_workspace(c->blas, c->blas_ws, KC_BLAS_WS) != CUBLAS_STATUS_SUCCESS))
        rc = td_error(TD_ERR_INTERNAL, "cuda: cublasCreate failed on device %d", device);
    if (rc) {
        if (c->blas)
            g_blas.destroy(c->blas);
        cudaFree(c->blas_ws);
        cudaStreamDestroy(c->stream);
        free(c);
        return rc;
    }
    *out = &c->base;
    return TD_OK;
}

extern "C" bool kern_cuda_set_qkv_half(kern_backend_t *b, bool on)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    const bool was = !c->qkv_fp32;
    c->qkv_fp32 = !on;
    return was;
}

extern "C" bool kern_cuda_set_pdl(kern_backend_t *b, bool on)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    cudaStreamSynchronize(c->stream);
    kc_graphs_drop(c);
    c->pdl = on && c->pdl_able;
    return c->pdl;
}

extern "C" uint32_t kern_cuda_set_prompt_attention(kern_backend_t *b, uint32_t variant)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    cudaStreamSynchronize(c->stream);
    kc_graphs_drop(c);
    return kc_attention_wg_pick(c, variant);
}

extern "C" void kern_cuda_backend_destroy(kern_backend_t *b)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    if (!c)
        return;
    cudaStreamSynchronize(c->stream);
    kc_graphs_drop(c);
    cudaFree(c->blas_ws);
    cudaFree(c->xh.p);
    cudaFree(c->qkvh.p);
    cudaFree(c->wh.p);
    cudaFree(c->x8.p);
    cudaFree(c->f8d.p);
    kc_fp8_gemm_destroy(c);
    cudaFree(c->ws.p);
    cudaFree(c->cnt.p);
    cudaFree(c->dg.p);
    for (uint32_t i = 0; i < c->n_joins; i++) // (weights not released by their owner)
        cudaFree(c->joins[i].base);
    free(c->joins);
    if (c->blas)
        c->blas_api->destroy(c->blas);
    cudaStreamDestroy(c->stream);
    free(c);
}
