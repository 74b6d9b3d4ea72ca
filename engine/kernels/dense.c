/* The small dense ops of a decoder layer, fp32, each one pass over its rows (what torch runs as
   three to six ops with a dispatch each: at decode sizes the dispatch, not the arithmetic, is the
   cost). The same arithmetic as the torch ops they replace, up to float rounding order; every
   kernel runs its rows in parallel only when there are enough of them to pay for the threads.

   kvl_add_rms_norm_f32  residual += x (when residual is given), out = rms_norm(residual or x) * w
   kvl_add_rms_norm_mixed  the same with x and/or out in bf16 (a bf16 product's result in, the next
                         bf16 product's input out: no conversion op between them)
   kvl_silu_mul_f32      out[t, i] = silu(gu[t, i]) * gu[t, I + i]       (gate and up in one row)
   kvl_silu_mul_bf16     the same on bf16 rows (a bf16 prefill's MLP): fp32 arithmetic, the result
                         rounded to bf16 once (torch rounds silu's result, then the product)
   kvl_rope_f32          rotate-half RoPE in place on H heads of D per token, cos/sin [T, D/2]
   kvl_rope_bf16         the same on bf16 rows, out of place, the result rounded to bf16 once
   kvl_linear_f32        out = x @ w.T + b for few rows of x (a decode step's projections), w packed
                         at load in blocks of 16 output columns
   kvl_linear_bf16       the same with w stored in bf16 (widened to fp32 as it is loaded: half the
                         weight bytes read, fp32 arithmetic)
   kvl_store_kv_*        a layer's new K and V rows into their slots, fp32 or rounded to bf16 (_b16:
                         bf16 rows into a bf16 pool), with the tag plane and write counters
   kvl_read_check        the read check of engine/attention.py over a step's block tables, one pass */
/* the loops GCC vectorizes itself (silu, norms, RoPE) in 512-bit vectors where the CPU has them
   (its default on such a CPU is 256: silu_mul on bf16 rows 1.25x a call with 512, 2026-12-05) */
#if defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "vexp.h"

#define PAR_ROWS 64         /* rows below which one thread does it all */


/* element i of a row stored as fp32 or bf16, as fp32 */
static inline __attribute__((always_inline)) float ld1(const void *row, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* one row of the norm: out = src * (1 / rms(src)) * w, src and out fp32 or bf16 (out rounded once) */
static inline __attribute__((always_inline)) void norm_row(const void *src, int sb, const float *w, void *out, int ob,
                                                           int64_t H, float eps) {
    /* the sum of squares in 16 lanes (each lane's own sum: a vector add per 16 values; one sum in
       order would be a chain of H scalar adds - GCC may not reorder float sums), then the lanes */
    float lanes[16] = {0}, ss = 0.f;
    int64_t i = 0;
    for (; i + 16 <= H; i += 16)
        for (int j = 0; j < 16; j++) {
            const float v = ld1(src, i + j, sb);
            lanes[j] += v * v;
        }
    for (; i < H; i++) {
        const float v = ld1(src, i, sb);
        ss += v * v;
    }
    for (int j = 0; j < 16; j++) ss += lanes[j];
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    if (ob) {
        uint16_t *o = out;
        for (i = 0; i < H; i++) o[i] = to_bf16(ld1(src, i, sb) * inv * w[i]);
    } else {
        float *o = out;
        for (i = 0; i < H; i++) o[i] = ld1(src, i, sb) * inv * w[i];
    }
}

/* residual += x (when residual is given, fp32), out = rms_norm(residual or x) * w. x (a product's
   result) fp32 or bf16 (xb), out fp32 or bf16 (ob: the next product's input where that product runs
   in bf16 - rounded here once, as the product would round it); strides in elements of their type */
static inline __attribute__((always_inline)) void add_rms_norm(const void *x, int64_t xs, float *residual, int64_t rs,
                                                               const float *w, void *out, int64_t os, int64_t T,
                                                               int64_t H, float eps, int nthreads, int xb, int ob) {
    const int64_t xe = xb ? 2 : 4, oe = ob ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const void *xi = (const char *)x + t * xs * xe;
        void *o = (char *)out + t * os * oe;
        if (residual) {
            float *r = residual + t * rs;
            for (int64_t i = 0; i < H; i++) r[i] += ld1(xi, i, xb);
            norm_row(r, 0, w, o, ob, H, eps);
        } else {
            norm_row(xi, xb, w, o, ob, H, eps);
        }
    }
}

int kvl_add_rms_norm_f32(const float *x, int64_t xs, float *residual, int64_t rs, const float *w, float *out,
                         int64_t os, int64_t T, int64_t H, float eps, int nthreads) {
    add_rms_norm(x, xs, residual, rs, w, out, os, T, H, eps, nthreads, 0, 0);
    return 0;
}

/* the same with x and/or out in bf16 (xb, ob: 0 or 1) */
int kvl_add_rms_norm_mixed(const void *x, int64_t xs, float *residual, int64_t rs, const float *w, void *out,
                           int64_t os, int64_t T, int64_t H, float eps, int nthreads, int xb, int ob) {
    if (xb && ob) add_rms_norm(x, xs, residual, rs, w, out, os, T, H, eps, nthreads, 1, 1);
    else if (xb) add_rms_norm(x, xs, residual, rs, w, out, os, T, H, eps, nthreads, 1, 0);
    else if (ob) add_rms_norm(x, xs, residual, rs, w, out, os, T, H, eps, nthreads, 0, 1);
    else add_rms_norm(x, xs, residual, rs, w, out, os, T, H, eps, nthreads, 0, 0);
    return 0;
}

/* silu(x) = x / (1 + e^-x), e^-x inline (vexp.h) so that the loop vectorizes; a NaN x gives NaN */
static inline float silu(float x) { return x / (1.f + kvl_exp(-x)); }

int kvl_silu_mul_f32(const float *gu, int64_t gs, float *out, int64_t os, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * gs, *u = g + I;
        float *o = out + t * os;
        for (int64_t i = 0; i < I; i++) o[i] = silu(g[i]) * u[i];
    }
    return 0;
}

/* one rotated pair, the same expression for both kernels below (kvl_rope_bf16's results are
   kvl_rope_f32's rounded to bf16, bit for bit: tests/test_kernels.py) */
static inline __attribute__((always_inline)) void rot(float x1, float x2, float c, float s, float *y1, float *y2) {
    *y1 = x1 * c - x2 * s;
    *y2 = x2 * c + x1 * s;
}

int kvl_rope_f32(float *x, int64_t xs, int64_t H, int64_t D, const float *cos_, const float *sin_, int64_t T,
                 int nthreads) {
    const int64_t h2 = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * h2, *s = sin_ + t * h2;
        for (int64_t h = 0; h < H; h++) {
            float *a = x + t * xs + h * D, *b = a + h2;
            for (int64_t i = 0; i < h2; i++) rot(a[i], b[i], c[i], s[i], a + i, b + i);
        }
    }
    return 0;
}

/* RoPE on bf16 rows (a bf16 product's q and k), out of place: out[t] (row stride os) = the first H
   heads of x[t] rotated in fp32 and rounded to bf16 once - what widening, kvl_rope_f32 and rounding
   give, in one pass over half the bytes; x is left as it was (its q rows can still be rotated in
   fp32 where the attention needs them unrounded) */
int kvl_rope_bf16(const uint16_t *x, int64_t xs, int64_t H, int64_t D, const float *cos_, const float *sin_,
                  int64_t T, uint16_t *out, int64_t os, int nthreads) {
    const int64_t h2 = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * h2, *s = sin_ + t * h2;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *a = x + t * xs + h * D, *b = a + h2;
            uint16_t *ya = out + t * os + h * D, *yb = ya + h2;
            for (int64_t i = 0; i < h2; i++) {
                float y1, y2;
                rot(from_bf16(a[i]), from_bf16(b[i]), c[i], s[i], &y1, &y2);
                ya[i] = to_bf16(y1);
                yb[i] = to_bf16(y2);
            }
        }
    }
    return 0;
}

int kvl_silu_mul_bf16(const uint16_t *gu, int64_t gs, uint16_t *out, int64_t os, int64_t T, int64_t I,
                      int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * gs, *u = g + I;
        uint16_t *o = out + t * os;
        for (int64_t i = 0; i < I; i++) o[i] = to_bf16(silu(from_bf16(g[i])) * from_bf16(u[i]));
    }
    return 0;
}

#define SAME(v) (v)

/* A layer's new K and V rows into their slots in one call (KVPool.store: two scatters of K and V,
   and at layer 0 the slots' write counters and the tag plane, had been five torch or ctypes calls,
   28 us at layer 0 of the tiny model's decode step, 15 at the others; 8 us each now, most of it the
   Python wrapper's checks, measured call by call). Row r of k and of v (width values, rows k_stride
   and v_stride apart) goes into the record of slot offs[r] of page pages[r] - records rec_bytes
   apart from hdr bytes into a page, pages page_bytes apart in buf - at k_off and v_off bytes into
   the record; with tags, the tag and writer of row r into the record's first two int64s; with
   write_seq (layer 0), write_seq[pages[r] * S + offs[r]] counted up. A page outside 0 .. P - 1 or an
   offset outside 0 .. S - 1: -1 and nothing written (torch's index_put, the caller's path, then
   says which) */
#define STORE_KV(name, pool_t, src_t, conv)                                                                      \
    int name(uint8_t *buf, const int64_t *pages, const int64_t *offs, int64_t n, int64_t page_bytes,              \
             int64_t hdr, int64_t rec_bytes, int64_t k_off, int64_t v_off, const src_t *k, int64_t k_stride,     \
             const src_t *v, int64_t v_stride, int64_t width, const int64_t *tags, const int64_t *writers,       \
             int64_t *write_seq, int64_t P, int64_t S, int nthreads) {                                           \
        for (int64_t r = 0; r < n; r++)                                                                            \
            if (pages[r] < 0 || pages[r] >= P || offs[r] < 0 || offs[r] >= S) return -1;                          \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (n * width >= 131072)")                 \
        for (int64_t r = 0; r < n; r++) {                                                                          \
            uint8_t *rec = buf + pages[r] * page_bytes + hdr + offs[r] * rec_bytes;                               \
            pool_t *dk = (pool_t *)(rec + k_off), *dv = (pool_t *)(rec + v_off);                                  \
            const src_t *sk = k + r * k_stride, *sv = v + r * v_stride;                                           \
            for (int64_t i = 0; i < width; i++) dk[i] = conv(sk[i]);                                               \
            for (int64_t i = 0; i < width; i++) dv[i] = conv(sv[i]);                                               \
            if (tags) {                                                                                            \
                ((int64_t *)rec)[0] = tags[r];                                                                     \
                ((int64_t *)rec)[1] = writers[r];                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        if (write_seq)                                                                                             \
            for (int64_t r = 0; r < n; r++) write_seq[pages[r] * S + offs[r]] += 1;                               \
        return 0;                                                                                                  \
    }

STORE_KV(kvl_store_kv_f32, float, float, SAME)
STORE_KV(kvl_store_kv_bf16, uint16_t, float, to_bf16)
STORE_KV(kvl_store_kv_b16, uint16_t, uint16_t, SAME)

/* x @ w.T + b for few rows of x: a decode step's projections, where oneDNN's per-call cost is
   most of the time (bench/engine.py). w is packed at load (engine.kernels.pack_rows) as blocks of
   NB output columns, each block [K][NB] contiguous: zero-padded past N. A tile is R <= 4 rows of x
   against one block, 2 x R vector accumulators over k (each weight block read once per 4 rows,
   from L1/L2); blocks run in parallel when the product is large enough to pay for the threads.
   Each output is sum_k x[m, k] * w[n, k] summed in k order (then + b): torch's product up to float
   rounding order. */
typedef float v8 __attribute__((vector_size(32)));
#define NB 16

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* A vector of weights of a packed block (NAME: 8 or 16 lanes), as fp32: loaded as they are, or
   widened from bf16 (the upper half of an fp32: zero-extend, shift left 16) */
#define DEFINE_LDW(NAME, VF, VH, VU)                                                                   \
    static inline __attribute__((always_inline)) VF NAME(const void *wb, int64_t i, int bf16) {     \
        VF r;                                                                                        \
        if (bf16) {                                                                                  \
            VH h;                                                                                    \
            __builtin_memcpy(&h, (const uint16_t *)wb + i, sizeof h);                                \
            const VU u = __builtin_convertvector(h, VU) << 16;                                       \
            __builtin_memcpy(&r, &u, sizeof r);                                                      \
        } else {                                                                                     \
            __builtin_memcpy(&r, (const float *)wb + i, sizeof r);                                   \
        }                                                                                            \
        return r;                                                                                    \
    }
DEFINE_LDW(ldw, v8, u16x8, u32x8)

/* x in every lane (a broadcast load: ``(v8){0} + x`` would add a zero first - it cannot be folded,
   -0 + 0 being +0 - and broadcast the sum: two more instructions per row and k, on the shuffle port) */
static inline __attribute__((always_inline)) v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline __attribute__((always_inline)) void linear_tile(int R, const float *x, int64_t xs, const void *wb,
                                                              int64_t K, const float *bias, float *out, int64_t os,
                                                              int64_t ncols, int bf16) {
    v8 acc[8] = {{0}};
    for (int64_t k = 0; k < K; k++) {
        const v8 w0 = ldw(wb, k * NB, bf16), w1 = ldw(wb, k * NB + 8, bf16);
        for (int r = 0; r < R; r++) {       /* R is a constant at each call site: unrolled */
            const v8 s = splat8(x[r * xs + k]);
            acc[2 * r] += s * w0;
            acc[2 * r + 1] += s * w1;
        }
    }
    for (int r = 0; r < R; r++) {
        float tmp[NB];
        __builtin_memcpy(tmp, &acc[2 * r], sizeof acc[0]);
        __builtin_memcpy(tmp + 8, &acc[2 * r + 1], sizeof acc[0]);
        float *o = out + r * os;
        for (int64_t j = 0; j < ncols; j++) o[j] = bias ? tmp[j] + bias[j] : tmp[j];
    }
}

#if defined(__AVX512F__)
/* With 512-bit vectors a block's 16 columns are one vector: a tile is R <= 8 rows, one weight load
   and R broadcast-FMAs per k (the 256-bit tile above: two loads and 2 R FMAs for the same work) */
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

DEFINE_LDW(ldw16, v16, u16x16, u32x16)

static inline __attribute__((always_inline)) void linear_tile16(int R, const float *x, int64_t xs, const void *wb,
                                                                int64_t K, const float *bias, float *out, int64_t os,
                                                                int64_t ncols, int bf16) {
    v16 acc[8] = {{0}};
    for (int64_t k = 0; k < K; k++) {
        const v16 w = ldw16(wb, k * NB, bf16);
        for (int r = 0; r < R; r++) {       /* R constant: unrolled */
            const float xv = x[r * xs + k];
            acc[r] += (v16){xv, xv, xv, xv, xv, xv, xv, xv, xv, xv, xv, xv, xv, xv, xv, xv} * w;
        }
    }
    for (int r = 0; r < R; r++) {
        float tmp[NB];
        __builtin_memcpy(tmp, &acc[r], sizeof acc[0]);
        float *o = out + r * os;
        for (int64_t j = 0; j < ncols; j++) o[j] = bias ? tmp[j] + bias[j] : tmp[j];
    }
}
#define TILE_ROWS 8
#define TILE(R, ...) linear_tile16(R, __VA_ARGS__)
#else
#define TILE_ROWS 4
#define TILE(R, ...) linear_tile(R, __VA_ARGS__)
#endif

static inline __attribute__((always_inline)) int linear(const float *x, int64_t xs, int64_t M, int64_t K,
                                                        const void *wp, int64_t N, const float *bias, float *out,
                                                        int64_t os, int nthreads, int bf16) {
    const int64_t blocks = (N + NB - 1) / NB, esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N * K >= (1 << 18))
    for (int64_t b = 0; b < blocks; b++) {
        const void *wb = (const char *)wp + b * K * NB * esize;
        const float *bb = bias ? bias + b * NB : 0;
        const int64_t ncols = N - b * NB < NB ? N - b * NB : NB;
        float *ob = out + b * NB;
        int64_t m = 0;
        for (; m + TILE_ROWS <= M; m += TILE_ROWS)
            TILE(TILE_ROWS, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols, bf16);
        switch (M - m) {        /* (each case a constant R: its loops unrolled) */
#if TILE_ROWS > 4
            case 7: TILE(7, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols, bf16); break;
            case 6: TILE(6, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols, bf16); break;
            case 5: TILE(5, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols, bf16); break;
            case 4: TILE(4, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols, bf16); break;
#endif
            case 3: TILE(3, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols, bf16); break;
            case 2: TILE(2, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols, bf16); break;
            case 1: TILE(1, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols, bf16); break;
        }
    }
    return 0;
}

int kvl_linear_f32(const float *x, int64_t xs, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
                   float *out, int64_t os, int nthreads) {
    return linear(x, xs, M, K, wp, N, bias, out, os, nthreads, 0);
}

int kvl_linear_bf16(const float *x, int64_t xs, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                    const float *bias, float *out, int64_t os, int nthreads) {
    return linear(x, xs, M, K, wp, N, bias, out, os, nthreads, 1);
}

/* The read check (engine/attention.py read_check, whose docstring states the rule) in one pass
   over the step's block tables [B, C]: for each slot s of column c that the attention reads
   (position c * S + s < seq[b]), bad when the page's generation is not the one granted or the
   slot's tag is not the request's own tag at that position. The pool's int64 planes: generation
   of page p at buf[p * pw], tag of slot s at buf[p * pw + s * rw + tag_off], writer at + wr_off.
   Writes bad_slots, slots (read), found_gen, mask (bit s: slot s failed) [B, C] and the writers
   found [B, C, S] (every slot, read or not, as the numpy path); returns the failed slot count. */
int64_t kvl_read_check(const int64_t *buf, int64_t pw, int64_t rw, int64_t tag_off, int64_t wr_off,
                       const int64_t *bt, const int64_t *seq, const int64_t *exp_gen, const int64_t *exp_tags,
                       int64_t B, int64_t C, int64_t S, int64_t *bad_slots, int64_t *slots, int64_t *found_gen,
                       int64_t *mask, int64_t *found_writers) {
    int64_t failed = 0;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t c = 0; c < C; c++) {
            const int64_t i = b * C + c, page = bt[i] < 0 ? 0 : bt[i];
            const int64_t *hdr = buf + page * pw, *want = exp_tags + b * C * S + c * S;
            int64_t n = seq[b] - c * S;
            n = n < 0 ? 0 : n > S ? S : n;
            const int gen_bad = hdr[0] != exp_gen[i];
            int64_t bad = 0, m = 0;
            for (int64_t s = 0; s < S; s++) {
                found_writers[i * S + s] = hdr[s * rw + wr_off];
                if (s < n && (gen_bad || hdr[s * rw + tag_off] != want[s])) {
                    bad++;
                    m |= (int64_t)1 << s;
                }
            }
            found_gen[i] = hdr[0];
            slots[i] = n;
            bad_slots[i] = bad;
            mask[i] = m;
            failed += bad;
        }
    }
    return failed;
}
