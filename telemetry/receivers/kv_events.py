"""A subscriber for vLLM's (and SGLang's, which reuses the format) KV cache event publishers.

Wire format (vLLM ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): a PUB socket sends
multipart frames ``(topic, seq: 8-byte big-endian, payload: msgpack)``. The payload is an event
batch in one of two encodings, both decoded here without the publisher's classes:

- older, ``array_like``: ``[ts, [event, ...], dp_rank?]`` with each event
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium?]``,
  ``["BlockRemoved", block_hashes, medium?]``, ``["AllBlocksCleared"]``;
- newer, tagged maps: ``{"ts", "events", "data_parallel_rank"}`` with each event a map whose
  ``type`` is the tag and whose keys are the field names (``block_hashes``, ``parent_block_hash``,
  ``token_ids``, ``block_size``, ``lora_id``, ``lora_name``, ``medium``, ``extra_keys``,
  ``group_idx``...).

SGLang (``sglang/srt/disaggregation/kv_events.py``) sends the batch as ``[ts, events, attn_dp_rank]``
and its ``BlockStored`` maps carry ``cache_salt`` and ``session_id`` by name; its hashes are signed
int64. Positionally, vLLM's seventh field is ``lora_name`` and SGLang's ``cache_salt``: a positional
event's seventh field is therefore never stored in clear, only as a scope pseudonym.

Block hashes are stored as the engine's own value: bytes (vLLM's sha256) as hex, ints (SGLang,
older vLLM) as their signed decimal. A sequence gap (a batch number skipped) is recorded in
``telemetry_gaps`` and, when the publisher has a replay socket (ROUTER: send ``(b"", start_seq 8
bytes)``, receive ``(seq, payload)`` ... until seq -1), filled from it. A sequence number that goes
back (the engine restarted and counts from 0 again) or jumps by more than ``MAX_GAP`` batches starts
a new *epoch*: recorded in ``telemetry_gaps``, its batches kept (``kv_events.epoch``), never dropped
as stale nor counted as a 9e18-batch gap. An event type this reader does not know is skipped and
counted by type; the rest of its batch lands. A frame that cannot be read is counted (``bad``) and
never stops the subscriber.

The cache scope of a block chain is the keyed pseudonym of its first block's extra keys (where
vLLM puts ``cache_salt``) or of SGLang's ``cache_salt``; later blocks inherit it through
``parent_block_hash``. No salt is stored in clear, in any event shape.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Annotated, Optional, Union

import msgspec
import numpy as np
import pyarrow as pa
import zmq

from engine.errors import KvledgerError

END_SEQ = -1
MAX_GAP = 1 << 20               # a forward jump of more batches than this is a renumbering (new epoch), not a loss
MAX_TS = 1e11                   # batch times beyond year 5138 (or NaN) are not times: the batch is unreadable
PENDING_ROWS = 8192             # rows buffered before they go to the writer (sooner when the publisher pauses)
SCOPE_MEMORY = 1 << 20          # block hash -> scope entries kept for chaining (oldest forgotten)
MAX_FRAME = 64 << 20            # bytes: a bigger ZMQ message is dropped by the socket, never read into memory


class DecodeError(KvledgerError, ValueError):
    pass


def _hex(h) -> str | None:
    """A block hash as text, the engine's own value: bytes as hex, an int as its (signed) decimal."""
    if h is None:
        return None
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    if isinstance(h, int) and not isinstance(h, bool):
        return str(h)
    raise DecodeError(f"block hash of type {type(h).__name__}")


# positional (array_like) field order per tag. The seventh BlockStored field is vLLM's lora_name and
# SGLang's cache_salt: read as "salt_or_lora", it only ever becomes a scope pseudonym
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "salt_or_lora",
                    "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def decode_batch(payload: bytes) -> tuple[float, int | None, list[dict], list[str]]:
    """(ts, dp rank, events as dicts with a ``type``, the types skipped as unknown) from either encoding."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise DecodeError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, dp = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, dp = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise DecodeError("an event batch is [ts, events, ...] or {ts, events, ...}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise DecodeError("an event batch needs a numeric ts and a list of events")
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool) or not 0 <= dp < 1 << 31):
        raise DecodeError(f"data_parallel_rank {dp!r} is not a rank")
    out, unknown = [], []
    for ev in events:
        if isinstance(ev, dict):
            kind = ev.get("type")
            d = ev
        elif isinstance(ev, list) and ev and isinstance(ev[0], str):
            kind = ev[0]
            d = dict(zip(_FIELDS.get(kind, ()), ev[1:]))
        else:
            raise DecodeError(f"an event is a tagged array or map, got {type(ev).__name__}")
        if not isinstance(kind, str):
            raise DecodeError(f"an event type is a string, got {type(kind).__name__}")
        if kind not in _FIELDS:
            unknown.append(kind[:64])
            continue
        if isinstance(d.get("extra_keys"), str):          # SGLang's positional session_id: attribution only
            d = {**d, "extra_keys": None}
        out.append({**d, "type": kind})
    return float(ts), dp, out, unknown


# ---- typed decoding (the fast path) --------------------------------------------------------------
# The same two encodings as msgspec Structs: decoded in C, token ids left undecoded (only their count
# is kept), unknown map keys and extra trailing array fields ignored. A batch these do not fit
# (a field of another type) falls back to decode_batch, which reads any shape it can.
Hash = Union[bytes, int]
_NIL = msgspec.Raw(b"\xc0")


def _decoder(array_like: bool) -> msgspec.msgpack.Decoder:
    def struct(name, fields, **kw):
        return msgspec.defstruct(name, fields, array_like=array_like, **kw)
    common = [("block_hashes", list[Hash], []), ("parent_block_hash", Optional[Hash], None),
              ("token_ids", msgspec.Raw, _NIL), ("block_size", Optional[int], None), ("lora_id", Optional[int], None),
              ("medium", Optional[str], None)]
    if array_like:      # the seventh field: vLLM's lora_name or SGLang's cache_salt (see _FIELDS)
        fields = [*common, ("salt_or_lora", Optional[str], None), ("extra_keys", Optional[list], None),
                  ("group_idx", Optional[int], None)]
    else:               # by name: vLLM's lora_name and extra_keys, SGLang's cache_salt
        fields = [*common, ("lora_name", Optional[str], None), ("extra_keys", Optional[list], None),
                  ("group_idx", Optional[int], None), ("cache_salt", Optional[str], None)]
    stored = struct("BlockStored", fields, tag="BlockStored")
    removed = struct("BlockRemoved", [("block_hashes", list[Hash], []), ("medium", Optional[str], None),
                                      ("group_idx", Optional[int], None)], tag="BlockRemoved")
    cleared = struct("AllBlocksCleared", [], tag="AllBlocksCleared")
    batch = struct("Batch", [("ts", float), ("events", list[Union[stored, removed, cleared]]),
                             ("data_parallel_rank", Optional[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]], None)])
    return msgspec.msgpack.Decoder(batch)


_MAP_DECODER, _ARRAY_DECODER = _decoder(False), _decoder(True)


def _array_len(raw: msgspec.Raw) -> int | None:
    """The element count of an undecoded msgpack array (token ids), from its header alone."""
    b = memoryview(raw)
    if not len(b) or b[0] == 0xC0:
        return None
    if 0x90 <= b[0] <= 0x9F:
        return b[0] & 0x0F
    if b[0] == 0xDC:
        return int.from_bytes(b[1:3], "big")
    if b[0] == 0xDD:
        return int.from_bytes(b[1:5], "big")
    raise DecodeError("token_ids is not an array")


def _count(token_ids) -> int | None:
    if token_ids is None:
        return None
    if not isinstance(token_ids, list):
        raise DecodeError("token_ids is not an array")
    return len(token_ids)


def _hex_lists(lists: list[list]) -> pa.Array:
    """Lists of block hashes as an Arrow list<string> of hex, bytes hashes hexed in one call."""
    counts = np.fromiter(map(len, lists), np.int64, len(lists))
    flat = [h for hl in lists for h in hl]
    offsets = np.zeros(len(lists) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    try:
        joined = b"".join(flat)
    except TypeError:                       # int hashes (the older encoding): one at a time
        values = pa.array([_hex(h) for h in flat], pa.string())
    else:
        lens = np.fromiter(map(len, flat), np.int64, len(flat))
        voff = np.zeros(len(flat) + 1, np.int32)
        np.cumsum(lens * 2, out=voff[1:])
        values = pa.StringArray.from_buffers(len(flat), pa.py_buffer(voff), pa.py_buffer(joined.hex().encode()))
    return pa.ListArray.from_arrays(pa.array(offsets), values)


class KVEventSubscriber:
    """One publisher: SUB (and optionally DEALER for replay) on a thread; rows go to the writer.
    ``bind``: bind the SUB socket (the engine connects to us) instead of connecting to the engine."""

    def __init__(self, writer, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 instance: str | None = None, ctx: zmq.Context | None = None, bind: bool = False):
        self.writer, self.endpoint, self.replay_endpoint = writer, endpoint, replay_endpoint
        self.topic, self.instance, self.bind = topic, instance or endpoint, bind
        self.ctx = ctx or zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        try:
            self.sub.bind(endpoint) if bind else self.sub.connect(endpoint)
        except zmq.ZMQError as e:
            self.sub.close(linger=0)
            raise KvledgerError(f"--kv-events {endpoint}: cannot {'bind' if bind else 'connect'} ({e})") from None
        self.next_seq: int | None = None
        self.epoch = 0
        self.batches = self.events = self.hashes = self.bad = 0
        self.unknown: dict[str, int] = {}        # event types skipped, by type
        self.errors: list[str] = []              # the first few reasons a frame was unreadable
        self.gaps: list[tuple[int, int, bool]] = []
        self.epochs: list[tuple[int, int, int]] = []   # (epoch, last seq of the one before, first seq of it)
        self._scopes: OrderedDict[str, str | None] = OrderedDict()
        self._pending: list[pa.Table] = []       # batches' rows not yet handed to the writer
        self._pending_rows = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)

    def start(self) -> "KVEventSubscriber":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        else:
            self._hand_over()                  # never started (or already done): nothing buffered is dropped
        self.sub.close(linger=0)

    def summary(self) -> str:
        unknown = ", ".join(f"{n} {k}" for k, n in sorted(self.unknown.items()))
        lost = sum(last - first + 1 for first, last, filled in self.gaps if not filled)
        return (f"{self.instance}: {self.batches} batches, {self.events} events, {self.hashes} block hashes, "
                f"{len(self.gaps)} gap(s) ({lost} batch(es) lost), {len(self.epochs)} restart(s), {self.bad} unreadable"
                + (f" (first: {self.errors[0]})" if self.errors else "")
                + (f", skipped unknown events: {unknown}" if unknown else ""))

    # ---- receive --------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(0 if self._pending else 100):
                    self._hand_over()          # the publisher paused: what is buffered goes to the writer now
                    continue
                frames = self.sub.recv_multipart()
                self._frame(frames)
            except Exception as e:             # noqa: BLE001 - one hostile frame never ends the subscription
                self._unreadable(f"{type(e).__name__}: {e}")
        self._hand_over()

    def _unreadable(self, why: str) -> None:
        self.bad += 1
        if len(self.errors) < 8:
            self.errors.append(why[:200])

    def _frame(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._unreadable(f"a message of {len(frames)} frame(s); expected (topic, seq, payload)")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:
            self._unreadable(f"sequence number {seq}")
            return
        if self.next_seq is not None:
            if seq < self.next_seq or seq - self.next_seq > MAX_GAP:
                self._new_epoch(seq)
            elif seq > self.next_seq:
                self._gap(self.next_seq, seq - 1)
        self._ingest(frames[0].decode(errors="replace"), seq, frames[2])
        self.next_seq = seq + 1

    def _hand_over(self) -> None:
        """Buffered batches go to the writer as one table: a batch is ~64 rows, and the writer's
        per-table work (conform, queue) would cost as much as decoding it."""
        if self._pending:
            self.writer.submit("kv_events", pa.concat_tables(self._pending))
            self._pending, self._pending_rows = [], 0

    def _gap_row(self, first: int | None, last: int | None, items: int, filled: bool, note: str) -> None:
        self.writer.submit("telemetry_gaps", pa.table({
            "instance": [self.instance], "source": ["kv_events"], "first_missing": pa.array([first], pa.int64()),
            "last_missing": pa.array([last], pa.int64()), "items": pa.array([items], pa.int64()),
            "filled": [filled], "detected_at": pa.array([time.time_ns()], pa.timestamp("ns")), "note": [note]}))

    def _new_epoch(self, seq: int) -> None:
        """The sequence went back (the publisher restarted and counts again) or leapt past any real
        loss: a new epoch, its batches kept; the old scope chains stay (hashes are content hashes)."""
        prev = self.next_seq - 1
        self.epoch += 1
        self.epochs.append((self.epoch, prev, seq))
        why = "went back" if seq <= prev else f"jumped by {seq - prev - 1} batches (over {MAX_GAP}: a renumbering)"
        self._gap_row(None, None, 0, True, f"publisher restarted: its sequence {why}, from {prev} to {seq}; epoch "
                      f"{self.epoch} begins, its batches kept (what the old one sent after {prev}, if anything, "
                      "cannot be known)")

    def _gap(self, first: int, last: int) -> None:
        """Batches first..last never arrived: ask the replay socket for them, record what stays lost."""
        got: set[int] = set()
        trouble = ""
        if self.replay_endpoint is not None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            try:
                dealer.connect(self.replay_endpoint)
                dealer.send_multipart((b"", first.to_bytes(8, "big")))
                while len(got) <= last - first and dealer.poll(2000):
                    frames = dealer.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        trouble = f" (the replay socket sent a message of {len(frames)} frame(s))"
                        break
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq == END_SEQ:
                        break
                    if first <= seq <= last and seq not in got:
                        self._ingest(self.topic, seq, frames[2])
                        got.add(seq)
            except zmq.ZMQError as e:
                trouble = f" (replay socket: {e})"
            finally:
                dealer.close(linger=0)
        filled = len(got) == last - first + 1
        self.gaps.append((first, last, filled))
        self._gap_row(first, last, last - first + 1, filled,
                      f"sequence gap {first}..{last}: " + (f"filled from {self.replay_endpoint}" if filled else
                      f"{last - first + 1 - len(got)} batch(es) lost" + ("" if self.replay_endpoint else
                                                                     " (no replay socket configured)") + trouble))

    def _ingest(self, topic: str, seq: int, payload: bytes) -> None:
        unknown: list[str] = []
        try:
            batch = (_ARRAY_DECODER if payload[:1] and 0x90 <= payload[0] <= 0x9F or payload[:1] in (b"\xdc", b"\xdd")
                     else _MAP_DECODER).decode(payload)
            ts, dp, events = batch.ts, batch.data_parallel_rank, batch.events
            kinds = [type(ev).__name__ for ev in events]
            counts = [_array_len(getattr(ev, "token_ids", _NIL)) for ev in events]
        except (msgspec.DecodeError, DecodeError):
            try:                      # another shape of the same events: the generic reader
                ts, dp, dicts, unknown = decode_batch(payload)
                events = [_Event(d) for d in dicts]
                kinds = [d["type"] for d in dicts]
                counts = [_count(ev.token_ids) for ev in events]
            except DecodeError as e:
                self._unreadable(str(e))
                return
        if not -MAX_TS < ts < MAX_TS:          # NaN fails both
            self._unreadable(f"batch time {ts!r} is not a time")
            return
        try:
            table = self._rows(topic, seq, ts, dp, kinds, events, counts) if events else None
        except (DecodeError, pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            self._unreadable(f"{type(e).__name__}: {e}")       # a hash neither bytes nor int, a size as text...
            return
        for k in unknown:
            self.unknown[k] = self.unknown.get(k, 0) + 1
        self.batches += 1
        self.events += len(events)
        if table is not None:
            self.hashes += len(table.column("block_hashes").chunk(0).values)
            self._pending.append(table)
            self._pending_rows += table.num_rows
            if self._pending_rows >= PENDING_ROWS:
                self._hand_over()

    def _rows(self, topic: str, seq: int, ts: float, dp, kinds: list[str], events: list, counts: list) -> pa.Table:
        hashes = [getattr(ev, "block_hashes", None) or [] for ev in events]
        parents = [getattr(ev, "parent_block_hash", None) for ev in events]
        block_hashes, parent_hex = _hex_lists(hashes), [_hex(p) for p in parents]
        scopes = self._chain_scopes(kinds, events, hashes, parents)
        n = len(events)
        loras = [getattr(ev, "lora_name", None) if getattr(ev, "lora_name", None) is not None
                 else getattr(ev, "lora_id", None) for ev in events]
        i32 = pa.int32()
        return pa.table({
            "instance": pa.array([self.instance] * n, pa.string()), "topic": pa.array([topic] * n, pa.string()),
            "epoch": pa.array([self.epoch] * n, i32),
            "seq": pa.array([seq] * n, pa.int64()), "ts": pa.array([int(ts * 1e9)] * n, pa.timestamp("ns")),
            "dp_rank": pa.array([dp] * n, i32), "kind": pa.array(kinds, pa.string()),
            "block_hashes": block_hashes, "parent_hash": pa.array(parent_hex, pa.string()),
            "token_count": pa.array(counts, i32),
            "block_size": pa.array([getattr(ev, "block_size", None) for ev in events], i32),
            "lora": pa.array([None if x is None else str(x) for x in loras], pa.string()),
            "medium": pa.array([getattr(ev, "medium", None) for ev in events], pa.string()),
            "group_idx": pa.array([getattr(ev, "group_idx", None) for ev in events], i32),
            "scope_h": pa.array(scopes, pa.string())})

    def _chain_scopes(self, kinds: list[str], events: list, hashes: list[list], parents: list) -> list[str | None]:
        """Each event's cache scope: SGLang's ``cache_salt`` (on every stored event), else a chain's
        first stored block's extra keys (vLLM); later blocks inherit it from their parent hash. Only
        scoped hashes are remembered (most traffic has no salt and costs nothing here); a hash
        stored again under another scope takes the newer. A salt as [salt] pseudonymises as vLLM's
        extra keys of a block with only a salt do, so one salt is one scope across both engines."""
        out: list[str | None] = [None] * len(events)
        ph = self.writer.keys.pseudonym
        for i, kind in enumerate(kinds):
            if kind == "BlockStored":
                parent = parents[i]
                ev = events[i]
                salt = getattr(ev, "cache_salt", None) or getattr(ev, "salt_or_lora", None)
                extra = ev.extra_keys
                if isinstance(salt, str) and salt:
                    scope = ph(json.dumps([salt]))
                elif parent is None and isinstance(extra, list) and extra and extra[0]:
                    scope = ph(json.dumps(extra[0], default=_hex, sort_keys=True))
                else:
                    scope = self._scopes.get(parent) if parent is not None and self._scopes else None
                if scope is not None:
                    self._scopes.update(dict.fromkeys(hashes[i], scope))
                out[i] = scope
            elif kind == "AllBlocksCleared":
                self._scopes.clear()
        while len(self._scopes) > SCOPE_MEMORY:
            self._scopes.popitem(last=False)
        return out


class _Event:
    """A generically decoded event (a dict) with the typed events' attribute names."""

    def __init__(self, d: dict):
        self.__dict__.update(d)

    def __getattr__(self, name: str):
        return None
