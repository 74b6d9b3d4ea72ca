/* The small dense ops of a decoder layer, fp32, each one pass over its rows (what torch runs as
   three to six ops with a dispatch each: at decode sizes the dispatch, not the arithmetic, is the
   cost). The same arithmetic as the torch ops they replace, up to float rounding order; every
   kernel runs its rows in parallel only when there are enough of them to pay for the threads.

   kvl_add_rms_norm_f32  residual += x (when residual is given), out = rms_norm(residual or x) * w
   kvl_silu_mul_f32      out[t, i] = silu(gu[t, i]) * gu[t, I + i]       (gate and up in one row)
   kvl_rope_f32          rotate-half RoPE in place on H heads of D per token, cos/sin [T, D/2]
   kvl_linear_f32        out = x @ w.T + b for few rows of x (a decode step's projections), w packed
                         at load in blocks of 16 output columns
   kvl_read_check        the read check of engine/attention.py over a step's block tables, one pass */
#include <math.h>
#include <stdint.h>

#define PAR_ROWS 64         /* rows below which one thread does it all */

int kvl_add_rms_norm_f32(const float *x, int64_t xs, float *residual, int64_t rs, const float *w, float *out,
                         int64_t os, int64_t T, int64_t H, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *xi = x + t * xs;
        float *o = out + t * os;
        if (residual) {
            float *r = residual + t * rs;
            for (int64_t i = 0; i < H; i++) r[i] += xi[i];
            xi = r;
        }
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += xi[i] * xi[i];
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = xi[i] * inv * w[i];
    }
    return 0;
}

int kvl_silu_mul_f32(const float *gu, int64_t gs, float *out, int64_t os, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * gs, *u = g + I;
        float *o = out + t * os;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    return 0;
}

int kvl_rope_f32(float *x, int64_t xs, int64_t H, int64_t D, const float *cos_, const float *sin_, int64_t T,
                 int nthreads) {
    const int64_t h2 = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * h2, *s = sin_ + t * h2;
        for (int64_t h = 0; h < H; h++) {
            float *a = x + t * xs + h * D, *b = a + h2;
            for (int64_t i = 0; i < h2; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
    return 0;
}

/* Row r of src (width floats, rows src_stride apart) into slot offs[r] of page pages[r] of the
   pool (records rec_stride apart inside a page, pages page_stride apart, the row at off in its
   record): a layer's new K or V through the step's slot mapping, one call (torch: a copy of the
   strided rows, then an index_put). */
int kvl_scatter_rows_f32(float *pool, const int64_t *pages, const int64_t *offs, int64_t n, int64_t page_stride,
                         int64_t rec_stride, int64_t off, const float *src, int64_t src_stride, int64_t width,
                         int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n * width >= 262144)
    for (int64_t r = 0; r < n; r++) {
        float *d = pool + pages[r] * page_stride + offs[r] * rec_stride + off;
        const float *s = src + r * src_stride;
        for (int64_t i = 0; i < width; i++) d[i] = s[i];
    }
    return 0;
}

/* x @ w.T + b for few rows of x: a decode step's projections, where oneDNN's per-call cost is
   most of the time (bench/engine.py). w is packed at load (engine.kernels.pack_rows) as blocks of
   NB output columns, each block [K][NB] contiguous: zero-padded past N. A tile is R <= 4 rows of x
   against one block, 2 x R vector accumulators over k (each weight block read once per 4 rows,
   from L1/L2); blocks run in parallel when the product is large enough to pay for the threads.
   Each output is sum_k x[m, k] * w[n, k] summed in k order (then + b): torch's product up to float
   rounding order. */
typedef float v8 __attribute__((vector_size(32)));
#define NB 16

static inline __attribute__((always_inline)) void linear_tile(int R, const float *x, int64_t xs, const float *wb,
                                                              int64_t K, const float *bias, float *out, int64_t os,
                                                              int64_t ncols) {
    v8 acc[8] = {{0}};
    for (int64_t k = 0; k < K; k++) {
        v8 w0, w1;
        __builtin_memcpy(&w0, wb + k * NB, sizeof w0);
        __builtin_memcpy(&w1, wb + k * NB + 8, sizeof w1);
        for (int r = 0; r < R; r++) {       /* R is a constant at each call site: unrolled */
            const v8 s = (v8){0} + x[r * xs + k];
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

int kvl_linear_f32(const float *x, int64_t xs, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
                   float *out, int64_t os, int nthreads) {
    const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N * K >= (1 << 18))
    for (int64_t b = 0; b < blocks; b++) {
        const float *wb = wp + b * K * NB, *bb = bias ? bias + b * NB : 0;
        const int64_t ncols = N - b * NB < NB ? N - b * NB : NB;
        float *ob = out + b * NB;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) linear_tile(4, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols);
        switch (M - m) {
            case 3: linear_tile(3, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols); break;
            case 2: linear_tile(2, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols); break;
            case 1: linear_tile(1, x + m * xs, xs, wb, K, bb, ob + m * os, os, ncols); break;
        }
    }
    return 0;
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
