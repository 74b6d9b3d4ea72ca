"""The ground-truth oracle of DESIGN.md, independent of the ledger, the tag plane and faults.

- Reads: after every step, for each request in the batch, the K/V bytes of every slot it read
  ([0, seq_len) through its block table) are fingerprinted - only slots whose bytes may have
  changed since this request last saw them (pool.write_seq) are gathered again.
- Writes: every slot a step computed is fingerprinted with the incarnation the runner computed it
  for; every transfer landing with whoever computed the bytes in the source slot it copied. This
  is the hash index of writes.
- Verdict: each response's own tokens go through a clean, unpaged forward pass (dense causal
  attention, no pool); read slots whose K/V differ from the clean K/V are exposures; the donor is
  whoever wrote those exact bytes into that very slot *last before the read* (identical bytes do
  recur: the recall model's K/V at a position depends on a couple of tokens, so two texts sharing
  "    " at the same positions write identical records); failing that, whoever last wrote those
  bytes anywhere before the read (records reloaded from the host tier); -1: bytes nobody wrote
  (e.g. a never-used page). Time-aware: the donor is looked up when the read is observed, in the
  order the engine's steps and transfer landings happened (the store's logical clocks), so a page
  rewritten after the read never changes who is named.
- Every request is judged, failed ones too: what a request the read check stopped had read is
  returned by the same ``exposures`` call; the caller files it as *blocked* (it returned nothing).
The tag plane (content tags, writer ids) is never consulted: fingerprints skip the record's tag area.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.kv.pool import TAG_BYTES
SKETCH = 16


class Exposure(NamedTuple):
    response: int
    donor: int
    node: str
    page: int
    position: int


class _DenseContext:
    """Stands in for StepContext: plain causal attention over one whole sequence, no pool."""

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def attend(self, layer, q, k, v, num_kv_heads, head_dim, scale):
        T, Hq, D = q.shape
        self.k.append(k.reshape(T, -1).float())
        self.v.append(v.reshape(T, -1).float())
        kk = k.reshape(T, num_kv_heads, head_dim).repeat_interleave(Hq // num_kv_heads, dim=1)
        vv = v.reshape(T, num_kv_heads, head_dim).repeat_interleave(Hq // num_kv_heads, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv).reshape(T, Hq * D)


class Oracle:
    def __init__(self, model, seed: int = 1234):
        self.model = model
        g = torch.Generator().manual_seed(seed)
        n_floats = 2 * model.num_layers * model.kv_dim
        self._proj = torch.randn(n_floats, SKETCH, generator=g)
        self._w: torch.Tensor | None = None
        self._g = g
        self.index: dict[int, int] = {}                  # fingerprint -> writer incarnation
        self.index_at: dict[tuple[int, str, int, int], int] = {}   # (fingerprint, node, page, slot) -> writer
        self._seen: dict[tuple[int, int], torch.Tensor] = {}     # (pool id, incarnation) -> write_seq seen per position
        self._reads: dict[int, list[tuple]] = {}

    # ---- fingerprints ------------------------------------------------------------------------
    def _fingerprint(self, pool, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        body = records[:, TAG_BYTES:].contiguous()
        words = body.view(torch.int64)
        if self._w is None or self._w.numel() != words.shape[1]:
            self._w = torch.randint(1, 2 ** 62, (words.shape[1],), generator=self._g) * 2 + 1
        fp = (words * self._w).sum(1)
        n = 2 * self.model.num_layers * self.model.kv_dim * pool.esize
        floats = body[:, :n].view(pool.dtype).float()
        return fp, floats @ self._proj

    # ---- observers ---------------------------------------------------------------------------
    def observe_step(self, engine, out) -> None:
        pool, S = engine.pool, engine.pool.page_size
        fp, _ = self._fingerprint(pool, pool.read_records(out.slot_pages, out.slot_offsets))
        writers = [out.batch[b].req.incarnation for b in out.layout.tok_batch.tolist()]
        self._index(engine.cfg.node_id, fp, out.slot_pages, out.slot_offsets, writers)
        for b, (req, _) in enumerate(out.batch):
            n = int(out.layout.seq_lens[b])
            pos = torch.arange(n)
            pages = out.layout.block_tables[b][pos // S]
            offs = pos % S
            # what this position's bytes are: which slot, and how many writes it has had
            ver = torch.stack([pages * S + offs, pool.write_seq[pages, offs]])
            key = (id(pool), req.incarnation)
            seen = self._seen.get(key)
            changed = torch.ones(n, dtype=torch.bool)
            if seen is not None:
                m = min(n, seen.shape[1])
                changed[:m] = (ver[:, :m] != seen[:, :m]).any(0)
            self._seen[key] = ver
            if changed.any():
                idx = torch.nonzero(changed).flatten()
                f, sk = self._fingerprint(pool, pool.read_records(pages[idx], offs[idx]))
                node = engine.cfg.node_id
                # the donor of each slot as of this read (writes so far), not as of the end of the run
                donors = torch.tensor([self.donor(fp, node, pg, o) for fp, pg, o in
                                       zip(f.tolist(), pages[idx].tolist(), offs[idx].tolist())], dtype=torch.int64)
                self._reads.setdefault(req.incarnation, []).append((node, idx, pages[idx], offs[idx], donors, sk))

    def observe_landing(self, engine, job, sl: slice) -> None:
        """One transfer call copied records ``job.*[sl]`` from the source node into ``engine``'s
        pool. A copy is not a computation: each landed slot is attributed to whoever computed those
        bytes in the source slot (the transfer's own request, unless the source page had been
        handed on and rewritten before the copy read it)."""
        pool = engine.pool
        pages, offs = job.dst_pages[sl], job.dst_offsets[sl]
        fp, _ = self._fingerprint(pool, pool.read_records(pages, offs))
        if job.src_pages is None:            # written by another process, whose source slots are not visible
            writers = [job.incarnation] * fp.numel()
        else:
            writers = [self.index_at.get((f, job.src_node, p, o), self.index.get(f, job.incarnation))
                       for f, p, o in zip(fp.tolist(), job.src_pages[sl].tolist(), job.src_offsets[sl].tolist())]
        self._index(engine.cfg.node_id, fp, pages, offs, writers)

    def _index(self, node: str, fp: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, writers: list[int]) -> None:
        fps = fp.tolist()
        self.index.update(zip(fps, writers))
        self.index_at.update(zip(zip(fps, [node] * len(fps), pages.tolist(), offsets.tolist()), writers))

    def donor(self, fp: int, node: str, page: int, slot: int) -> int:
        return self.index_at.get((fp, node, page, slot), self.index.get(fp, -1))

    # ---- verdict -----------------------------------------------------------------------------
    @torch.inference_mode()
    def clean_sketch(self, tokens: list[int]) -> torch.Tensor:
        ctx = _DenseContext()
        ids = torch.tensor(tokens, dtype=torch.long)
        self.model.forward(ids, torch.arange(len(tokens)), ctx, torch.tensor([len(tokens) - 1]))
        return torch.cat(ctx.k + ctx.v, dim=1) @ self._proj

    def exposures(self, response, tol: float = 1e-3) -> list[Exposure]:
        reads = self._reads.get(response.incarnation)
        if not reads:
            return []
        nodes = [n for n, idx, *_ in reads for _ in range(idx.numel())]
        pos, pages, offs, donors, sk = (torch.cat(x) for x in list(zip(*reads))[1:])
        clean = self.clean_sketch(response.all_ids)[pos]
        bad = ((sk - clean).abs().amax(1) > tol * (1 + clean.abs().amax(1)))
        out = set()
        for i, p, pg, d in zip(torch.nonzero(bad).flatten().tolist(), pos[bad].tolist(), pages[bad].tolist(),
                               donors[bad].tolist()):
            out.add(Exposure(response.incarnation, d, nodes[i], pg, p))
        return sorted(out)
