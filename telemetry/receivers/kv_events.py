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

import msgspec
import pyarrow as pa
import zmq

END_SEQ = -1
SCOPE_MEMORY = 1 << 20          # block hash -> scope entries kept for chaining (oldest forgotten)
_COLS = ("instance", "topic", "seq", "ts", "dp_rank", "kind", "block_hashes", "parent_hash", "token_count",
         "block_size", "lora", "medium", "group_idx", "scope_h")


class DecodeError(ValueError):
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)

    def start(self) -> "KVEventSubscriber":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sub.close(linger=0)

    # ---- receive --------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
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
            ts, dp, events = decode_batch(payload)
        except DecodeError:
            self.bad += 1
            return
        self.batches += 1
        cols: dict[str, list] = {c: [] for c in _COLS}
        ph = self.writer.keys.pseudonym
        for ev in events:
            hashes = [h.hex() if type(h) is bytes else _hex(h) for h in ev.get("block_hashes") or []]
            parent = _hex(ev.get("parent_block_hash"))
            scope = None
            if ev["type"] == "BlockStored":
                extra = ev.get("extra_keys")
                if parent is None and extra and extra[0]:
                    scope = ph(json.dumps(extra[0], default=_hex, sort_keys=True))
                elif parent is not None:
                    scope = self._scopes.get(parent)
                self._scopes.update(dict.fromkeys(hashes, scope))
            elif ev["type"] == "AllBlocksCleared":
                self._scopes.clear()
            toks = ev.get("token_ids")
            lora = ev.get("lora_name") if ev.get("lora_name") is not None else ev.get("lora_id")
            for c, v in (("instance", self.instance), ("topic", topic), ("seq", seq), ("ts", int(ts * 1e9)),
                         ("dp_rank", dp), ("kind", ev["type"]), ("block_hashes", hashes), ("parent_hash", parent),
                         ("token_count", len(toks) if toks is not None else None), ("block_size", ev.get("block_size")),
                         ("lora", None if lora is None else str(lora)), ("medium", ev.get("medium")),
                         ("group_idx", ev.get("group_idx")), ("scope_h", scope)):
                cols[c].append(v)
            self.hashes += len(hashes)
        self.events += len(events)
        while len(self._scopes) > SCOPE_MEMORY:
            self._scopes.popitem(last=False)
        if events:
            types = {"seq": pa.int64(), "ts": pa.timestamp("ns"), "dp_rank": pa.int32(), "token_count": pa.int32(),
                     "block_size": pa.int32(), "group_idx": pa.int32(), "block_hashes": pa.list_(pa.string())}
            self.writer.submit("kv_events", pa.table({k: pa.array(v, types.get(k, pa.string())) for k, v in cols.items()}))
