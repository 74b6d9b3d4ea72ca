/* Paged prefill attention in bf16 products: one prefill chunk of a request, bf16 K and V read out
   of the pool's page records, queries rounded to bf16, every product summed in fp32, the softmax in
   fp32 on AVX-512, the probabilities rounded to bf16 for the P V product - the numbers of torch's
   bf16 flash attention (scaled_dot_product_attention) and of vLLM-CPU's bf16 attention, up to
   rounding order. The products run on AMX tiles (TDPBF16PS) where the CPU has them and the OS grants
   them, else on AVX512-BF16's VDPBF16PS (a CPU with bf16 dot products and no tiles: an AMD EPYC of
   the Zen 4 kind), the same tile-shaped blocks held in 16 vector registers (dp_tile below).

   Chunk: ql query tokens at positions n - ql .. n - 1 of a request of n keys (lower-right causal:
   query i reads keys 0 .. n - ql + i); a chunk that starts the request is the square causal case.

   1. Pack (OpenMP over KV head x 32-key block): each KV head's K rows into one contiguous [keys, D]
      bf16 block (a tile's 16 rows read at one stride) and V transposed, [D, keys] (the tiles' A
      operand for V^T); keys past n zero. O(n D): the products are O(n^2 D).
   2. Tasks (OpenMP, dynamic, the costliest query blocks first): one query head x 16 query rows,
      keys 64 at a time (flash attention: a running max and sum per row, the output rescaled per
      block). Everything is computed transposed - S^T = K Q^T, O^T = V^T P^T - so that a vector of
      16 lanes holds the 16 query rows: the softmax's masks, maxima, sums and rescaling are vertical
      (no horizontal reductions, no per-row scalars), and P^T's bf16 rows go straight into the B
      operand (pairs of keys interleaved). Blocks wholly past a block's last query are not computed.
      e^x is 2^(x log2 e) by a degree-4 polynomial: the probabilities are rounded to bf16 for P V.
      Measured: bench/prefill_attention.py (README; on tiles 1.7-2.4x torch's SDPA on the same bf16
      pages on the 2-core AMX machine of 2026-12-05). Subnormal probabilities are flushed to zero on
      the kernel's threads (each would cost a microcode assist); MXCSR and the tile configuration are
      put back after.

   Returns -1 (nothing written: the caller's torch path runs) where the build has no AVX512-BF16 (nor
   AMX), or the shape is not one it takes (head_dim a multiple of 32, at most 256); 1 when a scratch
   allocation failed. The _dp exports never use the tiles (tests and benches compare the two). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"

/* the exported kernels' parameter list (the C ABI engine/kernels/__init__.py declares), and its names
   after q */
#define PREFILL_PARAMS(q_t, kv_t)                                                                              \
    const q_t *q, int64_t q_tok_stride, int64_t ql, int64_t n, const kv_t *kv, const int64_t *pages, int64_t S, \
    int64_t Hq, int64_t Hkv, int64_t D, int64_t page_stride, int64_t rec_stride, int64_t k_off, int64_t v_off,  \
    float scale, float *out, int64_t out_tok_stride, int nthreads
#define PREFILL_ARGS q_tok_stride, ql, n, kv, pages, S, Hq, Hkv, D, page_stride, rec_stride, k_off, v_off, scale, \
    out, out_tok_stride, nthreads

/* a kernel this build cannot run (no AVX512-BF16; no AVX-512 and no AVX2 with FMA): -1, nothing written */
#define DECLINED(name, q_t, kv_t)                                                                             \
    int name(PREFILL_PARAMS(q_t, kv_t)) {                                                                    \
        (void)q; (void)q_tok_stride; (void)ql; (void)n; (void)kv; (void)pages; (void)S; (void)Hq; (void)Hkv;   \
        (void)D; (void)page_stride; (void)rec_stride; (void)k_off; (void)v_off; (void)scale; (void)out;       \
        (void)out_tok_stride; (void)nthreads;                                                                 \
        return -1;                                                                                            \
    }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#define KVL_TILES 1
#endif

#define QB 16           /* query rows a task */
#define KB 64           /* keys a block */
#define DMAXP 256

#ifdef KVL_TILES
/* eight 16 x 64-byte tiles (amx.h: the thread's configuration before is put back by tiles_off) */
static void tiles_on(tile_config *saved) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    tiles_set(saved, rows);
}
#endif

/* c (16 rows of 16 fp32, in registers) += A B, as TDPBF16PS computes a tile's product: A 16 rows of
   ``pairs`` bf16 pairs (row m at a + m as, elements), B ``pairs`` rows of 16 pairs (64 bytes a row,
   the tiles' B layout). Row m's pair p broadcast against B's row p: VDPBF16PS sums both products of
   each lane's pair into it in fp32 (16 independent accumulators: VDPBF16PS's latency hidden). */
static inline __attribute__((always_inline)) void dp_tile(__m512 c[QB], const uint16_t *a, int64_t as,
                                                          const uint32_t *b, int64_t pairs) {
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh bv = (__m512bh)_mm512_load_si512(b + p * QB);
#pragma GCC unroll 16
        for (int m = 0; m < QB; m++) {
            uint32_t u;
            memcpy(&u, a + m * as + 2 * p, 4);
            c[m] = _mm512_dpbf16_ps(c[m], (__m512bh)_mm512_set1_epi32((int)u), bv);
        }
    }
}

/* 2^t, 16 lanes, for t <= 0 (t = (score - max) scale log2(e)): t = n + f, |f| <= 1/2, 2^f by a
   degree-4 polynomial fitted for the least largest relative error on [-1/2, 1/2] (2.7e-6 in fp32, as
   the degree-5 Taylor polynomial it replaced, 3e-6: the probabilities are rounded to bf16, 2^-9, for
   the product; one FMA less a probability, the kernel 3 % faster on a 3000-token prompt, measured
   build against build), 2^n put in by scalef (0 far below the smallest float: a masked score
   is -1e30, never -inf, so that no lane computes -inf - -inf) */
static inline __attribute__((always_inline)) __m512 exp2_16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.570102207362652e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591786280274391e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443318367e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217908859253e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847442627e-1f));
    return _mm512_scalef_ps(p, n);
}

#define MASKED (-1e30f)

/* the K row and V row of key i of KV head h (element offsets into the pool, stored elements) */
static inline const uint16_t *kv_row(const uint16_t *kv, const int64_t *pages, int64_t i, int64_t S, int64_t h,
                                     int64_t D, int64_t page_stride, int64_t rec_stride, int64_t off) {
    return kv + pages[i / S] * page_stride + (i % S) * rec_stride + h * D + off;
}

/* q: fp32 rows rounded to bf16 here, or (q_bf16) bf16 rows as they are - the same numbers where those
   were rounded from the same fp32 (kvl_rope_bf16) */
static inline __attribute__((always_inline)) int prefill_bf16(const void *q, int q_bf16, int64_t q_tok_stride,
        int64_t ql, int64_t n, const uint16_t *kv, const int64_t *pages, int64_t S, int64_t Hq, int64_t Hkv,
        int64_t D, int64_t page_stride, int64_t rec_stride, int64_t k_off, int64_t v_off, float scale,
        float *out, int64_t out_tok_stride, int nthreads, const int tiles) {
    if (D % 32 || D > DMAXP || ql < 1 || n < ql || Hq % Hkv) return -1;
    const int64_t G = Hq / Hkv, np = (n + KB - 1) / KB * KB, P = D / 2;   /* P: 32-bit pairs a row */
    const int64_t ns = D / 32;     /* 32-value slices a row (a tile's width) */
    (void)ns;
    (void)tiles;
    uint16_t *kc = aligned_alloc(64, sizeof(uint16_t) * Hkv * np * D);    /* [Hkv][np][D] */
    uint16_t *vt = aligned_alloc(64, sizeof(uint16_t) * Hkv * np * D);    /* [Hkv][D][np] */
    if (!kc || !vt) {
        free(kc);
        free(vt);
        return 1;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < Hkv * (np / 32); t++) {
        const int64_t h = t / (np / 32), i0 = t % (np / 32) * 32;
        uint16_t *vh = vt + h * D * np;
        for (int64_t i = i0; i < i0 + 32; i++) {
            uint16_t *kr = kc + (h * np + i) * D;
            if (i >= n) {
                memset(kr, 0, sizeof(uint16_t) * D);
                for (int64_t d = 0; d < D; d++) vh[d * np + i] = 0;
                continue;
            }
            memcpy(kr, kv_row(kv, pages, i, S, h, D, page_stride, rec_stride, k_off), sizeof(uint16_t) * D);
            const uint16_t *vr = kv_row(kv, pages, i, S, h, D, page_stride, rec_stride, v_off);
            for (int64_t d = 0; d < D; d++) vh[d * np + i] = vr[d];
        }
    }
    const int64_t nqb = (ql + QB - 1) / QB, first = n - ql;    /* position of query row 0 */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* interleave two rows of 16 bf16 (key 2k in the low half of each 32-bit pair, key 2k + 1 high) */
    const __m512i zip = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                          0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                          0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
#pragma omp parallel num_threads(nthreads)
    {
#ifdef KVL_TILES
        tile_config saved;
        if (tiles) tiles_on(&saved);
#endif
        /* probabilities far below a row's maximum (2^-126 .. 2^-149) are subnormal: without
           flush-to-zero each costs a microcode assist (7x the whole kernel on a real model's
           scores, where random test data has none); this thread's MXCSR is put back after */
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);       /* FTZ | DAZ */
        uint32_t qt[DMAXP / 2 * QB] __attribute__((aligned(64)));   /* Q^T as B tiles: [D / 32][16 pairs][16 rows] */
        uint32_t pt[KB / 2 * QB] __attribute__((aligned(64)));      /* P^T as B tiles: [32 key pairs][16 rows] */
        float st[KB * QB] __attribute__((aligned(64)));             /* S^T [64 keys][16 rows], then O^T parts */
        float acc[DMAXP * QB] __attribute__((aligned(64)));         /* O^T [D][16 rows] */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < Hq * nqb; t++) {
            const int64_t qb = nqb - 1 - t / Hq, hq = t % Hq, h = hq / G;
            const int64_t r0 = qb * QB, rows = ql - r0 < QB ? ql - r0 : QB;
            for (int64_t m = 0; m < QB; m++) {
                uint16_t row[DMAXP] __attribute__((aligned(64)));
                if (m < rows && q_bf16) {
                    memcpy(row, (const uint16_t *)q + (r0 + m) * q_tok_stride + hq * D, sizeof(uint16_t) * D);
                } else if (m < rows) {
                    const float *src = (const float *)q + (r0 + m) * q_tok_stride + hq * D;
                    for (int64_t d = 0; d < D; d += 16)
                        _mm256_store_si256((__m256i *)(row + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d)));
                } else {
                    memset(row, 0, sizeof(uint16_t) * D);
                }
                for (int64_t p = 0; p < P; p++) {
                    uint32_t u;
                    memcpy(&u, row + 2 * p, 4);
                    qt[p * QB + m] = u;             /* tile p / 16, row p % 16, column m */
                }
            }
            /* keys row m reads: 0 .. lim[m] - 1 (rows past the chunk: its last row's) */
            const __m512i lim = _mm512_add_epi32(_mm512_set1_epi32((int)(first + r0 + 1)),
                                                 _mm512_min_epi32(lane, _mm512_set1_epi32((int)rows - 1)));
            const int64_t keys = first + r0 + rows, lo = first + r0 + 1;
            __m512 mx = _mm512_set1_ps(MASKED), sum = _mm512_setzero_ps();
            memset(acc, 0, sizeof(float) * QB * D);
            const uint16_t *kh = kc + h * np * D, *vh = vt + h * D * np;
            const __m512 sc = _mm512_set1_ps(scale * 1.44269504088896341f);   /* scale log2(e) */
            for (int64_t k0 = 0; k0 < keys; k0 += KB) {
                /* S^T = K Q^T: four tiles of 16 keys x 16 rows */
#ifdef KVL_TILES
                if (tiles) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t s = 0; s < ns; s++) {
                        const uint16_t *ks = kh + k0 * D + s * 32;
                        _tile_loadd(4, qt + s * 256, 64);
                        _tile_loadd(6, ks, D * 2);
                        _tile_dpbf16ps(0, 6, 4);
                        _tile_loadd(7, ks + 16 * D, D * 2);
                        _tile_dpbf16ps(1, 7, 4);
                        _tile_loadd(6, ks + 32 * D, D * 2);
                        _tile_dpbf16ps(2, 6, 4);
                        _tile_loadd(7, ks + 48 * D, D * 2);
                        _tile_dpbf16ps(3, 7, 4);
                    }
                    _tile_stored(0, st, 64);
                    _tile_stored(1, st + 256, 64);
                    _tile_stored(2, st + 512, 64);
                    _tile_stored(3, st + 768, 64);
                } else
#endif
                    for (int64_t g = 0; g < KB; g += 16) {
                        __m512 c[QB];
                        for (int m = 0; m < QB; m++) c[m] = _mm512_setzero_ps();
                        dp_tile(c, kh + (k0 + g) * D, D, qt, P);
                        for (int m = 0; m < QB; m++) _mm512_store_ps(st + (g + m) * QB, c[m]);
                    }
                /* the softmax, 16 rows a vector: masks, max and sums without horizontal reductions */
                __m512 bm = mx;
                if (k0 + KB > lo) {                 /* the block crosses some row's last key */
                    for (int64_t j = 0; j < KB; j++) {
                        const __mmask16 ok = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32((int)(k0 + j)));
                        const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(MASKED), ok,
                                                            _mm512_load_ps(st + j * QB));
                        _mm512_store_ps(st + j * QB, v);
                        bm = _mm512_max_ps(bm, v);
                    }
                } else {
                    for (int64_t j = 0; j < KB; j++) bm = _mm512_max_ps(bm, _mm512_load_ps(st + j * QB));
                }
                const __m512 alpha = exp2_16(_mm512_mul_ps(_mm512_sub_ps(mx, bm), sc));
                mx = bm;
                const __m512 ms = _mm512_mul_ps(bm, sc);
                __m512 tot0 = _mm512_setzero_ps(), tot1 = _mm512_setzero_ps();
                for (int64_t j = 0; j < KB; j += 2) {
                    const __m512 p0 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(st + j * QB), sc, ms));
                    const __m512 p1 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(st + (j + 1) * QB), sc, ms));
                    tot0 = _mm512_add_ps(tot0, p0);
                    tot1 = _mm512_add_ps(tot1, p1);
                    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);   /* p0 low half, p1 high */
                    _mm512_store_si512(pt + (j / 2) * QB, _mm512_permutexvar_epi16(zip, both));
                }
                sum = _mm512_fmadd_ps(sum, alpha, _mm512_add_ps(tot0, tot1));
                /* O^T += V^T P^T, 64 head dims (four tiles of 16 dims x 16 rows) at a time */
#ifdef KVL_TILES
                if (tiles) {
                    _tile_loadd(4, pt, 64);
                    _tile_loadd(5, pt + 256, 64);
                    for (int64_t d0 = 0; d0 < D; d0 += 64) {
                        const int64_t dn = D - d0 < 64 ? D - d0 : 64;
                        const uint16_t *va = vh + d0 * np + k0;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_loadd(6, va, np * 2);
                        _tile_dpbf16ps(0, 6, 4);
                        _tile_loadd(7, va + 32, np * 2);
                        _tile_dpbf16ps(0, 7, 5);
                        _tile_loadd(6, va + 16 * np, np * 2);
                        _tile_dpbf16ps(1, 6, 4);
                        _tile_loadd(7, va + 16 * np + 32, np * 2);
                        _tile_dpbf16ps(1, 7, 5);
                        if (dn > 32) {
                            _tile_zero(2);
                            _tile_zero(3);
                            _tile_loadd(6, va + 32 * np, np * 2);
                            _tile_dpbf16ps(2, 6, 4);
                            _tile_loadd(7, va + 32 * np + 32, np * 2);
                            _tile_dpbf16ps(2, 7, 5);
                            _tile_loadd(6, va + 48 * np, np * 2);
                            _tile_dpbf16ps(3, 6, 4);
                            _tile_loadd(7, va + 48 * np + 32, np * 2);
                            _tile_dpbf16ps(3, 7, 5);
                        }
                        _tile_stored(0, st, 64);
                        _tile_stored(1, st + 256, 64);
                        if (dn > 32) {
                            _tile_stored(2, st + 512, 64);
                            _tile_stored(3, st + 768, 64);
                        }
                        float *a = acc + d0 * QB;
                        for (int64_t d = 0; d < dn; d++)
                            _mm512_store_ps(a + d * QB, _mm512_fmadd_ps(_mm512_load_ps(a + d * QB), alpha,
                                                                        _mm512_load_ps(st + d * QB)));
                    }
                    continue;
                }
#endif
                for (int64_t d0 = 0; d0 < D; d0 += 16) {    /* 16 dims x 16 rows in registers */
                    __m512 c[QB];
                    for (int m = 0; m < QB; m++) c[m] = _mm512_setzero_ps();
                    dp_tile(c, vh + d0 * np + k0, np, pt, KB / 2);
                    float *a = acc + d0 * QB;
                    for (int m = 0; m < QB; m++)
                        _mm512_store_ps(a + m * QB, _mm512_fmadd_ps(_mm512_load_ps(a + m * QB), alpha, c[m]));
                }
            }
            float inv[QB] __attribute__((aligned(64)));
            _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
            for (int64_t m = 0; m < rows; m++) {
                float *o = out + (r0 + m) * out_tok_stride + hq * D;
                for (int64_t d = 0; d < D; d++) o[d] = acc[d * QB + m] * inv[m];
            }
        }
        _mm_setcsr(csr);
#ifdef KVL_TILES
        if (tiles) tiles_off(&saved);
#endif
    }
    free(kc);
    free(vt);
    return 0;
}

#ifdef KVL_TILES
#define ON_TILES amx_granted()
#else
#define ON_TILES 0
#endif

/* 1 where kvl_paged_prefill_bf16 runs on AMX tiles (built for them, granted by the kernel) */
int kvl_prefill_tiles(void) { return ON_TILES; }

/* on the tiles where they run, else on VDPBF16PS; the _dp kernels on VDPBF16PS always */
int kvl_paged_prefill_bf16(PREFILL_PARAMS(float, uint16_t)) {
    return ON_TILES ? prefill_bf16(q, 0, PREFILL_ARGS, 1) : prefill_bf16(q, 0, PREFILL_ARGS, 0);
}

int kvl_paged_prefill_bf16q(PREFILL_PARAMS(uint16_t, uint16_t)) {
    return ON_TILES ? prefill_bf16(q, 1, PREFILL_ARGS, 1) : prefill_bf16(q, 1, PREFILL_ARGS, 0);
}

int kvl_paged_prefill_bf16_dp(PREFILL_PARAMS(float, uint16_t)) { return prefill_bf16(q, 0, PREFILL_ARGS, 0); }

int kvl_paged_prefill_bf16q_dp(PREFILL_PARAMS(uint16_t, uint16_t)) { return prefill_bf16(q, 1, PREFILL_ARGS, 0); }

#else

DECLINED(kvl_paged_prefill_bf16, float, uint16_t)     /* no bf16 products in this build: the caller's torch path */
DECLINED(kvl_paged_prefill_bf16q, uint16_t, uint16_t)
DECLINED(kvl_paged_prefill_bf16_dp, float, uint16_t)
DECLINED(kvl_paged_prefill_bf16q_dp, uint16_t, uint16_t)
int kvl_prefill_tiles(void) { return 0; }

#endif

/* kvl_paged_prefill_f32: one prefill chunk's attention over an fp32 pool, every product and sum in
   fp32 (vLLM-CPU's "vec" attention on an fp32 cache does the same). torch's SDPA needs the chunk's
   pages gathered first and, where the chunk continues a request, a mask tensor (its masked path ran
   at three quarters of its causal one in the engine). Flash attention on AVX-512 FMAs (or AVX2's:
   vectors of 8 lanes, fewer registers, smaller blocks), transposed
   for the scores as the AMX kernel above: a task is one query head x RB query rows (NV vectors of
   VLF lanes, a lane a row); S^T = K Q^T KS keys at a time in NV KS accumulators (each key's value
   broadcast against the rows' vectors), the mask, the block's maxima, the softmax and the sums all
   vertical (no horizontal reductions); then O = alpha O + P V, RR rows x DV vectors of head dims a
   register block (each V row loaded once, each probability broadcast).
   First each KV head's K and V rows are packed contiguous ([keys, D], O(n D) against the O(n^2 D)
   products): read in place from the records, a key's row is a whole record from the next (every
   layer's K and V: 4 KB on the long bench model), and the same kernel ran 1.3x slower so. e^x is
   vexp.h's (within 2 ulp of expf); keys past the request are zeros, masked (a page's unused slots
   may hold anything: never read). Measured: bench/prefill_attention.py.
   Returns -1 (nothing written: the caller's SDPA runs) where the build has neither AVX-512 nor AVX2
   with FMA, or head_dim is not a multiple of the vector's lanes (16; 8 on AVX2) or above 256; 1 when a scratch allocation failed. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#if defined(__AVX512F__)
/* register blocks: NV vectors of query rows x KS keys of scores; RR query rows x DV (at most DVMAX)
   vectors of head dims of P V - 16 accumulators of the 32 AVX-512 registers (48 rows a task measured
   no faster on a 3000-token prompt and 10 % slower on a 600-token one) */
#define VLF 16
#define VMAX(a, b) ((vf)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define NV 2
#define KS 8
#define RR 4
#define DVMAX 4
#else
/* AVX2 + FMA (16 registers of 8 lanes): NV x KS = 3 x 4 score accumulators beside 3 query vectors
   and a broadcast key value, 24 query rows a task; P V in RR x DVMAX = 6 x 2 accumulators. On an AMD
   EPYC (bench/prefill_attention.py, the same run's SDPA as yardstick) 1.1-2.5x SDPA; 2 x 4 and 4 x 2
   blocks (16 rows) ran at 0.9-2.1x */
#define VLF 8
#define VMAX(a, b) ((vf)_mm256_max_ps((__m256)(a), (__m256)(b)))
#define NV 3
#define KS 4
#define RR 6
#define DVMAX 2
#endif
#define RB (NV * VLF)       /* query rows a task */
#define KBF 64              /* keys a softmax block */
#define DMAXF 256
#define MASKED_F (-1e30f)   /* a masked score: e^((MASKED_F - max) scale) is 0, never -inf - -inf */

typedef float vf __attribute__((vector_size(VLF * 4)));
typedef int32_t vi __attribute__((vector_size(VLF * 4)));
static inline __attribute__((always_inline)) vf ldv(const float *p) { vf r; __builtin_memcpy(&r, p, sizeof r); return r; }
static inline __attribute__((always_inline)) void stv(float *p, vf a) { __builtin_memcpy(p, &a, sizeof a); }

/* vexp.h's e^y on a vector, for y <= 0 (a score minus its row's maximum, scaled): 0 below -87.3 */
static inline __attribute__((always_inline)) vf vexp_neg(vf y) {
    const vi under = y < -87.3f;
    const vf c = (vf)((vi)y & ~under) + (vf)((vi)(y - y - 87.3f) & under);
    const float big = 12582912.f;
    const vf nb = c * 1.44269504088896341f + big;
    const vf n = nb - big;
    vf r = c - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const vi bits = ((vi)nb - (0x4B400000 - 127)) << 23;     /* n + 127 in the exponent */
    return (vf)((vi)(p * (vf)bits) & ~under);
}

/* acc [RB][D] = als[m] acc + P V over the block's kn keys: RR rows x DV vectors of head dims a
   register block, each key's V row loaded once a block, each row's probability (P^T, st) broadcast.
   The V row is pinned in registers (an empty asm): GCC 12 -O3 made each FMA load its V vector from
   memory, a 64-byte load per FMA, and P V ran at ~3/4 of the FMAs' rate (the long bench's 3000-token
   prompt, 2 threads on an AMD EPYC Zen 4: 27.3 -> 24.7 ms, 169 -> 187 GFLOP/s, a one-off A/B) */
static inline __attribute__((always_inline)) void pv_block(float *acc, const float *st, const float *als,
                                                           const float *vb, int64_t kn, int64_t D,
                                                           const int DV) {
    for (int64_t m0 = 0; m0 < RB; m0 += RR)
        for (int64_t d0 = 0; d0 < D; d0 += DV * VLF) {
            vf a[RR][DVMAX];
#pragma GCC unroll 8
            for (int r = 0; r < RR; r++)
#pragma GCC unroll 4
                for (int v = 0; v < DV; v++) a[r][v] = ldv(acc + (m0 + r) * D + d0 + v * VLF) * als[m0 + r];
            for (int64_t j = 0; j < kn; j++) {
                vf vv[DVMAX];
#pragma GCC unroll 4
                for (int v = 0; v < DV; v++) {
                    vv[v] = ldv(vb + j * D + d0 + v * VLF);
                    __asm__("" : "+v"(vv[v]));     /* held in a register: GCC otherwise folds the load */
                }                                  /* into each of the RR rows' FMAs (RR x the loads) */
                const float *pr = st + j * RB + m0;
#pragma GCC unroll 8
                for (int r = 0; r < RR; r++)
#pragma GCC unroll 4
                    for (int v = 0; v < DV; v++) a[r][v] += pr[r] * vv[v];
            }
#pragma GCC unroll 8
            for (int r = 0; r < RR; r++)
#pragma GCC unroll 4
                for (int v = 0; v < DV; v++) stv(acc + (m0 + r) * D + d0 + v * VLF, a[r][v]);
        }
}

/* the fp32 kernel over records of fp32 (kv_b16 0) or of bf16 (1: each K and V row widened as it is
   packed - exact - so the products and sums are fp32's over the stored values, as SDPA's fp32 path
   after its gather and widening) */
static inline __attribute__((always_inline)) int prefill_f32(const float *q, int64_t q_tok_stride, int64_t ql,
        int64_t n, const void *kv, int kv_b16, const int64_t *pages, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
        int64_t page_stride, int64_t rec_stride, int64_t k_off, int64_t v_off, float scale, float *out,
        int64_t out_tok_stride, int nthreads) {
    if (D % VLF || D > DMAXF || ql < 1 || n < ql || Hq % Hkv) return -1;
    const int64_t G = Hq / Hkv, nqb = (ql + RB - 1) / RB, first = n - ql;    /* first: query row 0's position */
    /* each KV head's K and V rows packed contiguous, [Hkv][np][D], zeros past n (the last block's
       score rows are computed KS at a time) */
    const int64_t np = (n + KBF + KS - 1) / KBF * KBF + KS;
    float *kc = aligned_alloc(64, sizeof(float) * Hkv * np * D), *vc = aligned_alloc(64, sizeof(float) * Hkv * np * D);
    if (!kc || !vc) {
        free(kc);
        free(vc);
        return 1;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < Hkv * (np / KS); t++) {
        const int64_t h = t / (np / KS), i0 = t % (np / KS) * KS;
        for (int64_t i = i0; i < i0 + KS; i++) {
            float *kr = kc + (h * np + i) * D, *vr = vc + (h * np + i) * D;
            if (i >= n) {
                memset(kr, 0, sizeof(float) * D);
                memset(vr, 0, sizeof(float) * D);
                continue;
            }
            const int64_t at = pages[i / S] * page_stride + (i % S) * rec_stride + h * D;
            if (kv_b16) {
                const uint16_t *r = (const uint16_t *)kv + at;
                for (int64_t d = 0; d < D; d++) {
                    const uint32_t kb = (uint32_t)r[k_off + d] << 16, vb = (uint32_t)r[v_off + d] << 16;
                    memcpy(kr + d, &kb, 4);
                    memcpy(vr + d, &vb, 4);
                }
            } else {
                const float *r = (const float *)kv + at;
                memcpy(kr, r + k_off, sizeof(float) * D);
                memcpy(vr, r + v_off, sizeof(float) * D);
            }
        }
    }
#pragma omp parallel num_threads(nthreads)
    {
        float qt[DMAXF * RB] __attribute__((aligned(64)));     /* Q^T [D][RB] */
        float st[(KBF + KS) * RB] __attribute__((aligned(64)));    /* S^T, then P^T [KBF][RB] */
        float acc[DMAXF * RB] __attribute__((aligned(64)));    /* O [RB][D] */
        int32_t lim[RB] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < Hq * nqb; t++) {
            const int64_t qb = nqb - 1 - t / Hq, hq = t % Hq, h = hq / G;      /* the costliest blocks first */
            const int64_t r0 = qb * RB, rows = ql - r0 < RB ? ql - r0 : RB;
            for (int64_t m = 0; m < RB; m++) {
                const float *src = q + (r0 + (m < rows ? m : 0)) * q_tok_stride + hq * D;
                for (int64_t d = 0; d < D; d++) qt[d * RB + m] = m < rows ? src[d] : 0.f;
                lim[m] = (int32_t)(first + r0 + (m < rows ? m : rows - 1) + 1);   /* row m reads keys < lim[m] */
            }
            memset(acc, 0, sizeof(float) * D * RB);
            vi lims[NV];
            vf mx[NV], sum[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                lims[v] = *(const vi *)(lim + v * VLF);
                mx[v] = (vf){} + MASKED_F;
                sum[v] = (vf){};
            }
            const int64_t keys = first + r0 + rows, lo = first + r0 + 1;     /* every row reads keys < lo */
            for (int64_t k0 = 0; k0 < keys; k0 += KBF) {
                const int64_t kn = keys - k0 < KBF ? keys - k0 : KBF;
                const int64_t kr = (kn + KS - 1) / KS * KS;                    /* score rows computed */
                const int diag = k0 + kr > lo;      /* some row's last key is in this block: masked */
                const float *kb = kc + (h * np + k0) * D, *vb = vc + (h * np + k0) * D;
                /* S^T = K Q^T, the block's maxima taken as the scores leave the registers */
                vf bm[NV];
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) bm[v] = mx[v];
                for (int64_t j0 = 0; j0 < kr; j0 += KS) {
                    vf a[KS][NV];
#pragma GCC unroll 16
                    for (int k = 0; k < KS; k++)
#pragma GCC unroll 4
                        for (int v = 0; v < NV; v++) a[k][v] = (vf){};
                    for (int64_t d = 0; d < D; d++) {
                        vf qv[NV];
#pragma GCC unroll 4
                        for (int v = 0; v < NV; v++) qv[v] = ldv(qt + d * RB + v * VLF);
#pragma GCC unroll 16
                        for (int k = 0; k < KS; k++) {
                            const float b = kb[(j0 + k) * D + d];
#pragma GCC unroll 4
                            for (int v = 0; v < NV; v++) a[k][v] += b * qv[v];
                        }
                    }
#pragma GCC unroll 16
                    for (int k = 0; k < KS; k++)
#pragma GCC unroll 4
                        for (int v = 0; v < NV; v++) {
                            if (diag) {
                                const vi out = ((vi){} + (int32_t)(k0 + j0 + k)) >= lims[v];
                                a[k][v] = (vf)(((vi)a[k][v] & ~out) | ((vi)((vf){} + MASKED_F) & out));
                            }
                            bm[v] = VMAX(bm[v], a[k][v]);
                            stv(st + (j0 + k) * RB + v * VLF, a[k][v]);
                        }
                }
                /* P^T = e^((S^T - max) scale), the running sums, the old output's factor */
                vf al[NV], tot[NV];
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) {
                    al[v] = vexp_neg((mx[v] - bm[v]) * scale);
                    mx[v] = bm[v];
                    tot[v] = (vf){};
                }
                for (int64_t j = 0; j < kr; j++)
#pragma GCC unroll 4
                    for (int v = 0; v < NV; v++) {
                        const vf p = vexp_neg((ldv(st + j * RB + v * VLF) - bm[v]) * scale);
                        stv(st + j * RB + v * VLF, p);
                        tot[v] += p;
                    }
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) sum[v] = sum[v] * al[v] + tot[v];
                /* O = alpha O + P V */
                float als[RB] __attribute__((aligned(64)));
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) stv(als + v * VLF, al[v]);
#if DVMAX >= 4
                if (D % (4 * VLF) == 0)
                    pv_block(acc, st, als, vb, kn, D, 4);
                else
#endif
                if (D % (2 * VLF) == 0)
                    pv_block(acc, st, als, vb, kn, D, 2);
                else
                    pv_block(acc, st, als, vb, kn, D, 1);
            }
            float inv[RB] __attribute__((aligned(64)));
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) stv(inv + v * VLF, 1.f / sum[v]);
            for (int64_t m = 0; m < rows; m++) {
                float *o = out + (r0 + m) * out_tok_stride + hq * D;
                for (int64_t d = 0; d < D; d++) o[d] = acc[m * D + d] * inv[m];
            }
        }
    }
    free(kc);
    free(vc);
    return 0;
}

int kvl_paged_prefill_f32(PREFILL_PARAMS(float, float)) {
    return prefill_f32(q, q_tok_stride, ql, n, kv, 0, pages, S, Hq, Hkv, D, page_stride, rec_stride, k_off, v_off,
                       scale, out, out_tok_stride, nthreads);
}

/* kvl_paged_prefill_f32b: the same over a bf16 pool (fp32 queries, fp32 products): a CPU without
   bf16 products (an AVX2-only one, or KVLEDGER_BF16_GEMM=0) attends in fp32 over the stored values */
int kvl_paged_prefill_f32b(PREFILL_PARAMS(float, uint16_t)) {
    return prefill_f32(q, q_tok_stride, ql, n, kv, 1, pages, S, Hq, Hkv, D, page_stride, rec_stride, k_off, v_off,
                       scale, out, out_tok_stride, nthreads);
}

#else

/* neither AVX-512 nor AVX2 with FMA in this build: the caller's torch path */
DECLINED(kvl_paged_prefill_f32, float, float)
DECLINED(kvl_paged_prefill_f32b, float, uint16_t)

#endif
