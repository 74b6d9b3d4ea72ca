"""The store on ClickHouse (``ddl``, ``targets``, ``export``): DDL generated from ``schema.sql`` and an idempotent, resumable export.

    ddl("kvledger")                       CREATE DATABASE / TABLE statements, one MergeTree per table
    ddl("kvledger", cluster="prod")       the cluster variant: ReplicatedMergeTree ``<table>_local`` on
                                          every shard, a ``Distributed`` table in front of it
    target = connect("clickhouse://host:8123/kvledger")    a server, through clickhouse-connect
    target = connect("chdb:/var/lib/kvledger-chdb?db=kvledger")  embedded ClickHouse (chdb): nothing to start
    export(store, target)                 verify the chain, then copy every segment not yet copied

One source of truth: the columns and their types come from ``schema.sql`` as DuckDB parses it; the
``-- clickhouse:`` line above each table gives the sorting key (chosen for the as-of join: node,
boot, page, then the logical clock), the partition (by day where the table has a time) and the
cluster's sharding key. A page's reads and writes hash to one shard (``cityHash64(node, boot,
page)``), so the exposure join never crosses shards; small tables (``everywhere``) are held whole
by every shard (a ReplicatedMergeTree whose ZooKeeper path has no shard in it).

Type mapping: VARCHAR String, BIGINT Int64, INTEGER Int32, SMALLINT Int16, DOUBLE Float64, BOOLEAN
Bool, TIMESTAMP_NS DateTime64(9, 'UTC'), MAP(VARCHAR, V) Map(LowCardinality(String), V) (as the
OpenTelemetry Collector's ``otel_traces``), T[] Array(T). A column without NOT NULL is Nullable(T),
except arrays, which ClickHouse cannot make Nullable: a NULL list is exported as [] (no query tells
the two apart). String arrays hold Nullable(String) elements (``found_scopes_h`` has NULLs).

Export is idempotent per segment: each segment's rows go in as one insert whose deduplication token
is the segment's sha256 (MergeTree drops a repeated token: ``non_replicated_deduplication_window``),
then a row naming it (store id, seq, table, sha256, rows) goes into ``kvledger_segments``. A re-run
skips what that table names; a crash between the two re-inserts the segment under the same token,
which ClickHouse drops. A segment seq recorded with another sha256 is refused: the store in hand is
not the one exported.
"""
from telemetry.clickhouse.ddl import SEGMENTS, ClickHouseError, ch_type, columns, ddl, layouts  # noqa: F401
from telemetry.clickhouse.export import ExportResult, ensure_schema, export, exported, follow, segment_table  # noqa: F401
from telemetry.clickhouse.targets import ChdbTarget, ServerTarget, Target, chdb_session, connect  # noqa: F401
