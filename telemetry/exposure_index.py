"""The exposure index: the slot-level as-of join of ``forensics/sql/exposure_slots.sql``, computed by
the ledger writer as it folds each batch of steps, from the same rows it writes.

For every read that failed the check, and every failing slot of it, the last write the ledger
recorded in that slot at or before the read is its donor - exactly what the join finds, found here
from a dense "last write per slot" state instead of a scan of the whole ledger. The state is kept
per node on the writer thread (one entry per pool slot: its last write's clock, writer,
generation, path, time and position), the writes of a fold are applied in clock order after the
fold's reads have been answered (a read sees the fold's own writes up to its clock: the step that
writes a token reads it), and the holdings (who read which page in which generation) decide
co-holder against foreign as the join's ``holders`` does.

Rows (schema.sql ``exposure_index``): one per (group of failing reads, write found in some of their
failing slots). A group is the reads of one fold that share (reader, page, generation, block
column, found generation, failing slots, epoch), the epoch being the clock of the last write to any
of the failing slots at or before the read - the join's runs and its cuts, so that grouping the
index's rows by the same key across folds gives the join's runs. Columns in, columns out: a fold
is a fixed number of array operations, however many reads it holds.
"""
from __future__ import annotations

import numpy as np

from telemetry.store import Coded, Columns

PATHS = ("prefill", "decode", "transfer_landing", "offload", "reload")
PATH_CODE = {p: i for i, p in enumerate(PATHS)}
HOLDINGS_CAP = 1 << 21          # (page, generation, reader) triples kept per node; the oldest half goes past it


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(a, axis=0, return_inverse=True) for an int64 [n, k] array, by one lexsort of its
    columns (np.unique's axis=0 sorts rows as opaque bytes: many times slower)."""
    if not len(a):
        return a, np.zeros(0, dtype=np.int64)
    order = np.lexsort(a.T[::-1])
    s = a[order]
    new = np.ones(len(s), dtype=bool)
    new[1:] = (s[1:] != s[:-1]).any(axis=1)
    inv = np.empty(len(a), dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return s[new], inv


class Writes:
    """Per-slot writes of one fold on one node, as flat columns (one entry per slot written)."""
    __slots__ = ("lc", "page", "off", "gen", "writer", "pos", "path", "ts")

    def __init__(self, lc, page, off, gen, writer, pos, path, ts):
        n = len(page)
        as64 = lambda a: np.broadcast_to(np.asarray(a, dtype=np.int64), (n,))  # noqa: E731
        self.lc, self.page, self.off, self.gen = as64(lc), as64(page), as64(off), as64(gen)
        self.writer, self.pos, self.path, self.ts = as64(writer), as64(pos), as64(path), as64(ts)

    @staticmethod
    def concat(parts: "list[Writes]") -> "Writes":
        return Writes(*(np.concatenate([getattr(p, f) for p in parts]) for f in Writes.__slots__))


class Reads(dict):
    """The failing read cells of one fold on one node (one entry per (read, page)): reader, page,
    generation, found_generation, block_index, bad_mask, slots_read, step, lclock, ts (int64
    arrays), mass (float64), ids (one (trace id, span id) per cell)."""


class _LastWrite:
    """The last write recorded in every slot of one node's pool (grows with the pages seen)."""
    FIELDS = ("lc", "writer", "gen", "path", "ts", "pos")

    def __init__(self, page_size: int):
        self.S = page_size
        self.a = {f: np.full(0, -1, dtype=np.int64) for f in self.FIELDS}

    def grow(self, pages: int) -> None:
        n = pages * self.S
        have = len(self.a["lc"])
        if n > have:
            n = max(n, 2 * have)
            for f, v in self.a.items():
                self.a[f] = np.concatenate([v, np.full(n - have, -1, dtype=np.int64)])

    def apply(self, sid: np.ndarray, w: Writes) -> None:
        """Each slot's latest write of the batch (by clock; a later write at the same clock wins)
        replaces what is there unless that is later."""
        if not len(sid):
            return
        order = np.lexsort((np.arange(len(sid)), w.lc, sid))
        last = order[np.append(sid[order][1:] != sid[order][:-1], True)]
        s = sid[last]
        take = w.lc[last] >= self.a["lc"][s]
        s, last = s[take], last[take]
        for f in self.FIELDS:
            self.a[f][s] = getattr(w, f)[last]


class NodeIndex:
    """One node's index state (writer thread only)."""

    def __init__(self, node: str, page_size: int):
        self.node, self.S = node, page_size
        self.last = _LastWrite(page_size)
        self.holds: dict[tuple[int, int, int], None] = {}      # (page, generation, reader), insertion order

    def hold(self, page: np.ndarray, gen: np.ndarray, reader: np.ndarray, unique: bool = False) -> None:
        """Remember who read which page in which generation (every read of the fold, failing or not;
        ``unique``: each triple once already)."""
        if not len(page):
            return
        u = np.stack([page, gen, reader], axis=1).astype(np.int64)
        if not unique:
            u, _ = unique_rows(u)
        if len(self.holds) + len(u) > HOLDINGS_CAP:
            for k in list(self.holds)[: len(self.holds) // 2]:
                del self.holds[k]
        self.holds.update(dict.fromkeys(map(tuple, u.tolist())))

    def fold(self, w: Writes, r: Reads) -> "Columns | None":
        """Answer the fold's failing reads (against the slots' last writes before the fold and the
        fold's own writes up to each read's clock), then apply the fold's writes."""
        S = self.S
        if len(w.page):
            self.last.grow(int(w.page.max()) + 1)
        sid_w = w.page * S + w.off
        out = self._answer(sid_w, w, r) if len(r.get("page", ())) else None
        self.last.apply(sid_w, w)
        return out

    def _answer(self, sid_w: np.ndarray, w: Writes, r: Reads) -> "Columns | None":
        S = self.S
        self.last.grow(int(r["page"].max()) + 1)
        bits = (r["bad_mask"][:, None] >> np.arange(S)) & 1
        bits &= np.arange(S) < r["slots_read"][:, None]
        cell, slot = np.nonzero(bits)                                   # every failing (read, slot)
        sid, L = r["page"][cell] * S + slot, r["lclock"][cell]
        # the fold's own writes: the last one in the slot at or before the read's clock
        hit = np.full(len(cell), -1, dtype=np.int64)
        if len(sid_w):
            ranks = np.unique(np.concatenate([w.lc, L]))
            kw = sid_w * len(ranks) + np.searchsorted(ranks, w.lc)
            kq = sid * len(ranks) + np.searchsorted(ranks, L)
            order = np.lexsort((np.arange(len(kw)), kw))
            i = np.searchsorted(kw[order], kq, side="right") - 1
            ok = i >= 0
            ok[ok] = sid_w[order[i[ok]]] == sid[ok]
            hit[ok] = order[i[ok]]
        got = hit >= 0
        st = self.last.a
        lc = np.where(got, w.lc[hit], st["lc"][sid])
        lc = np.where(got | (lc <= L), lc, -1)                           # (a write from after the read: not found)
        pick = lambda a, f: np.where(got, getattr(w, a)[hit], st[f][sid])  # noqa: E731
        writer, gen, path, ts, pos = (pick(a, f) for a, f in (("writer", "writer"), ("gen", "gen"), ("path", "path"),
                                                                ("ts", "ts"), ("pos", "pos")))
        found = lc >= 0
        donor = np.where(found, writer, -1)
        # epoch: the last write to any failing slot of the read (the join's cuts)
        epoch = np.full(len(r["page"]), -1, dtype=np.int64)
        np.maximum.at(epoch, cell, lc)
        keep = donor != r["reader"][cell]                               # the reader's own slots disclose nothing to it
        cell, slot, donor, lc, gen, path, ts, pos, found = (a[keep] for a in (cell, slot, donor, lc, gen, path, ts, pos, found))
        if not len(cell):
            return None
        # groups of reads: (reader, page, generation, block column, found generation, failing slots, epoch)
        key = np.stack([r["reader"], r["page"], r["generation"], r["block_index"], r["found_generation"],
                        r["bad_mask"], epoch], axis=1)
        gk, grp = unique_rows(key)
        G = len(gk)
        agg = {"n_reads": np.bincount(grp, minlength=G)}
        for f, fn, init in (("step", np.minimum, np.iinfo(np.int64).max), ("lclock", np.minimum, np.iinfo(np.int64).max),
                            ("ts", np.minimum, np.iinfo(np.int64).max)):
            a = np.full(G, init, dtype=np.int64)
            fn.at(a, grp, r[f])
            agg[f + "_first"] = a
        for f in ("step", "lclock", "ts"):
            a = np.full(G, np.iinfo(np.int64).min, dtype=np.int64)
            np.maximum.at(a, grp, r[f])
            agg[f + "_last"] = a
        sr = np.zeros(G, dtype=np.int64)
        np.maximum.at(sr, grp, r["slots_read"])
        m = r["mass"]
        mass = np.bincount(grp, weights=np.nan_to_num(m, nan=0.0), minlength=G)
        mass[np.bincount(grp, weights=~np.isnan(m), minlength=G) == 0] = np.nan   # no read of the group measured
        first_cell = np.full(G, len(grp), dtype=np.int64)
        np.minimum.at(first_cell, grp, np.arange(len(grp)))
        # one row per (group, write found): the write's identity, its failing slots as a mask
        g = grp[cell]
        off = pos - slot
        wkey = np.stack([g, donor, lc, gen, path, ts, np.where(found, off, 0)], axis=1)
        wk, winv = unique_rows(wkey)
        mask = np.zeros(len(wk), dtype=np.int64)
        np.bitwise_or.at(mask, winv, np.left_shift(1, slot, dtype=np.int64))
        wg = wk[:, 0]
        part = np.arange(len(wk)) - np.searchsorted(wg, wg)            # rank of the write within its group
        wfound = wk[:, 2] >= 0                                          # a write's clock (-1: none recorded)
        held = np.array([(int(p), int(ge), int(d)) in self.holds
                         for p, ge, d in zip(gk[wg, 1], wk[:, 3], wk[:, 1])], dtype=bool)
        fc = first_cell[wg]
        ids = r["ids"]
        n = len(wk)
        cols: Columns = {
            "node": Coded(np.zeros(n, dtype=np.int32), [self.node]),
            "reader": gk[wg, 0], "page": gk[wg, 1].astype(np.int32), "generation": gk[wg, 2],
            "block_index": gk[wg, 3].astype(np.int32), "found_generation": gk[wg, 4], "bad_mask": gk[wg, 5],
            "epoch": gk[wg, 6], "part": part.astype(np.int16), "slot_mask": mask, "donor": wk[:, 1],
            "donor_held": held,
            "write_lclock": np.where(wfound, wk[:, 2], 0), "write_generation": np.where(wfound, wk[:, 3], 0),
            "write_path": Coded(np.where(wfound, wk[:, 4], 0).astype(np.int32), list(PATHS)),
            "written_at": np.where(wfound, wk[:, 5], 0), "position_offset": wk[:, 6].astype(np.int32),
            "slots_read": sr[wg].astype(np.int16), "attention_mass": mass[wg], "n_reads": agg["n_reads"][wg].astype(np.int32),
            **{f: agg[f][wg] for f in ("step_first", "step_last", "lclock_first", "lclock_last", "ts_first", "ts_last")},
            "trace_id": Coded(np.arange(n, dtype=np.int32), [ids[c][0] for c in fc]),
            "span_id": Coded(np.arange(n, dtype=np.int32), [ids[c][1] for c in fc]),
        }
        cols["_unwritten"] = ~wfound                                    # (NULLed by the caller; not a column)
        return cols


def finish(cols: Columns) -> Columns:
    """The write fields of unwritten rows as NULL (a write that was not recorded has none)."""
    import pyarrow as pa
    un = cols.pop("_unwritten")
    out = {}
    for k, v in cols.items():
        if k in ("write_lclock", "write_generation", "written_at", "position_offset", "donor_held"):
            out[k] = pa.array(v, mask=un) if k != "written_at" else pa.array(v, pa.timestamp("ns"), mask=un)
        elif k == "write_path":
            out[k] = pa.DictionaryArray.from_arrays(pa.array(v.codes, mask=un), pa.array(v.values))
        elif isinstance(v, Coded):
            out[k] = pa.DictionaryArray.from_arrays(pa.array(v.codes), pa.array(v.values, pa.string()))
        elif k in ("ts_first", "ts_last"):
            out[k] = pa.array(v, pa.timestamp("ns"))
        else:
            out[k] = pa.array(v)
    return pa.table(out)
