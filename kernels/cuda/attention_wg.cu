// attention_wg.cu — prompt attention on Hopper's warpgroup MMA (wgmma, sm_90a; issue 51).
//
// Takes what attention.cu's k_attention_mma takes on other GPUs: prompt rows (16 or more a sequence) over fp16 KV,
// head_dim 64 or 128, with or without a cached prefix, pages looked up through the block table. There each warp
// held 16 query rows and took every K and V fragment out of shared memory with ldmatrix, a ldmatrix for every
// two mma.sync: shared memory's bandwidth bounded it at ~220 TFLOP/s on an H100 at a 4k prompt (bench/results/
// prefill-2026-12-06.md). Here a warpgroup (four warps) holds 64 rows and the tensor cores read K and V from
// shared memory themselves (wgmma's B operand), Q too for S = Q Kᵀ; P stays in registers as the A operand of
// O += P V. A block takes NW consumer warpgroups' rows (64 each, of one sequence and one query head); a tile is KT
// positions; S is m64n{KT}k16 over head_dim / 16 k-steps, P V m64n{head_dim}k16 over KT / 16.
//
// Shared memory holds each consumer's Q rows (fp16, scaled for exp2) and ST stages of a tile's K and V rows,
// gathered from the pages by cp.async by a producer warpgroup, up to ST tiles ahead; the consumers go at their own
// pace on mbarriers. A piece of R rows of head_dim halves is stored as head_dim / 64 column blocks
// of R rows x 128 bytes in the 128-byte swizzle the descriptors name (16-byte piece c of row r at c ^ (r mod 8)):
// K-major for Q and K (a k-step is 32 bytes into a row), MN-major for V (its rows are positions, the k of P V).
// The softmax is attention.cu's: fp32 scores in registers, base 2, a running max and sum a row, P rounded to fp16.
#include "kernels/cuda/attention_int.h"

// A variant's shape: warpgroups a block, positions a tile, stages of K and V
typedef struct wg_shape {
    uint32_t nw, kt, st; // consumer warpgroups (a producer beside them), positions a tile, stages
} wg_shape_t;

// Bytes of R rows of hd halves
__host__ __device__ constexpr uint32_t wg_piece(uint32_t rows, uint32_t hd) { return rows * hd * 2u; }

// The consumers' Q, then the stages of K and V and two mbarriers a stage; 1,024 bytes more to align the start
// (the swizzle's atoms are 1,024-byte aligned)
static size_t wg_smem(uint32_t hd, wg_shape_t v)
{
    return (size_t)v.nw * wg_piece(64, hd) + (size_t)2 * v.st * wg_piece(v.kt, hd) + 16 * v.st + 1024;
}

// Byte offset of 16-byte piece c of row r in a piece of R rows (its column block of 64 halves, the row, the
// piece's place XORed with the row's index mod 8)
template <uint32_t R> __device__ __forceinline__ uint32_t wg_off(uint32_t r, uint32_t c)
{
    return (c >> 3) * (R * 128u) + r * 128u + (((c & 7u) ^ (r & 7u)) << 4);
}

// A shared-memory matrix descriptor: start address, leading and stride byte offsets, the 128-byte swizzle. K-major
// (Q, K): the stride is 1,024 bytes from one 8-row group to the next (the leading offset unused); MN-major (V):
// the leading offset is from one column block to the next, the stride 1,024 from one group of 8 positions to the
// next.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3ffffu) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32 | 1ull << 62;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait(void) { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// What the thread wrote to shared memory (cp.async, plain stores) is seen by the tensor cores' reads
__device__ __forceinline__ void wg_fence_smem(void) { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Registers an asynchronous MMA reads or writes stay put around it: nothing the compiler moves past this point
template <int N> __device__ __forceinline__ void wg_hold(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}
template <int N> __device__ __forceinline__ void wg_hold_p(uint32_t (&pa)[N][4])
{
#pragma unroll
    for (int k = 0; k < N; k++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            asm volatile("" : "+r"(pa[k][i])::"memory");
}

// mbarriers in shared memory (k_attention_ws): init with the arrivals a phase takes, arrive, wait for the phase of
// a parity to complete
__device__ __forceinline__ void mb_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mb_wait(uint32_t bar, uint32_t parity)
{
    asm volatile("{\n.reg .pred p;\nWG_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WG_WAIT;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

// The accumulators of an MMA as its asm operands "+f"(d[0]).. and as its register list {%0, ..}: 32 or 64 of them
#define WG_F4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_F16(i) WG_F4(i), WG_F4(i + 4), WG_F4(i + 8), WG_F4(i + 12)
#define WG_D32 WG_F16(0), WG_F16(16)
#define WG_D64 WG_D32, WG_F16(32), WG_F16(48)
#define WG_R32                                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define WG_R64                                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "

// D (64 x 64, fp32: 32 a thread) = or += A (64 x 16 from shared memory, K-major) · B (16 x 64, K-major): S's k-step
__device__ __forceinline__ void wg_ss_n64(float (&d)[32], uint64_t da, uint64_t db, uint32_t acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 WG_R32
                 "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_D32
        : "l"(da), "l"(db), "r"(acc));
}

// D (64 x 128, fp32: 64 a thread) += A (64 x 16 from registers) · B (16 x 128 from shared memory, MN-major): P V's k-step
__device__ __forceinline__ void wg_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 WG_R64
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : WG_D64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// D (64 x 64, fp32: 32 a thread) += A (64 x 16 from registers) · B (16 x 64 from shared memory, MN-major): P V's k-step
__device__ __forceinline__ void wg_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 WG_R32
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : WG_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

template <int N> __device__ __forceinline__ void wg_ss(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t acc);
template <> __device__ __forceinline__ void wg_ss<64>(float (&d)[32], uint64_t da, uint64_t db, uint32_t acc)
{
    wg_ss_n64(d, da, db, acc);
}
template <int N> __device__ __forceinline__ void wg_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db);
template <> __device__ __forceinline__ void wg_rs<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t db)
{
    wg_rs_n64(d, a, db);
}
template <> __device__ __forceinline__ void wg_rs<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t db)
{
    wg_rs_n128(d, a, db);
}

// One tile of a warpgroup's rows: S = Q Kᵀ (Q and K at q_addr and k_addr), the softmax, O += P V (V at v_addr),
// each MMA waited for
template <int HD, int KT>
__device__ __forceinline__ void wg_tile(float (&o)[HD / 2], uint32_t q_addr, uint32_t k_addr, uint32_t v_addr,
                                        uint32_t p0, uint32_t warp_first, uint32_t pos_a, uint32_t t, float &m_a,
                                        float &m_b, float &l_a, float &l_b)
{
    // S = Q Kᵀ: a k-step is 16 dims, 32 bytes into a column block's rows
    float sc[KT / 2];
#pragma unroll
    for (int i = 0; i < KT / 2; i++)
        sc[i] = 0;
    wg_hold(sc);
    wg_fence();
#pragma unroll
    for (uint32_t kk = 0; kk < HD / 16; kk++)
        wg_ss<KT>(sc, wg_desc(q_addr + (kk >> 2) * (64u * 128u) + (kk & 3u) * 32u, 16, 1024),
                  wg_desc(k_addr + (kk >> 2) * (KT * 128u) + (kk & 3u) * 32u, 16, 1024), kk > 0);
    wg_commit();
    wg_wait();
    wg_hold(sc);
    float corr_a, corr_b;
    att_softmax<KT>(sc, p0, warp_first, pos_a, t, m_a, m_b, l_a, l_b, corr_a, corr_b);
#pragma unroll
    for (int i = 0; i < HD / 8; i++) {
        o[4 * i] *= corr_a, o[4 * i + 1] *= corr_a;
        o[4 * i + 2] *= corr_b, o[4 * i + 3] *= corr_b;
    }
    // P as the A operand of k-step kk (positions 16kk..16kk + 15): the scores' layout is the fragment's
    uint32_t pa[KT / 16][4];
#pragma unroll
    for (int kk = 0; kk < KT / 16; kk++) {
        pa[kk][0] = att_pack_half2(sc[8 * kk], sc[8 * kk + 1]);
        pa[kk][1] = att_pack_half2(sc[8 * kk + 2], sc[8 * kk + 3]);
        pa[kk][2] = att_pack_half2(sc[8 * kk + 4], sc[8 * kk + 5]);
        pa[kk][3] = att_pack_half2(sc[8 * kk + 6], sc[8 * kk + 7]);
    }
    // O += P V: a k-step is 16 positions, two groups of 8 rows (2,048 bytes) into V's column blocks
    wg_hold(o);
    wg_fence();
#pragma unroll
    for (uint32_t kk = 0; kk < KT / 16; kk++)
        wg_rs<HD>(o, pa[kk], wg_desc(v_addr + kk * 2048u, KT * 128u, 1024));
    wg_commit();
    wg_wait();
    wg_hold_p(pa);
    wg_hold(o);
}

// The warpgroup's 64 Q rows (from row r0 of sequence S, query head `head`), scaled for exp2 and rounded to fp16,
// into its piece at q (rows past the sequence repeat its last: their outputs are not written); wt: the thread's
// index in the warpgroup
template <int HD>
__device__ __forceinline__ void wg_load_q(uint8_t *q, const att_args_t &a, const att_seq_t &S, uint32_t r0,
                                          uint32_t head, uint32_t wt)
{
    constexpr uint32_t CH = HD / 8;
    const float qs = a.scale * 1.4426950408889634f;
    for (uint32_t i = wt; i < 64 * CH; i += 128) {
        const uint32_t r = i / CH, c = i % CH, row = min(r0 + r, S.n - 1);
        const size_t at = ((size_t)(S.row0 + row) * a.n_heads + head) * HD + c * 8;
        float4 x, y;
        if (a.qh) { // fp16 already (rope_kv_store's)
            const uint4 h = *(const uint4 *)(a.qh + at);
            const float2 h0 = __half22float2(*(const __half2 *)&h.x), h1 = __half22float2(*(const __half2 *)&h.y);
            const float2 h2 = __half22float2(*(const __half2 *)&h.z), h3 = __half22float2(*(const __half2 *)&h.w);
            x = make_float4(h0.x, h0.y, h1.x, h1.y), y = make_float4(h2.x, h2.y, h3.x, h3.y);
        } else {
            const float4 *src = (const float4 *)(a.q + at);
            x = src[0], y = src[1];
        }
        *(uint4 *)(q + wg_off<64>(r, c)) = make_uint4(att_pack_half2(x.x * qs, x.y * qs),
                                                      att_pack_half2(x.z * qs, x.w * qs),
                                                      att_pack_half2(y.x * qs, y.y * qs),
                                                      att_pack_half2(y.z * qs, y.w * qs));
    }
}

// The output rows of a warpgroup (its first row r0w of sequence S): O over each row's sum
template <int HD>
__device__ __forceinline__ void wg_store_o(const att_args_t &a, const att_seq_t &S, uint32_t r0w, uint32_t head,
                                           uint32_t warp, uint32_t g, uint32_t t, const float (&o)[HD / 2], float l_a,
                                           float l_b)
{
#pragma unroll
    for (int o2 = 1; o2 < 4; o2 <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, o2);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, o2);
    }
    const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
    const uint32_t ra = r0w + warp * 16 + g, rb = ra + 8;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        const uint32_t c = n * 8 + t * 2;
        const size_t ia = ((size_t)(S.row0 + ra) * a.n_heads + head) * HD + c;
        const size_t ib = ((size_t)(S.row0 + rb) * a.n_heads + head) * HD + c;
        const float2 va = make_float2(o[4 * n] * inv_a, o[4 * n + 1] * inv_a);
        const float2 vb = make_float2(o[4 * n + 2] * inv_b, o[4 * n + 3] * inv_b);
        if (ra < S.n) {
            if (a.out32)
                *(float2 *)(a.out + ia) = va;
            if (a.outh)
                *(__half2 *)(a.outh + ia) = __float22half2_rn(va);
        }
        if (rb < S.n) {
            if (a.out32)
                *(float2 *)(a.out + ib) = vb;
            if (a.outh)
                *(__half2 *)(a.outh + ib) = __float22half2_rn(vb);
        }
    }
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A consumer warpgroup of k_attention_ws: its Q rows, then every tile as the producer hands it over (each phase
// of the stages' barriers whole: a warpgroup past its last tile still waits and says it is done)
template <int HD, int NW, int KT, int ST>
__device__ __forceinline__ void wg_consume(const att_args_t &a, const att_seq_t &S, uint8_t *sm, uint32_t sm_addr,
                                           uint32_t bars, uint32_t r0, uint32_t rows, uint32_t head,
                                           uint32_t n_tiles, uint32_t wg, uint32_t wt, uint32_t warp, uint32_t g,
                                           uint32_t t)
{
    constexpr uint32_t QP = wg_piece(64, HD), TP = wg_piece(KT, HD);
    const uint32_t wr0 = wg * 64, wg_first = S.pos0 + r0 + wr0; // the warpgroup's first row in the block, its position
    const uint32_t warp_first = wg_first + warp * 16, pos_a = warp_first + g;
    const bool wg_live = wr0 < rows;
    const uint32_t wg_tiles = wg_live ? min(n_tiles, (wg_first + 63) / KT + 1) : 0; // causal: the first ones
    wg_load_q<HD>(sm + wg * QP, a, S, r0 + wr0, head, wt);
    wg_fence_smem();
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory"); // the warpgroup's Q is stored
    const uint32_t q_addr = sm_addr + wg * QP;
    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++)
        o[i] = 0;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0, l_b = 0;
    for (uint32_t it = 0; it < n_tiles; it++) {
        const uint32_t st = it % ST;
        mb_wait(bars + 8 * st, (it / ST) & 1);
        if (it < wg_tiles) {
            const uint32_t k_addr = sm_addr + NW * QP + 2 * st * TP;
            wg_tile<HD, KT>(o, q_addr, k_addr, k_addr + TP, it * KT, warp_first, pos_a, t, m_a, m_b, l_a, l_b);
        }
        mb_arrive(bars + 8 * (ST + st));
    }
    if (wg_live)
        wg_store_o<HD>(a, S, r0 + wr0, head, warp, g, t, o, l_a, l_b);
}
#endif

// The kernel: warpgroup NW (the last), the producer, gathers each tile's K and V into ST stages and says it landed
// on the stage's mbarrier (full), each consumer warpgroup (0..NW-1) says it is done with the stage on another
// (empty). No block barrier in the loop: each consumer goes at its own pace, its softmax beside the other's MMAs
// (flash-attention 3's producer and consumers, with cp.async for the copy engine: a tile's rows are on pages).
template <int HD, int NW, int KT, int ST>
__global__ void __launch_bounds__(128 * (NW + 1), 1) k_attention_ws(const att_args_t a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr uint32_t QP = wg_piece(64, HD), TP = wg_piece(KT, HD); // a warpgroup's Q, a tile's K (or V)
    constexpr uint32_t CH = HD / 8, ROWS = 64 * NW;                   // CH: a row's 16-byte pieces
    extern __shared__ uint8_t wg_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(wg_raw), pad = (1024u - (raw & 1023u)) & 1023u;
    uint8_t *sm = wg_raw + pad; // warpgroup w's Q at w * QP; stage s's K at NW * QP + 2s * TP, its V a TP on
    const uint32_t sm_addr = raw + pad, bars = sm_addr + NW * QP + 2 * ST * TP; // full[ST], then empty[ST]
    kc_pdl_wait();
    kc_pdl_release();
    const uint32_t tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
    const uint32_t g = lane >> 2, t = lane & 3;
    const uint32_t bx = gridDim.x - 1 - blockIdx.x; // the last rows (the longest walks) first
    uint32_t s = 0;
    while (s + 1 < a.n_seqs && a.seq[s + 1].tile0 <= bx)
        s++;
    const att_seq_t S = a.seq[s];
    const uint32_t r0 = (bx - S.tile0) * ROWS, rows = min(ROWS, S.n - r0);
    const uint32_t head = blockIdx.y, kvh = head / a.group;
    const uint32_t last = S.pos0 + r0 + rows - 1, n_tiles = last / KT + 1;
    if (tid == 0)
        for (uint32_t i = 0; i < ST; i++)
            mb_init(bars + 8 * i, 128), mb_init(bars + 8 * (ST + i), 128 * NW);
    __syncthreads();
    if (wg == NW) { // the producer: thread wt takes piece wt % CH of rows wt / CH + m * JSTEP of each tile
        constexpr uint32_t JSTEP = 128 / CH, PER = KT / JSTEP;
        const uint32_t jt = wt / CH, ct = wt % CH;
        const uint32_t bt_shift = __ffs(a.bt) - 1, bt_mask = a.bt - 1; // block_tokens is a power of two
        const size_t k_off = att_rows(a, 0, kvh), v_off = att_rows(a, 1, kvh);
        for (uint32_t j = 0; j < n_tiles; j++) {
            const uint32_t st = j % ST;
            if (j >= ST) // the consumers are done with the stage's last tile
                mb_wait(bars + 8 * (ST + st), (j / ST - 1) & 1);
            uint8_t *kb = sm + NW * QP + 2 * st * TP, *vb = kb + TP;
#pragma unroll
            for (uint32_t m = 0; m < PER; m++) {
                const uint32_t r = jt + m * JSTEP, pos = j * KT + r;
                const bool ok = pos <= last;
                const __half *blk = (const __half *)(a.base + (size_t)(ok ? S.table[pos >> bt_shift] : 0) * a.block_bytes);
                const size_t o8 = ok ? (size_t)(pos & bt_mask) * HD + ct * 8 : 0;
                const uint32_t at = wg_off<KT>(r, ct);
                cp_async16(kb + at, ok ? blk + k_off + o8 : blk, ok);
                cp_async16(vb + at, ok ? blk + v_off + o8 : blk, ok);
            }
            cp_async_commit();
            if (j > 0) { // the tile before has landed (this thread's part): seen by the tensor cores, then said
                cp_async_wait<1>();
                wg_fence_smem();
                mb_arrive(bars + 8 * ((j - 1) % ST));
            }
        }
        cp_async_wait<0>();
        wg_fence_smem();
        mb_arrive(bars + 8 * ((n_tiles - 1) % ST));
    } else {
        wg_consume<HD, NW, KT, ST>(a, S, sm, sm_addr, bars, r0, rows, head, n_tiles, wg, wt, warp, g, t);
    }
#endif
}

// The variants one build holds; TANDEM_CUDA_WGMMA picks one by its number (1 the first), WG_DEFAULT's without it.
// On an H100 (bench/results/prefill-2026-12-06.md) three stages were as fast as four, 10-14% faster than the best
// kernel whose threads all load and meet at block barriers (two warpgroups over 128-position tiles; it and its
// other shapes are taken out) and 1.5x the mma.sync kernel; beside a producer, tiles of 128 positions (the
// consumers given 232 registers by setmaxnreg) were 15% slower.
static const wg_shape_t wg_shapes[] = {{2, 64, 3}, {2, 64, 4}};
#define WG_DEFAULT 1
#define WG_NSHAPES (sizeof wg_shapes / sizeof *wg_shapes)
typedef void (*wg_fn_t)(att_args_t);
template <int HD> static wg_fn_t wg_kernel_hd(uint32_t i)
{
    static const wg_fn_t k[WG_NSHAPES] = {k_attention_ws<HD, 2, 64, 3>, k_attention_ws<HD, 2, 64, 4>};
    return k[i];
}
static wg_fn_t wg_kernel(uint32_t hd, uint32_t i) { return hd == 64 ? wg_kernel_hd<64>(i) : wg_kernel_hd<128>(i); }

// Whether the device runs sm_90a's instructions (compute capability 9.0 alone)
static bool wg_able(const kern_cuda_t *c)
{
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, c->device);
    return major == 9 && minor == 0;
}

td_status_t kc_attention_wg_init(kern_cuda_t *c)
{
    // TANDEM_CUDA_WGMMA (to measure one kernel against another in one build): 0 keeps the mma.sync kernel, 1.. the
    // variant of that number
    const char *env = getenv("TANDEM_CUDA_WGMMA");
    const bool set = env && *env >= '0' && *env <= '0' + (int)WG_NSHAPES && !env[1];
    if (env && !set)
        TD_WARN("cuda: TANDEM_CUDA_WGMMA=%s is none of 0..%u: the prompt attention keeps its default (%u)", env,
                (unsigned)WG_NSHAPES, (unsigned)WG_DEFAULT);
    const int pick = set ? *env - '0' : WG_DEFAULT;
    const bool able = wg_able(c);
    c->wg_shape = able ? (uint32_t)pick : 0;
    for (uint32_t i = 0; i < WG_NSHAPES && able; i++)
        for (uint32_t hd = 64; hd <= 128; hd *= 2)
            CU(cudaFuncSetAttribute(wg_kernel(hd, i), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)wg_smem(hd, wg_shapes[i])));
    return TD_OK;
}

uint32_t kc_attention_wg_pick(kern_cuda_t *c, uint32_t variant)
{
    const uint32_t was = c->wg_shape;
    c->wg_shape = wg_able(c) && variant <= WG_NSHAPES ? variant : 0;
    return was;
}

uint32_t kc_attention_wg_rows(const kern_cuda_t *c, const td_kv_layout_t *g)
{
    return c->wg_shape && g->dtype == TD_KV_F16 && (g->head_dim == 64 || g->head_dim == 128)
               ? 64 * wg_shapes[c->wg_shape - 1].nw
               : 0;
}

td_status_t kc_attention_wg(kern_cuda_t *c, const att_args_t &a, uint32_t hd, uint32_t tiles, uint32_t n_heads)
{
    const wg_shape_t v = wg_shapes[c->wg_shape - 1];
    return kc_launch(c, "attention_wg", wg_kernel(hd, c->wg_shape - 1), dim3(tiles, n_heads),
                     dim3(128 * (v.nw + 1)), wg_smem(hd, v), a);
}
