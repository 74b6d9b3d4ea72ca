/* Paged decode attention over the pool's own records, one call per layer: K and V stored as fp32
   (kvl_paged_decode_f32) or bf16 (kvl_paged_decode_bf16: each value widened to fp32 as it is
   loaded), every product and sum in fp32.

   For each decode request b and KV head h (one task each, OpenMP over tasks): the G query heads
   of h read K and V straight out of the page records named by pages[b, :] (no gather into a
   contiguous copy), two-pass softmax over the request's keys [0, seq_len), out = sum p * V, and
   the softmax mass of each page summed over the G heads into part[b, h, c]; after the tasks,
   page_mass[rows[b], c] = sum over h of part[b, h, c] / Hq.

   Where a KV head serves several query heads (grouped-query attention) and heads are a multiple of
   32 values wide, keys go KB at a time: each block's K and V rows copied (bf16: widened) once into
   a contiguous block the G heads read, the scores of KB keys summed by one transposing sum
   (hsum8) instead of one horizontal sum per key and head; else key by key.

   Layout (element strides of the pool buffer viewed as float): K of slot s of page p for head h
   at  kv + p * page_stride + s * rec_stride + k_off + h * D  (V: v_off). The numbers are those of
   torch's bmm + softmax path up to float rounding order (tests/test_attention.py holds both to the
   padded reference). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"

#define PF 4            /* slots ahead to prefetch */

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
static inline v8 ld8(const float *p) { v8 r; __builtin_memcpy(&r, p, sizeof r); return r; }
static inline void st8(float *p, v8 a) { __builtin_memcpy(p, &a, sizeof a); }

/* 8 stored K or V values from element i of a row, as fp32 (bf16: the upper half of an fp32) */
static inline __attribute__((always_inline)) v8 ldkv(const void *row, int64_t i, int bf16) {
    if (!bf16) return ld8((const float *)row + i);
    u16x8 h;
    __builtin_memcpy(&h, (const uint16_t *)row + i, sizeof h);
    const u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    v8 r;
    __builtin_memcpy(&r, &u, sizeof r);
    return r;
}

static inline __attribute__((always_inline)) float kv1(const void *row, int64_t i, int bf16) {
    if (!bf16) return ((const float *)row)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)row)[i] << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

static inline __attribute__((always_inline)) float dot(const float *restrict a, const void *restrict b, int64_t D,
                                                       int bf16) {
    int64_t i = 0;
    float s = 0.f;
    if (D >= 16) {          /* two independent vector chains, one horizontal sum */
        v8 x = {0}, y = {0};
        for (; i + 16 <= D; i += 16) {
            x += ld8(a + i) * ldkv(b, i, bf16);
            y += ld8(a + i + 8) * ldkv(b, i + 8, bf16);
        }
        x += y;
        for (int j = 0; j < 8; j++) s += x[j];
    }
    for (; i < D; i++) s += a[i] * kv1(b, i, bf16);
    return s;
}

/* o[0:D] = sum_i p[i] * rows[i][0:D]: 64 columns at a time held in eight vector registers over
   all the keys (not loaded and stored back once per key) */
static inline __attribute__((always_inline)) void weighted_rows(const float *p, const void *const *rows, int64_t n,
                                                                 int64_t D, float *restrict o, int bf16) {
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (int64_t i = 0; i < n; i++) {
            const void *r = rows[i];
            const v8 w = {p[i], p[i], p[i], p[i], p[i], p[i], p[i], p[i]};
            a0 += w * ldkv(r, c, bf16); a1 += w * ldkv(r, c + 8, bf16);
            a2 += w * ldkv(r, c + 16, bf16); a3 += w * ldkv(r, c + 24, bf16);
            a4 += w * ldkv(r, c + 32, bf16); a5 += w * ldkv(r, c + 40, bf16);
            a6 += w * ldkv(r, c + 48, bf16); a7 += w * ldkv(r, c + 56, bf16);
        }
        st8(o + c, a0); st8(o + c + 8, a1); st8(o + c + 16, a2); st8(o + c + 24, a3);
        st8(o + c + 32, a4); st8(o + c + 40, a5); st8(o + c + 48, a6); st8(o + c + 56, a7);
    }
    if (c < D) {
        for (int64_t d = c; d < D; d++) o[d] = 0.f;
        for (int64_t i = 0; i < n; i++)
            for (int64_t d = c; d < D; d++) o[d] += p[i] * kv1(rows[i], d, bf16);
    }
}

/* max and sum of a row of scores in 16 lanes, then the lanes: one value at a time they are chains of
   n dependent compares or adds (GCC vectorizes neither: float max and sums are not reordered) */
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline float row_max(const float *s, int64_t n) {
    v8 a = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY}, b = a;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {      /* the larger of each lane, by a compare mask (no vector ?: in C) */
        const v8 x = ld8(s + i), y = ld8(s + i + 8);
        const i32x8 gx = x > a, gy = y > b;
        a = (v8)(((i32x8)x & gx) | ((i32x8)a & ~gx));
        b = (v8)(((i32x8)y & gy) | ((i32x8)b & ~gy));
    }
    float m = -INFINITY;
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    for (int j = 0; j < 8; j++) {
        m = a[j] > m ? a[j] : m;
        m = b[j] > m ? b[j] : m;
    }
    return m;
}

static inline float row_sum(const float *s, int64_t n) {
    float lanes[16] = {0}, sum = 0.f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += s[i + j];
    for (; i < n; i++) sum += s[i];
    for (int j = 0; j < 16; j++) sum += lanes[j];
    return sum;
}

#define KB 8           /* keys a block: the scores of 8 keys come out of one transposing sum */
#define DMAX 256        /* the blocked path's widest head */

/* the horizontal sums of a[0..7], as one vector: r[j] = a[j][0] + ... + a[j][7] */
static inline __attribute__((always_inline)) v8 hsum8(const v8 *a) {
    const v8 t0 = __builtin_shufflevector(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14)
                  + __builtin_shufflevector(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 t1 = __builtin_shufflevector(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14)
                  + __builtin_shufflevector(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 t2 = __builtin_shufflevector(a[4], a[5], 0, 8, 2, 10, 4, 12, 6, 14)
                  + __builtin_shufflevector(a[4], a[5], 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 t3 = __builtin_shufflevector(a[6], a[7], 0, 8, 2, 10, 4, 12, 6, 14)
                  + __builtin_shufflevector(a[6], a[7], 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 u0 = __builtin_shufflevector(t0, t1, 0, 1, 8, 9, 4, 5, 12, 13)
                  + __builtin_shufflevector(t0, t1, 2, 3, 10, 11, 6, 7, 14, 15);
    const v8 u1 = __builtin_shufflevector(t2, t3, 0, 1, 8, 9, 4, 5, 12, 13)
                  + __builtin_shufflevector(t2, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11)
           + __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* KB rows of a block as fp32 rows, copied (bf16: widened) once into ``buf`` and read from there by
   all G query heads: records a few kilobytes apart would share L1 sets (a power-of-two stride plus
   the 16-byte tag), the copy is one contiguous block. A row past the last key points at ``zero``. */
static inline __attribute__((always_inline)) void block_rows(const void *const *rows, int64_t nb, int64_t D,
                                                              float *buf, const float *zero, const float **out,
                                                              int bf16) {
    for (int64_t j = 0; j < KB; j++) {
        if (j >= nb) { out[j] = zero; continue; }
        float *dst = buf + j * D;
        for (int64_t c = 0; c < D; c += 8) st8(dst + c, ldkv(rows[j], c, bf16));
        out[j] = dst;
    }
}

/* scores sc[g * n + i] of the G heads over keys [0, n) and out = P V, KB keys at a time: each K
   and V row loaded (and widened) once for the G heads, the KB dots of a head summed by one
   transposing sum, the G outputs accumulated in ``acc`` [G, D] */
static inline __attribute__((always_inline)) void blocked_scores(const float *qb, const void *const *krow, int64_t n,
                                                                  int64_t G, int64_t D, float scale, float *sc,
                                                                  int64_t es, int bf16) {
    float buf[KB * DMAX] __attribute__((aligned(64))), zero[DMAX] __attribute__((aligned(64))) = {0};
    const float *r[KB];
    for (int64_t i0 = 0; i0 < n; i0 += KB) {
        const int64_t nb = n - i0 < KB ? n - i0 : KB;
        for (int64_t j = 0; j < KB && i0 + KB + j < n; j++) prefetch_row(krow[i0 + KB + j], D * es);
        block_rows(krow + i0, nb, D, buf, zero, r, bf16);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qb + g * D;
            v8 a[KB] = {{0}};
            for (int64_t c = 0; c < D; c += 8) {
                const v8 qv = ld8(qg + c);
                for (int j = 0; j < KB; j++) a[j] += qv * ld8(r[j] + c);
            }
            const v8 s = hsum8(a) * scale;
            if (nb == KB) st8(sc + g * n + i0, s);
            else for (int64_t j = 0; j < nb; j++) sc[g * n + i0 + j] = s[j];
        }
    }
}

static inline __attribute__((always_inline)) void blocked_values(const float *sc, const void *const *vrow, int64_t n,
                                                                  int64_t G, int64_t D, float *acc, int64_t es,
                                                                  int bf16) {
    float buf[KB * DMAX] __attribute__((aligned(64))), zero[DMAX] __attribute__((aligned(64))) = {0};
    const float *r[KB];
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t i0 = 0; i0 < n; i0 += KB) {
        const int64_t nb = n - i0 < KB ? n - i0 : KB;
        for (int64_t j = 0; j < KB && i0 + KB + j < n; j++) prefetch_row(vrow[i0 + KB + j], D * es);
        block_rows(vrow + i0, nb, D, buf, zero, r, bf16);
        for (int64_t g = 0; g < G; g++) {
            const float *p = sc + g * n + i0;
            float w[KB];
            for (int j = 0; j < KB; j++) w[j] = j < nb ? p[j] : 0.f;
            float *o = acc + g * D;
            for (int64_t c = 0; c < D; c += 32) {       /* D % 32 == 0 here */
                v8 a0 = ld8(o + c), a1 = ld8(o + c + 8), a2 = ld8(o + c + 16), a3 = ld8(o + c + 24);
                for (int j = 0; j < KB; j++) {
                    const v8 wj = {w[j], w[j], w[j], w[j], w[j], w[j], w[j], w[j]};
                    a0 += wj * ld8(r[j] + c); a1 += wj * ld8(r[j] + c + 8);
                    a2 += wj * ld8(r[j] + c + 16); a3 += wj * ld8(r[j] + c + 24);
                }
                st8(o + c, a0); st8(o + c + 8, a1); st8(o + c + 16, a2); st8(o + c + 24, a3);
            }
        }
    }
}

static inline __attribute__((always_inline)) int paged_decode(
        const float *q, int64_t q_tok_stride, const int64_t *toks, const void *kv, const int64_t *pages,
        const int64_t *seq_lens, int64_t Bd, int64_t Cd, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
        int64_t page_stride, int64_t rec_stride, int64_t k_off, int64_t v_off, float scale, float *out,
        int64_t out_tok_stride, float *part, float *page_mass, const int64_t *rows, int64_t mass_row_stride,
        int nthreads, int bf16) {
    const int64_t G = Hq / Hkv, es = bf16 ? 2 : 4;     /* strides and offsets count stored elements */
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
        /* scores [G, n], then the K and V row of each key (slot records are kilobytes apart) */
        float *sc = malloc(sizeof(float) * G * n + 2 * sizeof(float *) * n);
        if (!sc) { failed = 1; continue; }
        const void **krow = (const void **)(sc + G * n), **vrow = krow + n;
        for (int64_t c = 0, i = 0; i < n; c++) {   /* (no division per key: S is not a constant) */
            const char *rec = (const char *)kv + (pages[b * Cd + c] * page_stride + h * D) * es;
            for (int64_t s = 0; s < S && i < n; s++, i++, rec += rec_stride * es) {
                krow[i] = rec + k_off * es;
                vrow[i] = rec + v_off * es;
            }
        }
        const float *qb = q + toks[b] * q_tok_stride + h * G * D;
        /* the blocked path where a block's copy is shared by enough heads (a one-off timing of one
           call, 2026-12-05, README: 1.05-1.8x at 3-7 query heads a KV head, bf16 1.1-1.2x at 2; at
           1-2 fp32 heads the per-key path was as fast or faster) */
        const int blocked = D % 32 == 0 && D <= DMAX && (G >= 3 || (bf16 && G >= 2));
        if (blocked) blocked_scores(qb, krow, n, G, D, scale, sc, es, bf16);
        else for (int64_t i = 0; i < n; i++) {     /* scores: each K row read once for the G heads */
            /* the next rows are a record stride away, where the hardware prefetcher does not go */
            if (i + PF < n) prefetch_row(krow[i + PF], D * es);
            for (int64_t g = 0; g < G; g++) sc[g * n + i] = dot(qb + g * D, krow[i], D, bf16) * scale;
        }
        for (int64_t g = 0; g < G; g++) {          /* softmax per query head */
            float *s = sc + g * n;
            const float m = row_max(s, n);
            for (int64_t i = 0; i < n; i++) s[i] = kvl_exp(s[i] - m);     /* (vectorizes: vexp.h) */
            const float inv = 1.f / row_sum(s, n);
            for (int64_t i = 0; i < n; i++) s[i] *= inv;
        }
        for (int64_t i = 0; i < PF && i < n; i++) prefetch_row(vrow[i], D * es);
        if (blocked) {                             /* out = P V, the G heads' rows side by side in o */
            blocked_values(sc, vrow, n, G, D, o, es, bf16);
        } else {
            for (int64_t g = 0; g < G; g++)        /* out = P V per query head */
                weighted_rows(sc + g * n, vrow, n, D, o + g * D, bf16);
        }
        for (int64_t g = 0; g < G; g++) {          /* this KV head's mass on each page, over its G heads */
            const float *p = sc + g * n;           /* (a head's row at a time: contiguous) */
            for (int64_t c = 0, i = 0; i < n; c++) {
                const int64_t e = i + S < n ? i + S : n;
                float m = 0.f;
                for (; i < e; i++) m += p[i];
                part_b[c] += m;
            }
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

int kvl_paged_decode_f32(const float *q, int64_t q_tok_stride, const int64_t *toks,
                         const float *kv, const int64_t *pages, const int64_t *seq_lens,
                         int64_t Bd, int64_t Cd, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t page_stride, int64_t rec_stride, int64_t k_off, int64_t v_off, float scale,
                         float *out, int64_t out_tok_stride, float *part, float *page_mass,
                         const int64_t *rows, int64_t mass_row_stride, int nthreads) {
    return paged_decode(q, q_tok_stride, toks, kv, pages, seq_lens, Bd, Cd, S, Hq, Hkv, D, page_stride, rec_stride,
                        k_off, v_off, scale, out, out_tok_stride, part, page_mass, rows, mass_row_stride, nthreads, 0);
}

int kvl_paged_decode_bf16(const float *q, int64_t q_tok_stride, const int64_t *toks,
                          const uint16_t *kv, const int64_t *pages, const int64_t *seq_lens,
                          int64_t Bd, int64_t Cd, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                          int64_t page_stride, int64_t rec_stride, int64_t k_off, int64_t v_off, float scale,
                          float *out, int64_t out_tok_stride, float *part, float *page_mass,
                          const int64_t *rows, int64_t mass_row_stride, int nthreads) {
    return paged_decode(q, q_tok_stride, toks, kv, pages, seq_lens, Bd, Cd, S, Hq, Hkv, D, page_stride, rec_stride,
                        k_off, v_off, scale, out, out_tok_stride, part, page_mass, rows, mass_row_stride, nthreads, 1);
}
