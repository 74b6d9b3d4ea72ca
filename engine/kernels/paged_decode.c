/* Paged decode attention over the pool's own records, fp32, one call per layer.

   For each decode request b and KV head h (one task each, OpenMP over tasks): the G query heads
   of h read K and V straight out of the page records named by pages[b, :] (no gather into a
   contiguous copy), two-pass softmax over the request's keys [0, seq_len), out = sum p * V, and
   the softmax mass of each page summed over the G heads into part[b, h, c]; after the tasks,
   page_mass[rows[b], c] = sum over h of part[b, h, c] / Hq.

   Layout (element strides of the pool buffer viewed as float): K of slot s of page p for head h
   at  kv + p * page_stride + s * rec_stride + k_off + h * D  (V: v_off). The numbers are those of
   torch's bmm + softmax path up to float rounding order (tests/test_attention.py holds both to the
   padded reference). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define PF 4            /* slots ahead to prefetch */

static inline void prefetch_row(const float *p, int64_t D) {
    for (int64_t i = 0; i < D; i += 16) __builtin_prefetch(p + i, 0, 3);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t D) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (int w = LANES / 2; w > 0; w /= 2)      /* a tree, not a chain of 16 dependent adds */
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    float s = acc[0];
    for (; i < D; i++) s += a[i] * b[i];
    return s;
}

int kvl_paged_decode_f32(const float *q, int64_t q_tok_stride, const int64_t *toks,
                         const float *kv, const int64_t *pages, const int64_t *seq_lens,
                         int64_t Bd, int64_t Cd, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t page_stride, int64_t rec_stride, int64_t k_off, int64_t v_off, float scale,
                         float *out, int64_t out_tok_stride, float *part, float *page_mass,
                         const int64_t *rows, int64_t mass_row_stride, int nthreads) {
    const int64_t G = Hq / Hkv;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
    for (int64_t t = 0; t < Bd * Hkv; t++) {
        const int64_t b = t / Hkv, h = t % Hkv;
        int64_t n = seq_lens[b];
        if (n > Cd * S) n = Cd * S;
        float *part_b = part + (b * Hkv + h) * Cd;
        memset(part_b, 0, sizeof(float) * Cd);
        float *o = out + toks[b] * out_tok_stride + h * G * D;
        if (n <= 0) {
            memset(o, 0, sizeof(float) * G * D);
            continue;
        }
        float *sc = malloc(sizeof(float) * G * n);
        if (!sc) { failed = 1; continue; }
        const float *qb = q + toks[b] * q_tok_stride + h * G * D;
        const int64_t np = (n + S - 1) / S;
        for (int64_t c = 0, i = 0; c < np; c++) {  /* scores: each K row read once for the G heads */
            const float *k = kv + pages[b * Cd + c] * page_stride + k_off + h * D;
            for (int64_t s = 0; s < S && i < n; s++, i++, k += rec_stride) {
                /* a slot record is kilobytes (every layer's K and V): the next rows are a page
                   stride away, where the hardware prefetcher does not go; ask for them */
                if (s + PF < S) prefetch_row(k + PF * rec_stride, D);
                else if (c + 1 < np) prefetch_row(kv + pages[b * Cd + c + 1] * page_stride + k_off + h * D
                                                  + (s + PF - S) * rec_stride, D);
                for (int64_t g = 0; g < G; g++) sc[g * n + i] = dot(qb + g * D, k, D) * scale;
            }
        }
        for (int64_t g = 0; g < G; g++) {          /* softmax per query head */
            float *s = sc + g * n, m = -INFINITY, sum = 0.f;
            for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
            for (int64_t i = 0; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
            const float inv = 1.f / sum;
            for (int64_t i = 0; i < n; i++) s[i] *= inv;
        }
        memset(o, 0, sizeof(float) * G * D);
        for (int64_t c = 0, i = 0; c < np; c++) {  /* out = P V, each V row read once for the G heads */
            const float *v = kv + pages[b * Cd + c] * page_stride + v_off + h * D;
            float mass = 0.f;
            for (int64_t s = 0; s < S && i < n; s++, i++, v += rec_stride) {
                if (s + PF < S) prefetch_row(v + PF * rec_stride, D);
                else if (c + 1 < np) prefetch_row(kv + pages[b * Cd + c + 1] * page_stride + v_off + h * D
                                                  + (s + PF - S) * rec_stride, D);
                for (int64_t g = 0; g < G; g++) {
                    const float p = sc[g * n + i];
                    float *restrict og = o + g * D;
                    for (int64_t d = 0; d < D; d++) og[d] += p * v[d];
                    mass += p;
                }
            }
            part_b[c] = mass;
        }
        free(sc);
    }
    if (failed) return 1;
    for (int64_t b = 0; b < Bd; b++) {             /* page mass: mean over the Hq query heads */
        float *pm = page_mass + rows[b] * mass_row_stride;
        for (int64_t c = 0; c < Cd; c++) {
            float s = 0.f;
            for (int64_t h = 0; h < Hkv; h++) s += part[(b * Hkv + h) * Cd + c];
            pm[c] = s / (float)Hq;
        }
    }
    return 0;
}
