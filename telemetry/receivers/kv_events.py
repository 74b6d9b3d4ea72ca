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

Block hashes are ints (older) or bytes (newer); both are stored as hex. A sequence gap (a batch
number skipped) is recorded in ``telemetry_gaps`` and, when the publisher has a replay socket
(ROUTER: send ``(b"", start_seq 8 bytes)``, receive ``(seq, payload)`` ... until seq -1), filled
from it. The cache scope of a block chain is the keyed pseudonym of its first block's extra keys
(where vLLM puts ``cache_salt``); later blocks inherit it through ``parent_block_hash``.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Optional, Union

import msgspec
import numpy as np
import pyarrow as pa
import zmq

from engine.errors import KvledgerError

END_SEQ = -1
PENDING_ROWS = 8192             # rows buffered before they go to the writer (sooner when the publisher pauses)
SCOPE_MEMORY = 1 << 20          # block hash -> scope entries kept for chaining (oldest forgotten)


class DecodeError(KvledgerError, ValueError):
    pass


def _hex(h) -> str | None:
    if h is None:
        return None
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    if isinstance(h, int):
        return format(h & ((1 << 256) - 1), "x")
    raise DecodeError(f"block hash of type {type(h).__name__}")


_FIELDS = {     # positional (array_like) field order per tag, the older encoding
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def decode_batch(payload: bytes) -> tuple[float, int | None, list[dict]]:
    """(ts, dp rank, events as dicts with a ``type``) from either encoding."""
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
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise DecodeError("an event batch needs a numeric ts and a list of events")
    out = []
    for ev in events:
        if isinstance(ev, dict):
            kind = ev.get("type")
            d = ev
        elif isinstance(ev, list) and ev and isinstance(ev[0], str):
            kind = ev[0]
            d = dict(zip(_FIELDS.get(kind, ()), ev[1:]))
        else:
            raise DecodeError(f"an event is a tagged array or map, got {type(ev).__name__}")
        if kind not in _FIELDS:
            raise DecodeError(f"unknown event type {kind!r}")
        out.append({**d, "type": kind})
    return float(ts), dp, out


# ---- typed decoding (the fast path) --------------------------------------------------------------
# The same two encodings as msgspec Structs: decoded in C, token ids left undecoded (only their count
# is kept), unknown map keys and extra trailing array fields ignored. A batch these do not fit
# (a field of another type) falls back to decode_batch, which reads any shape it can.
Hash = Union[bytes, int]
_NIL = msgspec.Raw(b"\xc0")


def _decoder(array_like: bool) -> msgspec.msgpack.Decoder:
    def struct(name, fields, **kw):
        return msgspec.defstruct(name, fields, array_like=array_like, **kw)
    stored = struct("BlockStored", [
        ("block_hashes", list[Hash], []), ("parent_block_hash", Optional[Hash], None), ("token_ids", msgspec.Raw, _NIL),
        ("block_size", Optional[int], None), ("lora_id", Optional[int], None), ("medium", Optional[str], None),
        ("lora_name", Optional[str], None), ("extra_keys", Optional[list], None), ("group_idx", Optional[int], None)],
        tag="BlockStored")
    removed = struct("BlockRemoved", [("block_hashes", list[Hash], []), ("medium", Optional[str], None),
                                      ("group_idx", Optional[int], None)], tag="BlockRemoved")
    cleared = struct("AllBlocksCleared", [], tag="AllBlocksCleared")
    batch = struct("Batch", [("ts", float), ("events", list[Union[stored, removed, cleared]]),
                             ("data_parallel_rank", Optional[int], None)])
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
    """One publisher: SUB (and optionally DEALER for replay) on a thread; rows go to the writer."""

    def __init__(self, writer, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 instance: str | None = None, ctx: zmq.Context | None = None):
        self.writer, self.endpoint, self.replay_endpoint = writer, endpoint, replay_endpoint
        self.topic, self.instance = topic, instance or endpoint
        self.ctx = ctx or zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.next_seq: int | None = None
        self.batches = self.events = self.hashes = self.bad = 0
        self.gaps: list[tuple[int, int, bool]] = []
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

    # ---- receive --------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(0 if self._pending else 100):
                self._hand_over()              # the publisher paused: what is buffered goes to the writer now
                continue
            frames = self.sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.bad += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if self.next_seq is not None and seq > self.next_seq:
                self._gap(self.next_seq, seq - 1)
            if self.next_seq is None or seq >= self.next_seq:
                self._ingest(frames[0].decode(errors="replace"), seq, frames[2])
                self.next_seq = seq + 1
        self._hand_over()

    def _hand_over(self) -> None:
        """Buffered batches go to the writer as one table: a batch is ~64 rows, and the writer's
        per-table work (conform, queue) would cost as much as decoding it."""
        if self._pending:
            self.writer.submit("kv_events", pa.concat_tables(self._pending))
            self._pending, self._pending_rows = [], 0

    def _gap(self, first: int, last: int) -> None:
        """Batches first..last never arrived: ask the replay socket for them, record what stays lost."""
        got = set()
        if self.replay_endpoint is not None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.connect(self.replay_endpoint)
            try:
                dealer.send_multipart((b"", first.to_bytes(8, "big")))
                while dealer.poll(2000):
                    _, seq_b, payload = dealer.recv_multipart()
                    seq = int.from_bytes(seq_b, "big", signed=True)
                    if seq == END_SEQ:
                        break
                    if first <= seq <= last:
                        self._ingest(self.topic, seq, payload)
                        got.add(seq)
            finally:
                dealer.close(linger=0)
        filled = len(got) == last - first + 1
        self.gaps.append((first, last, filled))
        self.writer.submit("telemetry_gaps", pa.table({
            "instance": [self.instance], "source": ["kv_events"], "first_missing": pa.array([first], pa.int64()),
            "last_missing": pa.array([last], pa.int64()), "items": pa.array([last - first + 1], pa.int64()),
            "filled": [filled], "detected_at": pa.array([time.time_ns()], pa.timestamp("ns")),
            "note": [f"sequence gap {first}..{last}: " + (f"filled from {self.replay_endpoint}" if filled else
                     f"{last - first + 1 - len(got)} batch(es) lost" + ("" if self.replay_endpoint else
                                                                     " (no replay socket configured)"))]}))

    def _ingest(self, topic: str, seq: int, payload: bytes) -> None:
        try:
            batch = (_ARRAY_DECODER if payload[:1] and 0x90 <= payload[0] <= 0x9F or payload[:1] in (b"\xdc", b"\xdd")
                     else _MAP_DECODER).decode(payload)
            ts, dp, events = batch.ts, batch.data_parallel_rank, batch.events
            kinds = [type(ev).__name__ for ev in events]
            counts = [_array_len(getattr(ev, "token_ids", _NIL)) for ev in events]
        except (msgspec.DecodeError, DecodeError):
            try:                      # another shape of the same events: the generic reader
                ts, dp, dicts = decode_batch(payload)
                events = [_Event(d) for d in dicts]
                kinds = [d["type"] for d in dicts]
                counts = [_count(ev.token_ids) for ev in events]
            except DecodeError:
                self.bad += 1
                return
        try:
            table = self._rows(topic, seq, ts, dp, kinds, events, counts) if events else None
        except (DecodeError, pa.ArrowInvalid, pa.ArrowTypeError):   # a hash neither bytes nor int, a size as text...
            self.bad += 1
            return
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
        """Each event's cache scope: a chain's first stored block gives it (its extra keys), later
        blocks inherit it from their parent hash. Only scoped hashes are remembered (most traffic has
        no salt and costs nothing here); a hash stored again under another scope takes the newer."""
        out: list[str | None] = [None] * len(events)
        ph = self.writer.keys.pseudonym
        for i, kind in enumerate(kinds):
            if kind == "BlockStored":
                parent = parents[i]
                extra = events[i].extra_keys
                if parent is None and extra and extra[0]:
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
