"""Process mode: prefill nodes as separate OS processes that write KV into the decode node's pool
through shared memory - real, concurrent one-sided writes.

The decode node's pool buffer is a shared file mapping (``/dev/shm``). Each prefill node is a
child process (``python -m engine.disagg.procs``, a fresh interpreter: nothing of the parent's
``__main__`` is re-run) with its own model and its own pool, talking to the router over a socket
pair. The router sends it
the prompt and the decode pages reserved at bootstrap; once it has prefilled, the child writes the
records (K/V + tags, one copy per call of at most ``batch_slots`` records) straight into decode's
mapped pool while decode keeps stepping, gives its source pages back, and says "landed".

Everything else - the router's checks, the reject path, decode's verdict (landed set, checksum),
the read check, deferred release, aborts - is ``DisaggCluster``'s own code: only the handoff
differs. Aborts are acknowledged per incarnation by the child; until the ack (or a landing)
arrives, decode holds the pages the child may still be writing (deferred release).

Not recorded: the children have no recorder (a store has one writer), so prefill-side steps are
not in the ledger; transfer landings and everything decode does are.
"""
from __future__ import annotations

import itertools
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from types import SimpleNamespace

import torch

from engine.config import EngineConfig
from engine.disagg.cluster import Completion, DisaggCluster, LinkStatus, Guards, Half, LinkConfig, TransferError, TransferJob, \
    slot_addresses, records_checksum
from engine.errors import InputError, KvledgerError
from engine.llm import LLMEngine
from engine.kv.pool import KVPool
from engine.kv.preflight import preflight
from engine.osutil import die_with_parent
from engine.recorder import LandedRecords, Recorder
from engine.request import Request, SamplingParams, Status

TICK_S = 0.05          # process mode's link clock: deferred-release timeouts count wall-clock ticks


POOL_PREFIX = "kvledger-pool-"


def reap_stale_pools(directory: str) -> list[str]:
    """Remove pool files of dead writers (``kvledger-pool-<pid>-*`` whose pid is gone): a process-mode
    run killed with -9 cannot unlink its own; the next start does. Returns what it removed."""
    removed = []
    for name in os.listdir(directory):
        if not name.startswith(POOL_PREFIX):
            continue
        try:
            pid = int(name[len(POOL_PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
        except (ValueError, PermissionError):     # not ours, or another user's live process
            continue
    return removed


def _prefill_main(conn, model_spec: str, cfg: EngineConfig, geometry: dict, decode_path: str) -> None:
    """A prefill node's process: prefill what the router sends, write it into decode's pool."""
    from engine.models import load_model
    die_with_parent()       # no prefill node outlives its router and writes into a pool nobody reads
    torch.set_num_threads(1)
    try:
        model, tok = load_model(model_spec)
        eng = LLMEngine(model, tok, cfg)
        dst = KVPool(**geometry, shared_path=decode_path, create=False)
    except BaseException as e:                  # reported to the router, which names it
        conn.send(("error", 0, f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid(), eng.pool.capacity_tokens))
    work: dict[int, tuple[list[int], int | None]] = {}
    seq = itertools.count(1)

    def handoff(preq: Request) -> None:
        reservation, batch = work.pop(preq.incarnation)
        t0 = time.perf_counter()
        pos = torch.arange(preq.num_computed)
        sp, so = slot_addresses(preq.block_table, eng.cfg.page_size, pos)
        dp, do = slot_addresses(reservation, dst.page_size, pos)
        checksum = records_checksum(eng.pool.read_records(sp, so))
        step = len(pos) if batch is None else batch
        for i in range(0, len(pos), step):     # one-sided writes into decode's memory, call by call
            dst.write_records(dp[i:i + step], do[i:i + step], eng.pool.read_records(sp[i:i + step], so[i:i + step]))
        eng.blocks.release(preq)               # the source pages go back once the writes are done
        preq.transition(Status.FINISHED_LENGTH)
        conn.send(("landed", preq.incarnation, len(pos), checksum, preq.output_ids[0], next(seq), t0))

    eng.on_prefill_done = handoff
    while True:
        busy = eng.has_unfinished()
        while conn.poll(0 if busy else 0.05):
            msg = conn.recv()
            if msg[0] == "stop":
                conn.send(("stopped", eng.allocator.num_free, eng.allocator.total))
                return
            if msg[0] == "enqueue":
                _, inc, prompt_ids, tenant, user, salt, reservation, batch = msg
                preq = eng.new_request(prompt_ids, SamplingParams(max_tokens=1, ignore_eos=True), tenant,
                                       incarnation=inc, user=user, cache_salt=salt)
                work[inc] = (reservation, batch)
                eng.enqueue(preq)
            elif msg[0] == "abort":
                req = eng.requests.get(msg[1])
                if work.pop(msg[1], None) is not None and req is not None:
                    eng.abort(req, "the decode half ended")
                conn.send(("aborted", msg[1]))  # the ack, tagged with the incarnation: no write will follow
            busy = eng.has_unfinished()
        if busy:
            for req in eng.step():
                if req.error is not None and work.pop(req.incarnation, None) is not None:
                    conn.send(("failed", req.incarnation, str(req.error)))


class RemotePrefill:
    """The router's handle on a prefill node that runs in another process."""

    def __init__(self, cluster: "ProcessCluster", model_spec: str, cfg: EngineConfig, geometry: dict,
                 decode_path: str, start_timeout: float = 300.0):
        self.cluster, self.cfg = cluster, cfg
        self.sending: dict = {}                 # transfer key -> the request whose pages are being sent
        self.transfer_seq = itertools.count(1)
        self.allocator = SimpleNamespace(num_free=None, total=None, checked_frees=0)   # known once stopped
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.disagg.procs", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())
        try:
            self.conn.send((model_spec, cfg, geometry, decode_path))
            if not self.conn.poll(start_timeout):
                raise KvledgerError(f"prefill node {cfg.node_id} did not start within {start_timeout:.0f} s")
            kind, pid, detail = self.conn.recv()
        except (EOFError, OSError):
            self.stop()
            raise KvledgerError(f"prefill node {cfg.node_id} exited before it started (exit code "
                                f"{self.proc.returncode})") from None
        except KvledgerError:
            self.stop()
            raise
        if kind == "error":
            self.stop()
            raise KvledgerError(f"prefill node {cfg.node_id} failed to start: {detail}")
        self.pid = pid
        self.pool = SimpleNamespace(capacity_tokens=detail)
        self.outstanding: dict[int, Request] = {}
        self.observers: list = []              # the child's steps are not observable from here
        self.model = cluster.decode.model      # the same model (for the recorder's config snapshot)
        self.preflight = preflight(self.model, cfg)
        self.steps = self.lclock = 0

    check_fits_pool = LLMEngine.check_fits_pool

    def new_request(self, prompt, sampling=None, tenant="default", rid="", incarnation=None, user="",
                    cache_salt="") -> Request:
        return self.cluster.decode.new_request(prompt, sampling, tenant, rid=rid, incarnation=incarnation, user=user,
                                               cache_salt=cache_salt)

    def enqueue(self, preq: Request) -> None:
        half = self.cluster.halves[preq.incarnation]
        g, lc = self.cluster.guards, self.cluster.link_cfg
        self._send(("enqueue", preq.incarnation, list(preq.prompt_ids), preq.tenant, preq.user, preq.cache_salt,
                    list(half.reservation),
                    lc.batch_slots if g.transfer_batch_bound else None))
        preq.transition(Status.PREFILLING)
        self.outstanding[preq.incarnation] = preq

    def abort(self, preq: Request, reason: str) -> None:
        self._send(("abort", preq.incarnation))
        if not preq.is_finished:
            preq.error = InputError(reason)
            preq.transition(Status.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.outstanding)

    def step(self) -> list[Request]:
        return []

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise KvledgerError(f"prefill node {self.cfg.node_id} (pid {self.pid}) is gone: {e}") from e

    def poll(self) -> list[tuple]:
        out = []
        try:
            while self.conn.poll():
                out.append(self.conn.recv())
        except (EOFError, OSError):
            pass
        if not out and self.proc.poll() is not None:
            raise KvledgerError(f"prefill node {self.cfg.node_id} (pid {self.pid}) exited with code {self.proc.returncode}")
        return out

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
            if self.conn.poll(30):
                msg = self.conn.recv()
                if msg[0] == "stopped":
                    self.allocator.num_free, self.allocator.total = msg[1], msg[2]
        except (BrokenPipeError, EOFError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


class _WallClockLink:
    """Process mode's stand-in for the paced link: the children do the writes; this only counts
    ticks of TICK_S wall-clock seconds, for deferred-release timeouts."""

    def __init__(self):
        self._t0 = time.monotonic()

    @property
    def now(self) -> int:
        return int((time.monotonic() - self._t0) / TICK_S)

    in_flight = 0

    def cancel(self, job: TransferJob) -> None:
        return None

    def close(self) -> None:
        pass


class ProcessCluster(DisaggCluster):
    """``DisaggCluster`` with each prefill node in its own OS process writing into decode's pool
    through shared memory. ``model_spec`` is what each child loads (``recall`` or an HF dir)."""

    def __init__(self, model, tokenizer, prefill_cfgs: list[EngineConfig], decode_cfg: EngineConfig, guards: Guards,
                 link: LinkConfig | None = None, recorder: Recorder | None = None, model_spec: str = "recall"):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.reaped = reap_stale_pools(shm)
        self.shared_path = os.path.join(shm, f"{POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        decode_cfg = replace(decode_cfg, shared_pool_path=self.shared_path)
        self._model_spec = model_spec
        self._remotes: list[RemotePrefill] = []
        try:
            super().__init__(model, tokenizer, prefill_cfgs, decode_cfg, guards, link, recorder)
        except BaseException:
            self.close()
            raise
        # every prefill child said "ready" after mapping decode's pool: the name is no longer needed,
        # so it goes now - the mappings stay valid, and nothing is left behind even by kill -9
        os.unlink(self.shared_path)

    def _make_prefill(self, model, tokenizer, cfg: EngineConfig) -> RemotePrefill:
        pool = self.decode.pool
        geometry = dict(num_layers=pool.num_layers, kv_dim=pool.kv_dim, page_size=pool.page_size,
                        memory_budget=pool.memory_bytes, dtype=pool.dtype)
        node = RemotePrefill(self, self._model_spec, cfg, geometry, self.shared_path)
        self._remotes.append(node)
        self.rec.node_started(node)            # its config snapshot (pool vs context) is the router's to record
        return node

    def _make_link(self) -> _WallClockLink:
        return _WallClockLink()

    def _may_still_write(self, half: Half) -> bool:
        return half.dreq.incarnation in half.node.outstanding     # until the child acks or lands

    def has_work(self) -> bool:
        return bool(self.backlog) or bool(self.holds) or any(n.has_unfinished() for n in self.nodes)

    def step(self) -> None:
        self.steps += 1
        self._bootstrap()
        for node in self.prefills:
            for msg in node.poll():
                self._on_message(node, msg)
        self._expire()
        if self.decode.has_unfinished():
            self.decode.step()
        elif self.has_work():                  # nothing to decode: wait for a child to say something
            multiprocessing.connection.wait([n.conn for n in self.prefills], timeout=TICK_S)

    def _on_message(self, node: RemotePrefill, msg: tuple) -> None:
        kind, inc = msg[0], msg[1]
        node.outstanding.pop(inc, None)
        if kind == "aborted":
            self._end_holds(inc, "drained")
            return
        half = self.halves.get(inc)
        if half is None:                       # the decode half already ended (abort): its writes are done
            self._end_holds(inc, "drained")
            return
        if kind == "failed":
            self.halves.pop(inc)
            error = TransferError(f"request {inc}: prefill node {node.cfg.node_id} failed: {msg[2]}")
            self.rec.rejected(self.decode, half.dreq, f"prefill:{node.cfg.node_id}", error)
            self._release_decode(half, error, in_flight=False)
            return
        _, _, n, checksum, first_token, seq, t0 = msg
        if half.preq.status is Status.PREFILLING:
            half.preq.transition(Status.TRANSFERRING)
        pool, S = self.decode.pool, self.decode.cfg.page_size
        pos = torch.arange(n)
        dp, do = slot_addresses(half.reservation, S, pos)
        job = TransferJob(seq, inc, (half.room, inc), None, pool, pos, None, None, dp, do, checksum, first_token,
                          self.decode.next_lclock, seq, node.cfg.node_id, t0, sent=n, calls=1)
        half.job = job
        pool.write_seq[dp, do] += 1            # the child wrote these slots (write_seq is this process's own)
        for obs in self.landing_observers:
            obs(self.decode, job, slice(0, n))
        lclock = torch.full((n,), self.decode.next_lclock(), dtype=torch.long)
        c = Completion(job, LinkStatus.DRAINED, pos, lclock, pool.generation[dp].clone(), pool.tags[dp, do].clone(),
                       pool.writers[dp, do].clone(), dp, do)
        self.rec.records_landed(self.decode, LandedRecords(inc, pos, lclock, c.landed_gen, c.landed_tags,
                                                           c.landed_writers, dp, do))
        self._landed(c)

    def free_pages(self) -> dict[str, tuple[int | None, int | None]]:
        """Every node's (free, total) pages; the children's are known once they stopped (close)."""
        return {n.cfg.node_id: (n.allocator.num_free, n.allocator.total) for n in self.nodes}

    def close(self) -> None:
        for node in self._remotes:
            node.stop()
        self._remotes = []
        if os.path.exists(self.shared_path):
            os.unlink(self.shared_path)         # the mapping stays valid for whoever still has it mapped


if __name__ == "__main__":        # a prefill node's process: python -m engine.disagg.procs FD
    _conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    _prefill_main(_conn, *_conn.recv())
