/* The page ledger's read runs (telemetry/ledger.py ReadRuns.add) folded in one pass over a batch
   of steps' reads, in C: the numpy fold is a few dozen array operations over every read cell, each
   copying its 4 + page_size int64 fields (found writers per slot) - about 250 ns a cell on the
   writer thread, whose CPU the engine loses even from another core. Here a cell is compared with
   its (reader, column)'s run where the data lies: no copy, no gather. ctypes drops the GIL for the
   call. ReadRuns.add's numpy path stays the reference (tests/test_telemetry.py folds every batch
   both ways and compares the rows and their order).

   State (the caller's, updated in place): I [R, W, K + 10] int64 - a run as its last read: page,
   generation, found generation, bad mask, writers[S] (-1 past the slots it read), then SR, SF, SL,
   LF, LL, N, TF, TL, SB, LK (telemetry/ledger.py names them) - mass [R, W] float64, open [R, W].
   A read links to its (reader, column)'s run when it found the same page, generation, found
   generation and failing slots and either the same slots with the same writer in each, or one slot
   more with the others as before; a run links one way only (LK: how its last read linked). A read
   that does not link closes the run: its row goes out (rows, rc, mass, kind: 0 a run open before
   this batch, 1 one opened in it - the caller orders them as the numpy fold does).

   Masses: a run's reads of this batch are summed in order, then added to what it held before the
   batch (numpy sums a segment pairwise: sums of more than 8 reads may differ in the last bits). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int64_t kvl_fold_reads(int64_t nsteps, const int64_t *Bs, const int64_t *Cs, const int64_t *step,
                       const int64_t *lclock, const int64_t *ts, const int64_t *rows, const int64_t *page,
                       const int64_t *egen, const int64_t *sr, const int64_t *fgen, const int64_t *mask,
                       const double *mass, const int64_t *fw_ptrs, int64_t S, int64_t R, int64_t W,
                       int64_t *I, double *smass, uint8_t *open, int64_t *out_rows, int64_t *out_rc,
                       double *out_mass, int64_t *out_kind, int64_t cap) {
    const int64_t K = 4 + S, F = K + 10;
    const int64_t SR = K, SF = K + 1, SL = K + 2, LF = K + 3, LL = K + 4, N = K + 5, TF = K + 6, TL = K + 7,
                  SB = K + 8, LK = K + 9;
    /* per (reader, column), this batch: seen, whether its run went on from before the batch (base:
       the mass it held then), and the mass of this batch's reads of the run */
    uint8_t *seen = calloc((size_t)(R * W), 1), *ext = calloc((size_t)(R * W), 1);
    double *base = malloc(sizeof(double) * (size_t)(R * W)), *acc = malloc(sizeof(double) * (size_t)(R * W));
    int64_t out = 0, cell = 0, row = 0;
    if (!seen || !ext || !base || !acc) {
        free(seen); free(ext); free(base); free(acc);
        return -1;
    }
    for (int64_t t = 0; t < nsteps; t++) {
        const int64_t B = Bs[t], C = Cs[t];
        const int64_t *fw = (const int64_t *)(intptr_t)fw_ptrs[t];
        for (int64_t b = 0; b < B; b++, row++) {
            const int64_t r = rows[row];
            for (int64_t c = 0; c < C; c++, cell++) {
                const int64_t n = sr[cell];
                if (page[cell] < 0 || n <= 0)
                    continue;
                const int64_t rc = r * W + c;
                int64_t *st = I + rc * F;
                const int64_t *w = fw + (b * C + c) * S;
                const double m = mass[cell];
                const int first = !seen[rc];
                int link = 0, more = 0;
                int64_t before = 0;
                if (open[rc]) {         /* the run open here: this batch's last read of it, or from before */
                    const int64_t psr = st[SR], d = n - psr;
                    link = (d == 0 || d == 1) && st[0] == page[cell] && st[1] == egen[cell] && st[2] == fgen[cell]
                           && st[3] == mask[cell];
                    for (int64_t s = 0; link && s < psr; s++)
                        link = st[4 + s] == w[s];
                    more = d == 1;
                    before = st[LK];
                }
                const int64_t lk = link ? 1 + more : 0;
                if (!link || (before != 0 && lk != before)) {
                    if (open[rc]) {     /* the run closes */
                        if (out >= cap) {
                            out = -2;
                            goto done;
                        }
                        memcpy(out_rows + out * F, st, sizeof(int64_t) * (size_t)F);
                        out_rc[2 * out] = r;
                        out_rc[2 * out + 1] = c;
                        out_mass[out] = first ? smass[rc] : (ext[rc] ? acc[rc] + base[rc] : acc[rc]);
                        out_kind[out] = first ? 0 : 1;
                        out++;
                    }
                    st[0] = page[cell]; st[1] = egen[cell]; st[2] = fgen[cell]; st[3] = mask[cell];
                    st[SF] = step[t]; st[LF] = lclock[t]; st[TF] = ts[t]; st[SB] = n; st[N] = 1;
                    ext[rc] = 0;
                    acc[rc] = m;
                    open[rc] = 1;
                } else {                /* the run goes on */
                    st[N] += 1;
                    if (first) {
                        ext[rc] = 1;
                        base[rc] = smass[rc];
                        acc[rc] = m;
                    } else {
                        acc[rc] += m;
                    }
                }
                for (int64_t s = 0; s < S; s++)
                    st[4 + s] = s < n ? w[s] : -1;
                st[SR] = n; st[SL] = step[t]; st[LL] = lclock[t]; st[TL] = ts[t]; st[LK] = lk;
                seen[rc] = 1;
            }
        }
    }
    for (int64_t rc = 0; rc < R * W; rc++)      /* every run this batch touched holds its mass */
        if (seen[rc])
            smass[rc] = ext[rc] ? acc[rc] + base[rc] : acc[rc];
done:
    free(seen); free(ext); free(base); free(acc);
    return out;
}
