/* Paged decode attention over the pool's own records, one call per layer: K and V stored as fp32
   (kvl_paged_decode_f32) or bf16 (kvl_paged_decode_bf16: each value widened to fp32 as it is
   loaded), every product and sum in fp32.

   For each decode request b and KV head h (one task each, OpenMP over tasks): the G query heads
   of h read K and V straight out of the page records named by pages[b, :] (no gather into a
   contiguous copy), two-pass softmax over the request's keys [0, seq_len), out = sum p * V, and
   the softmax mass of each page summed over the G heads into part[b, h, c]; after the tasks,
   page_mass[rows[b], c] = sum over h of part[b, h, c] / Hq.

   fp32 K and V where the blocked path below is not taken (one or two query heads a KV head; or heads
   not a multiple of 32 values wide, up to 8 query heads a KV head) go in
   ONE pass instead (one_pass: online softmax a page at a time, each record's K and V rows read
   together): the long workload's decode attention inside the engine's steps 0.54-0.82 -> 0.41-0.43
   ms a layer, the whole fp32 run 1.04x (2026-12-05; the two passes were as fast only in a loop of
   nothing but attention calls - between a step's other work, every K row then every V row of
   records kilobytes apart missed far more).

   Where a KV head serves several query heads (grouped-query attention) and heads are a multiple of
   32 values wide, keys go KB at a time: each block's K and V rows copied (bf16: widened) once into
   a contiguous block the G heads read, the scores of KB keys summed by one transposing sum
   (hsum8) instead of one horizontal sum per key and head; else key by key.

   kvl_paged_decode_bf16_amx (below, where the compiler targets AMX): the bf16 kernel's outputs with
   its products on AMX tiles, kept at fp32 accuracy by splitting queries and probabilities into bf16
   hi + lo; the Python side tries it first and runs kvl_paged_decode_bf16 where it declines.

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

/* the exported kernels' parameter list (the C ABI engine/kernels/__init__.py declares), and its names */
#define DECODE_PARAMS(kv_t)                                                                                       \
    const float *q, int64_t q_tok_stride, const int64_t *toks, const kv_t *kv, const int64_t *pages,              \
    const int64_t *seq_lens, int64_t Bd, int64_t Cd, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,                \
    int64_t page_stride, int64_t rec_stride, int64_t k_off, int64_t v_off, float scale, float *out,               \
    int64_t out_tok_stride, float *part, float *page_mass, const int64_t *rows, int64_t mass_row_stride,          \
    int nthreads
#define DECODE_ARGS q, q_tok_stride, toks, kv, pages, seq_lens, Bd, Cd, S, Hq, Hkv, D, page_stride, rec_stride,    \
    k_off, v_off, scale, out, out_tok_stride, part, page_mass, rows, mass_row_stride, nthreads

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

/* every line the row touches, into L2 (prefetcht1, not t0): a prefetch into L1 holds one of L1's few miss
   buffers until its line arrives, which capped the lines in flight - fp32 rows a record apart came out of
   memory at about 7 GB/s on one thread, 12-14 GB/s this way (bench/decode_prefetch.py on an AMD EPYC of
   the Zen 4 kind, 2026-12-07: the long workload's fp32 decode attention, 4 layers of 12 K keys, 1.7-1.8x
   at one and at two threads; with the blocked path's rows 3 blocks ahead, bf16 long's 1.6-2.2x and fp32
   big's 1.5-1.6x; tiny's, in cache: fp32 1.1-1.2x, bf16 0.94-0.95x) */
#ifndef KVL_PF_LOCALITY
#define KVL_PF_LOCALITY 2   /* __builtin_prefetch's locality: 2 prefetcht1 (L2), 3 prefetcht0 (L1: the bench's "before") */
#endif
static inline void prefetch_row(const void *p, int64_t bytes) {
    const char *line = (const char *)((uintptr_t)p & ~(uintptr_t)63), *end = (const char *)p + bytes;
    for (; line < end; line += 64) __builtin_prefetch(line, 0, KVL_PF_LOCALITY);
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

/* acc[0:D] += sum_i w[i] * rows[i][0:D]: 64 columns at a time held in eight vector registers over
   all the keys (not loaded and stored back once per key) */
static inline __attribute__((always_inline)) void add_weighted_rows(const float *w, const void *const *rows, int64_t n,
                                                                     int64_t D, float *restrict acc, int bf16) {
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) {
        v8 a0 = ld8(acc + c), a1 = ld8(acc + c + 8), a2 = ld8(acc + c + 16), a3 = ld8(acc + c + 24);
        v8 a4 = ld8(acc + c + 32), a5 = ld8(acc + c + 40), a6 = ld8(acc + c + 48), a7 = ld8(acc + c + 56);
        for (int64_t i = 0; i < n; i++) {
            const void *r = rows[i];
            const v8 x = {w[i], w[i], w[i], w[i], w[i], w[i], w[i], w[i]};
            a0 += x * ldkv(r, c, bf16); a1 += x * ldkv(r, c + 8, bf16);
            a2 += x * ldkv(r, c + 16, bf16); a3 += x * ldkv(r, c + 24, bf16);
            a4 += x * ldkv(r, c + 32, bf16); a5 += x * ldkv(r, c + 40, bf16);
            a6 += x * ldkv(r, c + 48, bf16); a7 += x * ldkv(r, c + 56, bf16);
        }
        st8(acc + c, a0); st8(acc + c + 8, a1); st8(acc + c + 16, a2); st8(acc + c + 24, a3);
        st8(acc + c + 32, a4); st8(acc + c + 40, a5); st8(acc + c + 48, a6); st8(acc + c + 56, a7);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = c; d < D; d++) acc[d] += w[i] * kv1(rows[i], d, bf16);
}

/* o[0:D] = sum_i p[i] * rows[i][0:D] */
static inline __attribute__((always_inline)) void weighted_rows(const float *p, const void *const *rows, int64_t n,
                                                                 int64_t D, float *restrict o, int bf16) {
    memset(o, 0, sizeof(float) * D);
    add_weighted_rows(p, rows, n, D, o, bf16);
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
#ifndef KVL_BPF
#define KVL_BPF 3       /* blocks ahead whose rows the blocked path prefetches (1 before: bench/decode_prefetch.py) */
#endif
#define BPF KVL_BPF
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

/* scale * (q . r[j]) for the KB rows r[j] of D fp32 values (D % 8 == 0), as one vector: a chain of
   products per key, then one transposing sum (hsum8) for the KB keys */
static inline __attribute__((always_inline)) v8 block_dots(const float *q, const float *const *r, int64_t D,
                                                           float scale) {
    v8 a[KB] = {{0}};
    for (int64_t c = 0; c < D; c += 8) {
        const v8 qv = ld8(q + c);
        for (int j = 0; j < KB; j++) a[j] += qv * ld8(r[j] + c);
    }
    return hsum8(a) * scale;
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
        for (int64_t j = 0; j < KB && i0 + BPF * KB + j < n; j++) prefetch_row(krow[i0 + BPF * KB + j], D * es);
        block_rows(krow + i0, nb, D, buf, zero, r, bf16);
        for (int64_t g = 0; g < G; g++) {
            const v8 s = block_dots(qb + g * D, r, D, scale);
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
        for (int64_t j = 0; j < KB && i0 + BPF * KB + j < n; j++) prefetch_row(vrow[i0 + BPF * KB + j], D * es);
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

/* a task's start: its keys (at most its pages'), its page-mass row zeroed, its output rows; a task
   with no keys gets zero outputs (returns 0) */
static inline __attribute__((always_inline)) int64_t task_start(const int64_t *seq_lens, int64_t b, int64_t h,
                                                                int64_t Cd, int64_t S, int64_t Hkv, int64_t G,
                                                                int64_t D, float *part, float *out,
                                                                const int64_t *toks, int64_t out_tok_stride,
                                                                float **part_b, float **o) {
    int64_t n = seq_lens[b];
    if (n > Cd * S) n = Cd * S;
    *part_b = part + (b * Hkv + h) * Cd;
    memset(*part_b, 0, sizeof(float) * Cd);
    *o = out + toks[b] * out_tok_stride + h * G * D;
    if (n <= 0) memset(*o, 0, sizeof(float) * G * D);
    return n;
}

/* one query head's scores s[0, n) to probabilities in place, and their sum over each page added to
   part_b (this KV head's mass on each page) */
static inline __attribute__((always_inline)) void softmax_mass(float *s, int64_t n, int64_t S, float *part_b) {
    const float m = row_max(s, n);
    for (int64_t i = 0; i < n; i++) s[i] = kvl_exp(s[i] - m);     /* (vectorizes: vexp.h) */
    const float inv = 1.f / row_sum(s, n);
    for (int64_t i = 0; i < n; i++) s[i] *= inv;
    for (int64_t c = 0, i = 0; i < n; c++) {       /* a head's row at a time: contiguous */
        const int64_t e = i + S < n ? i + S : n;
        float mm = 0.f;
        for (; i < e; i++) mm += s[i];
        part_b[c] += mm;
    }
}

/* page_mass[rows[b], c] = the mean over the Hq query heads of the tasks' part rows */
static inline void mass_rows(const float *part, float *page_mass, const int64_t *rows, int64_t mass_row_stride,
                             int64_t Bd, int64_t Cd, int64_t Hq, int64_t Hkv) {
    for (int64_t b = 0; b < Bd; b++) {
        float *pm = page_mass + rows[b] * mass_row_stride;
        for (int64_t c = 0; c < Cd; c++) {
            float s = 0.f;
            for (int64_t h = 0; h < Hkv; h++) s += part[(b * Hkv + h) * Cd + c];
            pm[c] = s / (float)Hq;
        }
    }
}

#ifndef KVL_PFF
#define KVL_PFF 32      /* keys ahead whose K and V rows the one-pass path prefetches (16 before: the bench) */
#endif
#define PFF KVL_PFF

/* s[g * 64 + j] = scale * q_g . K_j for nk keys (of a page: up to 64) and the G heads: 8 keys at a time
   read straight out of their records (no copy: a page's rows are read once a head, the second time
   from L1), their 8 dots summed by one transposing sum (hsum8) instead of a horizontal sum a key and
   head; fp32 rows of a multiple of 8 values (else, and for a page's last nk % 8 keys, key by key) */
static inline __attribute__((always_inline)) void page_scores(const float *qb, const void *const *krow, int64_t nk,
                                                               int64_t G, int64_t D, float scale, float *s, int bf16) {
    int64_t j0 = 0;
    if (!bf16 && D % 8 == 0)
        for (; j0 + KB <= nk; j0 += KB) {
            const float *r[KB];
            for (int j = 0; j < KB; j++) r[j] = (const float *)krow[j0 + j];
            for (int64_t g = 0; g < G; g++) st8(s + g * 64 + j0, block_dots(qb + g * D, r, D, scale));
        }
    for (; j0 < nk; j0++)
        for (int64_t g = 0; g < G; g++) s[g * 64 + j0] = dot(qb + g * D, krow[j0], D, bf16) * scale;
}

/* One task's attention in ONE pass over its keys, a page at a time (online softmax): each key's K
   and V rows are read together - both in the same slot record - instead of every K row and then
   every V row (two passes over records kilobytes apart). Per page c and head g: the page's scores,
   their max m[g, c] and l[g, c] = sum exp(s - m[g, c]); the output accumulates exp(s - M) V with M
   the running max (rescaled when it grows); at the end Z = sum_c l exp(m - M), out = acc / Z and
   the page's softmax mass l exp(m - M) / Z - the two-pass numbers up to float rounding order.
   ml: 2 G C floats of scratch (C = pages of the task's keys). */
static inline __attribute__((always_inline)) void one_pass(const float *qb, const void *const *krow,
                                                            const void *const *vrow, int64_t n, int64_t S, int64_t G,
                                                            int64_t D, float scale, float *o, float *part_b,
                                                            float *ml, int64_t es, int bf16) {
    const int64_t C = (n + S - 1) / S;
    float *mc = ml, *lc = ml + G * C;
    float M[8], s[8 * 64], w[64];
    for (int64_t g = 0; g < G; g++) M[g] = -INFINITY;
    memset(o, 0, sizeof(float) * G * D);
    for (int64_t i = 0; i < PFF && i < n; i++) { prefetch_row(krow[i], D * es); prefetch_row(vrow[i], D * es); }
    for (int64_t c = 0, i0 = 0; i0 < n; c++, i0 += S) {
        const int64_t nk = n - i0 < S ? n - i0 : S;
#ifdef KVL_SCORES_KEYWISE       /* key by key, as before the fifty-fourth session (bench/decode_prefetch.py) */
        for (int64_t j = 0; j < nk; j++) {
            const int64_t ahead = i0 + j + PFF;
            if (ahead < n) { prefetch_row(krow[ahead], D * es); prefetch_row(vrow[ahead], D * es); }
            for (int64_t g = 0; g < G; g++) s[g * 64 + j] = dot(qb + g * D, krow[i0 + j], D, bf16) * scale;
        }
#else
        for (int64_t j0 = 0; j0 < nk; j0 += KB) {      /* the prefetches spread between the blocks' products */
            const int64_t nb = nk - j0 < KB ? nk - j0 : KB;
            for (int64_t j = j0; j < j0 + nb; j++) {
                const int64_t ahead = i0 + j + PFF;
                if (ahead < n) { prefetch_row(krow[ahead], D * es); prefetch_row(vrow[ahead], D * es); }
            }
            page_scores(qb, krow + i0 + j0, nb, G, D, scale, s + j0, bf16);
        }
#endif
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + g * 64, m = -INFINITY, l = 0.f;
            for (int64_t j = 0; j < nk; j++) m = sg[j] > m ? sg[j] : m;
            for (int64_t j = 0; j < nk; j++) { sg[j] = kvl_exp(sg[j] - m); l += sg[j]; }
            mc[g * C + c] = m;
            lc[g * C + c] = l;
            float f = 1.f;
            float *acc = o + g * D;
            if (m > M[g]) {                         /* a new running max: what is accumulated scales down */
                const float down = kvl_exp(M[g] - m);
                for (int64_t d = 0; d < D; d++) acc[d] *= down;
                M[g] = m;
            } else {
                f = kvl_exp(m - M[g]);
            }
            for (int64_t j = 0; j < nk; j++) w[j] = sg[j] * f;
            add_weighted_rows(w, vrow + i0, nk, D, acc, bf16);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float z = 0.f;
        for (int64_t c = 0; c < C; c++) z += lc[g * C + c] * kvl_exp(mc[g * C + c] - M[g]);
        const float inv = 1.f / z;
        float *acc = o + g * D;
        for (int64_t d = 0; d < D; d++) acc[d] *= inv;
        for (int64_t c = 0; c < C; c++) part_b[c] += lc[g * C + c] * kvl_exp(mc[g * C + c] - M[g]) * inv;
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
        float *part_b, *o;
        const int64_t n = task_start(seq_lens, b, h, Cd, S, Hkv, G, D, part, out, toks, out_tok_stride, &part_b, &o);
        if (n <= 0) continue;
        /* scores [G, n], then the K and V row of each key (slot records are kilobytes apart) */
        const int64_t C = (n + S - 1) / S;
        float *sc = malloc(sizeof(float) * (G * n + 2 * G * C + 2) + 2 * sizeof(float *) * n);
        if (!sc) { failed = 1; continue; }
        const void **krow = (const void **)(sc + ((G * n + 2 * G * C + 2) & ~(int64_t)1)), **vrow = krow + n;
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
           1-2 fp32 heads the per-key path was as fast or faster - and one pass faster still) */
        const int blocked = D % 32 == 0 && D <= DMAX && (G >= 3 || (bf16 && G >= 2));
        if (!blocked && !bf16 && G <= 8 && S <= 64) {     /* fp32, few heads a KV head: one pass */
            one_pass(qb, krow, vrow, n, S, G, D, scale, o, part_b, sc + G * n, es, bf16);
            free(sc);
            continue;
        }
        if (blocked) blocked_scores(qb, krow, n, G, D, scale, sc, es, bf16);
        else for (int64_t i = 0; i < n; i++) {     /* scores: each K row read once for the G heads */
            /* the next rows are a record stride away, where the hardware prefetcher does not go */
            if (i + PF < n) prefetch_row(krow[i + PF], D * es);
            for (int64_t g = 0; g < G; g++) sc[g * n + i] = dot(qb + g * D, krow[i], D, bf16) * scale;
        }
        for (int64_t g = 0; g < G; g++) softmax_mass(sc + g * n, n, S, part_b);    /* per query head */
        for (int64_t i = 0; i < PF && i < n; i++) prefetch_row(vrow[i], D * es);
        if (blocked) {                             /* out = P V, the G heads' rows side by side in o */
            blocked_values(sc, vrow, n, G, D, o, es, bf16);
        } else {
            for (int64_t g = 0; g < G; g++)        /* out = P V per query head */
                weighted_rows(sc + g * n, vrow, n, D, o + g * D, bf16);
        }
        free(sc);
    }
    if (failed) return 1;
    mass_rows(part, page_mass, rows, mass_row_stride, Bd, Cd, Hq, Hkv);
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include "amx.h"

/* The bf16 decode on AMX tiles: the same outputs as kvl_paged_decode_bf16 (scores, two-pass softmax,
   out = P V, page mass: the code after the scores is that kernel's), the products on TDPBF16PS
   instead of widened vector FMAs.

   bf16 products keep fp32 accuracy: a query (or a probability) is split into hi = bf16(x) and
   lo = bf16(x - hi), whose sum is x to ~16 significant bits; K and V are bf16 already, so
   K hi + K lo (and P V likewise) is fp32 work up to the rounding of lo (2^-17 of x) - not the
   2^-9 of one bf16 rounding.
   - Scores, one tile of 16 keys (16 slots of one page: a tile's rows read straight out of the
     records at the record stride, no copy): S[16 keys, G heads] += K[16, 32 dims] Q^T, with Q^T's hi
     and then its lo half as the B operand (tile 6 accumulates both); each head's 16 scores gathered
     out of the stored tile.
   - Values, 32 keys a block: O[2G rows, 16 dims] += P[2G, 32 keys] V[32 keys, 16 dims], P's rows
     each head's hi and lo probabilities; V's B operand is two keys' rows interleaved (the records
     hold a key's dims side by side, the tile wants key pairs), copied once per block; keys past the
     request's last are zero there (a page's unused slots may hold anything). Four 16-dim output
     tiles at a time (tiles 0-3); heads wider than 64 dims go over the keys again per 64 dims.
   Tiles: 0-3 O (2G rows), 4 P (2G rows), 5 Q^T or V (16 rows), 6 S (16 rows), 7 K (16 rows).
   Takes head_dim a multiple of 32 up to 256, at most 8 query heads a KV head, pages a multiple of
   16 slots; returns -1 (nothing written) otherwise or without AMX, 1 when an allocation failed. */
static const int32_t ZIP[16] = {0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f};

/* 32 floats x0 (first 16), x1 as bf16 pairs hi = bf16(x) and lo = bf16(x - hi), in order */
static inline __attribute__((always_inline)) void split_bf16(__m512 x0, __m512 x1, __m512i *hi, __m512i *lo) {
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    const __m512 w0 = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16);
    const __m512 w1 = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16);
    *hi = h;
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, w1), _mm512_sub_ps(x0, w0));
}

int kvl_paged_decode_bf16_amx(DECODE_PARAMS(uint16_t)) {
    if (D % 32 || D > DMAX || Hq % Hkv || Hq / Hkv > 8 || S % 16 || !amx_granted()) return -1;
    const int64_t G = Hq / Hkv, ns = D / 32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        tile_config saved;
        const uint8_t trows[8] = {2 * G, 2 * G, 2 * G, 2 * G, 2 * G, 16, 16, 16};
        tiles_set(&saved, trows);
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);       /* FTZ | DAZ on this thread (paged_prefill.c), put back after */
        const __m512i zip = _mm512_loadu_si512(ZIP);
        const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(16));
        uint32_t qt[2][DMAX / 32][16 * 16] __attribute__((aligned(64)));   /* Q^T hi, lo: [chunk][pair][head] */
        uint16_t vb[4][16 * 32] __attribute__((aligned(64)));              /* V key pairs, 4 x 16 dims */
        float st[16 * 16] __attribute__((aligned(64)));
        float ot[4][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < Bd * Hkv; t++) {
            const int64_t b = t / Hkv, h = t % Hkv;
            float *part_b, *o;
            const int64_t n = task_start(seq_lens, b, h, Cd, S, Hkv, G, D, part, out, toks, out_tok_stride, &part_b, &o);
            if (n <= 0) continue;
            const int64_t nblk = (n + 31) / 32;
            /* scores [G, n], then P's tiles [block][2G rows][32 keys] */
            float *sc = malloc(sizeof(float) * G * (n + 32) + sizeof(uint16_t) * nblk * 2 * G * 32 + 64);
            if (!sc) { failed = 1; continue; }
            uint16_t *pa = (uint16_t *)(((uintptr_t)(sc + G * (n + 32)) + 63) & ~(uintptr_t)63);
            /* Q^T: column g of chunk s, pair p = (q[32 s + 2 p], q[32 s + 2 p + 1]) of head g, hi and lo */
            memset(qt, 0, sizeof(uint32_t) * 2 * ns * 256);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + toks[b] * q_tok_stride + (h * G + g) * D;
                for (int64_t s = 0; s < ns; s++) {
                    __m512i hi, lo;
                    split_bf16(_mm512_loadu_ps(qg + 32 * s), _mm512_loadu_ps(qg + 32 * s + 16), &hi, &lo);
                    uint32_t h32[16], l32[16];
                    _mm512_storeu_si512(h32, hi);
                    _mm512_storeu_si512(l32, lo);
                    for (int p = 0; p < 16; p++) {
                        qt[0][s][p * 16 + g] = h32[p];
                        qt[1][s][p * 16 + g] = l32[p];
                    }
                }
            }
            const __m512 vscale = _mm512_set1_ps(scale);
            for (int64_t k0 = 0; k0 < n; k0 += 16) {
                const uint16_t *kr = kv + pages[b * Cd + k0 / S] * page_stride + (k0 % S) * rec_stride + h * D + k_off;
                if (k0 + 16 < n) {         /* the next tile's K rows (a record apart: no hardware prefetch) */
                    const char *nk = (const char *)(kv + pages[b * Cd + (k0 + 16) / S] * page_stride
                                                    + ((k0 + 16) % S) * rec_stride + h * D + k_off);
                    for (int r = 0; r < 16; r++)    /* the lines of the row (two at 64 dims: the pool's rows are line-aligned) */
                        prefetch_row(nk + r * rec_stride * 2, D * 2);
                }
                _tile_zero(6);
                for (int64_t s = 0; s < ns; s++) {
                    _tile_loadd(7, kr + 32 * s, rec_stride * 2);
                    _tile_loadd(5, qt[0][s], 64);
                    _tile_dpbf16ps(6, 7, 5);
                    _tile_loadd(5, qt[1][s], 64);
                    _tile_dpbf16ps(6, 7, 5);
                }
                _tile_stored(6, st, 64);
                for (int64_t g = 0; g < G; g++)     /* sc has 32 floats of room past n per head */
                    _mm512_storeu_ps(sc + g * (n + 32) + k0,
                                     _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)g)),
                                                                       st, 4), vscale));
            }
            for (int64_t g = 0; g < G; g++) {          /* softmax per query head (kvl_paged_decode's) */
                float *s = sc + g * (n + 32);
                softmax_mass(s, n, S, part_b);
                for (int64_t i = n; i < nblk * 32; i++) s[i] = 0.f;
                for (int64_t k = 0; k < nblk; k++) {    /* P's rows 2g (hi) and 2g + 1 (lo) of each block */
                    __m512i hi, lo;
                    split_bf16(_mm512_loadu_ps(s + 32 * k), _mm512_loadu_ps(s + 32 * k + 16), &hi, &lo);
                    uint16_t *row = pa + (k * 2 * G + 2 * g) * 32;
                    _mm512_store_si512(row, hi);
                    _mm512_store_si512(row + 32, lo);
                }
            }
            for (int64_t d0 = 0; d0 < D; d0 += 64) {   /* O = P V, 64 dims (four tiles) at a time */
                const int64_t nc = D - d0 < 64 ? (D - d0) / 16 : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t k = 0; k < nblk; k++) {
                    /* the block's two 16-key halves each lie in one page (S a multiple of 16) */
                    const uint16_t *half[2];
                    for (int64_t e = 0; e < 2; e++) {
                        const int64_t i = 32 * k + 16 * e;
                        half[e] = i < n ? kv + pages[b * Cd + i / S] * page_stride + (i % S) * rec_stride
                                          + h * D + v_off + d0 : NULL;
                    }
                    for (int64_t r = 0; r < 16; r++) {  /* keys 32k + 2r, 32k + 2r + 1, interleaved */
                        const int64_t i = 32 * k + 2 * r, j = (2 * r) & 15;
                        const uint16_t *va = i < n ? half[r >> 3] + j * rec_stride : NULL;
                        const uint16_t *vz = i + 1 < n ? half[r >> 3] + (j + 1) * rec_stride : NULL;
                        for (int64_t c = 0; c < nc; c++) {
                            const __m256i a = va ? _mm256_loadu_si256((const __m256i *)(va + 16 * c)) : _mm256_setzero_si256();
                            const __m256i z = vz ? _mm256_loadu_si256((const __m256i *)(vz + 16 * c)) : _mm256_setzero_si256();
                            _mm512_store_si512(vb[c] + r * 32, _mm512_permutexvar_epi16(
                                zip, _mm512_inserti64x4(_mm512_castsi256_si512(a), z, 1)));
                        }
                    }
                    _tile_loadd(4, pa + k * 2 * G * 32, 64);
                    _tile_loadd(5, vb[0], 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(5, vb[1], 64);
                    _tile_dpbf16ps(1, 4, 5);
                    if (nc > 2) {
                        _tile_loadd(5, vb[2], 64);
                        _tile_dpbf16ps(2, 4, 5);
                        _tile_loadd(5, vb[3], 64);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, ot[0], 64);
                _tile_stored(1, ot[1], 64);
                _tile_stored(2, ot[2], 64);
                _tile_stored(3, ot[3], 64);
                for (int64_t g = 0; g < G; g++)
                    for (int64_t c = 0; c < nc; c++)
                        _mm512_storeu_ps(o + g * D + d0 + 16 * c, _mm512_add_ps(_mm512_load_ps(ot[c] + 2 * g * 16),
                                                                               _mm512_load_ps(ot[c] + (2 * g + 1) * 16)));
            }
            free(sc);
        }
        _mm_setcsr(csr);
        tiles_off(&saved);
    }
    if (failed) return 1;
    mass_rows(part, page_mass, rows, mass_row_stride, Bd, Cd, Hq, Hkv);
    return 0;
}

#else

int kvl_paged_decode_bf16_amx(DECODE_PARAMS(uint16_t)) {
    (void)q; (void)q_tok_stride; (void)toks; (void)kv; (void)pages; (void)seq_lens; (void)Bd; (void)Cd; (void)S;
    (void)Hq; (void)Hkv; (void)D; (void)page_stride; (void)rec_stride; (void)k_off; (void)v_off; (void)scale;
    (void)out; (void)out_tok_stride; (void)part; (void)page_mass; (void)rows; (void)mass_row_stride; (void)nthreads;
    return -1;              /* no AMX in this build: kvl_paged_decode_bf16 */
}

#endif

int kvl_paged_decode_f32(DECODE_PARAMS(float)) { return paged_decode(DECODE_ARGS, 0); }

int kvl_paged_decode_bf16(DECODE_PARAMS(uint16_t)) { return paged_decode(DECODE_ARGS, 1); }
