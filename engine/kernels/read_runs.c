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

/* The exposure index's reads of a fold (telemetry/ledger.py PageLedger._index_fold): every
   (page, generation, reader) its cells read - a page in the block table, slots read - once each,
   in first-read order (the index's holdings: who held which page in which generation), and the
   cells whose read failed the check (bad mask set), in cell order. numpy found the holdings with a
   lexsort of every read cell (a decode step re-reads all of its sequences' pages); here a hash set
   sized by the holdings, not the cells (a fold of 65,536 decode cells holds a few hundred: a table
   of 2 x cells was 1 MiB, zeroed each fold and missed in cache at every probe), doubled past half full.
   Cells: the rows' block-table cells concatenated, row r's row_cells[r] of them read by
   row_reader[r]. out_hold: [cap, 3], out_bad: [cap]. Returns the holdings' count (the failing
   cells' in *n_bad), -1 where the set's memory was not given. */
static inline uint64_t mix3(int64_t a, int64_t b, int64_t c) {
    uint64_t h = (uint64_t)a * 0x9E3779B97F4A7C15ULL;
    h ^= (uint64_t)b + 0x632BE59BD9B4E019ULL + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= (uint64_t)c + 0x94D049BB133111EBULL + (h << 6) + (h >> 2);
    h ^= h >> 31;
    return h * 0x94D049BB133111EBULL;
}

/* Doubles the holdings' set (slot: index into out_hold + 1; 0: empty) and puts the nh held back in. */
static int64_t *grow_set(int64_t *slot, size_t *size, const int64_t *out_hold, int64_t nh) {
    size_t ns = *size * 2;
    int64_t *n = calloc(ns, sizeof(int64_t));
    if (!n) return NULL;
    for (int64_t k = 0; k < nh; k++) {
        const int64_t *t = out_hold + 3 * k;
        size_t h = (size_t)mix3(t[0], t[1], t[2]) & (ns - 1);
        while (n[h]) h = (h + 1) & (ns - 1);
        n[h] = k + 1;
    }
    free(slot);
    *size = ns;
    return n;
}

int64_t kvl_index_reads(int64_t nrows, const int64_t *row_cells, const int64_t *row_reader, const int64_t *page,
                        const int64_t *gen, const int64_t *sr, const int64_t *bad, int64_t *out_hold,
                        int64_t *out_bad, int64_t *n_bad, int64_t cap) {
    size_t size = 1024;
    int64_t *slot = calloc(size, sizeof(int64_t));        /* index into out_hold + 1; 0: empty */
    if (!slot) return -1;
    int64_t nh = 0, nb = 0, i = 0;
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t reader = row_reader[r];
        for (int64_t e = i + row_cells[r]; i < e; i++) {
            if (page[i] < 0 || sr[i] <= 0) continue;
            if (bad[i] != 0 && nb < cap) out_bad[nb++] = i;
            size_t h = (size_t)mix3(page[i], gen[i], reader) & (size - 1);
            for (;;) {
                int64_t s = slot[h];
                if (s == 0) {
                    if (nh < cap) {
                        out_hold[3 * nh] = page[i]; out_hold[3 * nh + 1] = gen[i]; out_hold[3 * nh + 2] = reader;
                        slot[h] = ++nh;
                        if ((size_t)(2 * nh) >= size) {
                            int64_t *more = grow_set(slot, &size, out_hold, nh);
                            if (!more) { free(slot); return -1; }
                            slot = more;
                        }
                    }
                    break;
                }
                const int64_t *t = out_hold + 3 * (s - 1);
                if (t[0] == page[i] && t[1] == gen[i] && t[2] == reader) break;
                h = (h + 1) & (size - 1);
            }
        }
    }
    free(slot);
    *n_bad = nb;
    return nh;
}
