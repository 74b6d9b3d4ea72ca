/* The small dense ops of a decoder layer, fp32, each one pass over its rows (what torch runs as
   three to six ops with a dispatch each: at decode sizes the dispatch, not the arithmetic, is the
   cost). The same arithmetic as the torch ops they replace, up to float rounding order; every
   kernel runs its rows in parallel only when there are enough of them to pay for the threads.

   kvl_add_rms_norm_f32  residual += x (when residual is given), out = rms_norm(residual or x) * w
   kvl_silu_mul_f32      out[t, i] = silu(gu[t, i]) * gu[t, I + i]       (gate and up in one row)
   kvl_rope_f32          rotate-half RoPE in place on H heads of D per token, cos/sin [T, D/2] */
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
