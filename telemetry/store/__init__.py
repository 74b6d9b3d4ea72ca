"""The store: immutable Parquet segments in a signed hash chain, read through DuckDB.

Where things are:
- ``schema.sql``, ``schema.py``  every table (the one source of truth) and its Arrow schemas
- ``keys.py``     key custody: the signing, pseudonym and n-gram keys, outside the store
- ``chain.py``    the signed chain, the intent, the anchor, ``verify``
- ``columns.py``  batches as numpy columns on their way into a segment; Parquet options
- ``writer.py``   ``SegmentWriter``: segments, links and anchors, one writer at a time
- ``reader.py``   ``open_store``: an in-memory DuckDB over exactly the chained segments

The names below are the store's public face (``from telemetry.store import SegmentWriter``).
"""
from telemetry.errors import StoreError  # noqa: F401
from telemetry.store.chain import GENESIS, Link, Verdict, anchor_path, read_chain, verify  # noqa: F401
from telemetry.store.columns import Coded, Columns, Ragged  # noqa: F401
from telemetry.store.reader import (carried, open_store, resolve_boot, resolve_run, segment_files, segment_merges,  # noqa: F401
                                    table_relation)
from telemetry.store.writer import FLUSH_INTERVAL, SegmentWriter, has_live_writer  # noqa: F401
