"""The forensic queries on ClickHouse: the same names, columns and rows as ``forensics.queries.duckdb.Forensics``
(DuckDB), from the ClickHouse SQL in ``forensics/sql/clickhouse``.

    fx = ClickHouseForensics(store="./kvledger-store")                 # embedded (chdb): nothing to start
    fx = ClickHouseForensics(dsn="clickhouse://host:8123/kvledger")    # a server `kvledger export` fills
    fx.query("exposures"); fx.exposure_slots(); fx.queries(["scores", "tenants"])

chdb: the store is verified, then mirrored into an embedded ClickHouse database (one per store,
``store_<store id>``, under ``~/.cache/kvledger/chdb`` or ``--chdb-path``) by the same idempotent
export a server gets - each call copies only the segments added since the last. A server: the rows
``kvledger export`` copied there (after verifying the store it copied them from), every store it
holds together.

Every base table a query names is bound in a leading WITH clause: to the database's table, to that
table filtered to one run (``run``), or - ``spans_table`` - to an OpenTelemetry Collector
``otel_traces`` table read in place, its attributes mapped to the typed columns as the OTLP
receiver maps them. ``requests``, ``exposure_g``, ``exposure_x`` (the as-of join's steps: not where
the exposure index serves), ``exposure_slots`` and ``exposure_ngrams`` are materialised once per
instance as temporary tables (a snapshot, as DuckDB's).
"""
from __future__ import annotations

import datetime as dt
import itertools
import os
import re
import weakref
from functools import cache
from pathlib import Path

import polars as pl
import pyarrow as pa

from forensics.queries.base import CLICKHOUSE_ONLY, ForensicsBackend, with_response_state, without_order
from forensics.queries.duckdb import DEFAULTS, EPOCH, FAR, SQL_DIR, unverified_note
from telemetry.clickhouse import ChdbTarget, ClickHouseError, Target, connect, export
from telemetry.store import StoreError, has_live_writer, resolve_boot
from telemetry.store.chain import HashCache, Verdict, verify
from telemetry.store.schema import arrow_schemas, collector_span_columns

CH_DIR = SQL_DIR / "clickhouse"
MATERIALISED = ["requests", "exposure_g", "exposure_x", "exposure_slots", "exposure_ngrams"]
DEPENDS = {"exposure_x": ["exposure_g"]}     # materialised first (exposure_x names exposure_g)
JOIN_ONLY = {"exposure_g", "exposure_x"}     # the as-of join's steps: not needed beside the index
SETTINGS = {"join_use_nulls": 1}
_ids = itertools.count()


def default_chdb_path() -> Path:
    base = os.environ.get("KVLEDGER_CHDB_PATH")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvledger" / "chdb"


@cache
def ch_sql(name: str) -> str:
    """A query's ClickHouse text with its includes (@exposures_in@, @scores_in@) spliced in."""
    path = CH_DIR / f"{name}.sql"
    if not path.exists():
        raise KeyError(f"no ClickHouse query named {name!r} in {CH_DIR}")
    text = path.read_text()
    body = _strip_comments(text)
    return text if body == text else re.sub(r"@(\w+)@", lambda m: ch_sql(m.group(1)), body)


def _strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


# how the Collector's ClickHouse exporter types a column where ours differs (LowCardinality and enum
# strings, a UInt64 duration, the event names array); every other column is read as it is
COLLECTOR_CAST = {"SpanName": "toString(SpanName)", "SpanKind": "toString(SpanKind)",
                  "ServiceName": "toString(ServiceName)", "Duration": "toInt64(Duration)",
                  "StatusCode": "toString(StatusCode)", "Events.Name": "arrayMap(x -> toString(x), `Events.Name`)"}


def otel_spans(table: str, tenant_attribute: str = "tenant.id") -> str:
    """The spans table's columns read from a Collector-written ``otel_traces`` table (the exporter's
    DDL): the typed columns from the attributes, first present wins, as the OTLP receiver fills them.
    The tenant is the attribute's value as the Collector stored it (no store key to pseudonymise it
    with); the run is the ``kvledger.boot`` resource attribute ('' when absent)."""
    def first_int(*names):
        return "coalesce(" + ", ".join(f"toInt64OrNull(SpanAttributes['{n}'])" for n in names) + ")"

    def first_str(*names):
        return "coalesce(" + ", ".join(f"nullIf(SpanAttributes['{n}'], '')" for n in names) + ")"

    ta = tenant_attribute.replace("'", "")
    # the Collector's own columns, named by schema.sql (the one list), read as the exporter typed them
    collector = ", ".join(f'{COLLECTOR_CAST.get(c, f"`{c}`")} AS "{c}"' for c in collector_span_columns())
    return f"""
    SELECT {collector},
           toInt64OrNull(SpanAttributes['kvledger.incarnation']) AS incarnation,
           coalesce(nullIf(ResourceAttributes['service.instance.id'], ''), nullIf(ResourceAttributes['host.name'], ''),
                    toString(ServiceName)) AS node,
           ResourceAttributes['kvledger.boot'] AS boot,
           if({first_int('gen_ai.usage.input_tokens', 'gen_ai.usage.prompt_tokens')} IS NULL, NULL, 'request') AS operation,
           coalesce(nullIf(SpanAttributes['{ta}'], ''), nullIf(ResourceAttributes['{ta}'], '')) AS tenant_h,
           CAST(NULL AS Nullable(String)) AS scope_h,
           {first_int('gen_ai.usage.input_tokens', 'gen_ai.usage.prompt_tokens')} AS input_tokens,
           {first_int('kvledger.prompt_tokens.prefilled')} AS prefilled_tokens,
           {first_int('gen_ai.usage.cache_read.input_tokens')} AS cached_tokens,
           {first_int('gen_ai.usage.output_tokens', 'gen_ai.usage.completion_tokens')} AS output_tokens,
           coalesce(toFloat64OrNull(SpanAttributes['gen_ai.latency.time_to_first_token']),
                    toFloat64OrNull(SpanAttributes['kvledger.time_to_first_token'])) AS ttft_s,
           {first_str('gen_ai.response.finish_reasons')} AS finish_reason,
           {first_str('error.type')} AS error_type,
           CAST(NULL AS Nullable(String)) AS rejected_at,
           {first_str('gen_ai.request.id', 'gen_ai.response.id')} AS request_id
    FROM {table}"""


class ClickHouseForensics:
    def __init__(self, store: str | Path | None = None, run: str | None = None, *, engine: str = "chdb",
                 dsn: str | None = None, chdb_path: str | Path | None = None, spans_table: str | None = None,
                 tenant_attribute: str = "tenant.id", allow_unverified: bool = False, anchor=None,
                 cache: dict | None = None, progress=None, use_index: bool = True):
        self.engine, self.run, self.spans_table = engine, run, spans_table
        self.phase = None           # (the ClickHouse engines say nothing of their build)
        self.uid = f"kvl{os.getpid()}_{next(_ids)}"
        if spans_table and not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)?", spans_table):
            raise ClickHouseError(f"--spans-table {spans_table!r}: expected TABLE or DATABASE.TABLE")
        if engine == "chdb":
            if store is None:
                raise StoreError("--engine chdb answers over a local store: give --store")
            self.store = Path(store)
            self.live = has_live_writer(self.store)
            if not (self.store / "chain").is_dir():
                raise StoreError(f"no kvledger store at {self.store} (expected {self.store}/chain)")
            if cache is None:               # a command: the segment hashes of earlier commands (outside the store)
                cache = HashCache(self.store)
            self.verdict = verify(self.store, anchor, cache=cache)
            if isinstance(cache, HashCache):
                cache.save()
            if not self.verdict.ok and not allow_unverified:
                raise StoreError(f"store {self.store} does not verify: {self.verdict.broken}; refusing to answer "
                                 "(--allow-unverified answers anyway, and says so in every output)")
            self.target: Target = ChdbTarget(chdb_path or default_chdb_path(), f"store_{self.verdict.store_id}")
            # the verified prefix only: a broken tail is never copied
            try:
                export(self.store, self.target, anchor=anchor, cache=cache, progress=progress, allow_unverified=True)
            except ClickHouseError as e:
                if "not the store that was exported" not in str(e):
                    raise
                # a mirror of an earlier history of this store (e.g. restored from a backup): it is only
                # a cache, so it is rebuilt from the store in hand
                self.target.command(f"DROP DATABASE IF EXISTS `{self.target.database}`")
                export(self.store, self.target, anchor=anchor, cache=cache, progress=progress, allow_unverified=True)
        elif engine == "clickhouse":
            if not dsn:
                raise ClickHouseError("--engine clickhouse needs --dsn clickhouse://HOST:8123/DATABASE")
            self.store, self.live = None, None
            self.target = connect(dsn)
            # what the server holds was verified by `kvledger export` before it was copied
            self.verdict = Verdict(True, 0, 0, "", None, [])
        else:
            raise ClickHouseError(f"unknown engine {engine!r}: expected chdb or clickhouse")
        self.db = self.target.database
        self.source = self.target.url + (f" (spans from {spans_table})" if spans_table else "")
        self.tenant_attribute = tenant_attribute
        self.boot = None
        if run is not None:
            boots = self.target.query_arrow(f"SELECT DISTINCT boot FROM `{self.db}`.config_snapshots").column(0)
            self.boot = resolve_boot(boots.to_pylist(), run)
        self._made: list[str] = []
        self._drop = weakref.finalize(self, _drop_temporary, self.target, self.uid, self._made)
        # the slot-level answers from the exposure index where every ledger run wrote it (as DuckDB does)
        self.indexed = use_index and self._indexed()

    def _indexed(self) -> bool:
        cols = self.target.query_arrow(f"SELECT name FROM system.columns WHERE database = '{self.db}' "
                                       "AND table = 'config_snapshots'").column(0).to_pylist()
        if "exposure_index" not in cols:
            return False
        text = self._bind("SELECT count() FROM config_snapshots WHERE ifNull(page_ledger, true) "
                          "AND NOT ifNull(exposure_index, false)")
        return self.target.query_arrow(text, self._params(text, None, None, {})).column(0)[0].as_py() == 0

    # ---- SQL binding ----
    def _source(self, table: str) -> str:
        if table == "spans" and self.spans_table:
            src = f"({otel_spans(self.spans_table, self.tenant_attribute)})"
        else:
            src = f"`{self.db}`.`{table}`"
        if self.boot is not None and "boot" in arrow_schemas()[table].names:
            return f"SELECT * FROM {src} WHERE boot = {{run_boot:String}}"
        return f"SELECT * FROM {src}"

    def _bind(self, text: str) -> str:
        """Bind every table name the text uses: base tables and the materialised ones."""
        ctes = []
        for t in arrow_schemas():
            if re.search(rf"\b{t}\b", text):
                ctes.append(f"{t} AS ({self._source(t)})")
        for m in self._made:
            if re.search(rf"\b{m}\b", text):
                ctes.append(f"{m} AS (SELECT * FROM {self.uid}_{m})")
        body = _strip_comments(text).strip()
        if not ctes:
            return body
        if re.match(r"WITH\b", body, re.I):
            return "WITH " + ",\n".join(ctes) + ",\n" + body[4:].lstrip()
        return "WITH " + ",\n".join(ctes) + "\n" + body

    def _params(self, text: str, start, end, params: dict) -> dict:
        values = {**DEFAULTS, **params, "from": start or EPOCH, "to": end or FAR, "run_boot": self.boot}
        return {k: v for k, v in values.items() if "{" + k + ":" in text}

    def _ensure(self, name: str) -> None:
        if name in self._made:
            return
        for dep in DEPENDS.get(name, []):
            self._ensure(dep)
        text = self._bind(ch_sql("exposure_slots_index" if name == "exposure_slots" and self.indexed else name))
        self.target.command_params(f"CREATE TEMPORARY TABLE {self.uid}_{name} ENGINE = Memory AS {text}",
                                   self._params(text, None, None, {}), SETTINGS)
        self._made.append(name)

    def materialise(self) -> None:
        for m in MATERIALISED:
            if not (m in JOIN_ONLY and self.indexed):
                self._ensure(m)

    def _prepare(self, text: str) -> None:
        """Materialise what the query's text (its includes spliced in) names, with the tables
        MATERIALISED lists before it (each is made from those before it): a query that reads
        exposure_slots and not exposure_ngrams (ttft) does not wait for the n-gram evidence."""
        body = _strip_comments(text)
        named = [i for i, m in enumerate(MATERIALISED) if re.search(rf"\b{m}\b", body)]
        for m in MATERIALISED[:max(named) + 1] if named else []:
            if not (m in JOIN_ONLY and self.indexed):
                self._ensure(m)

    def query(self, name: str, start: dt.datetime | None = None, end: dt.datetime | None = None,
              **params) -> pl.DataFrame:
        return self._query(ch_sql(name), start, end, params)

    def _query(self, body: str, start, end, params: dict) -> pl.DataFrame:
        self._prepare(body)
        text = self._bind(body)
        return with_response_state(to_polars(self.target.query_arrow(text, self._params(text, start, end, params),
                                                                      SETTINGS)), self.live)

    def queries(self, names: list[str], start: dt.datetime | None = None, end: dt.datetime | None = None,
                workers: int = 1, unordered: tuple[str, ...] = (), **params) -> dict[str, pl.DataFrame]:
        """Several named queries over this snapshot (one after another: a ClickHouse session runs one
        statement at a time; the server parallelises each); ``unordered``: these without their
        closing ORDER BY (``base.without_order``)."""
        return {n: self._query(without_order(ch_sql(n)) if n in unordered else ch_sql(n), start, end, params)
                for n in names}

    @property
    def unverified_note(self) -> str | None:
        note = unverified_note(self.verdict)
        # the export copies the verified prefix only: say where it stops
        return note and note.replace("; these answers", f"; only segments 0..{self.verdict.seq} (the verified "
                                     "prefix) were exported; these answers")

    def exposure_slots(self) -> pl.DataFrame:
        self.materialise()
        return to_polars(self.target.query_arrow(f"SELECT * FROM {self.uid}_exposure_slots", None, SETTINGS))

    def exposures(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> pl.DataFrame:
        return self.query("exposures", start, end)

    def evidence_pending(self) -> bool:
        return False            # no early banner here: the dashboard waits for exposures

    def early_pairs(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> None:
        return None

    def requests(self) -> pl.DataFrame:
        self._ensure("requests")
        return to_polars(self.target.query_arrow(f"SELECT * FROM {self.uid}_requests", None, SETTINGS))

    def request_count(self) -> int:
        self._ensure("requests")
        return int(self.target.query_arrow(f"SELECT count() FROM {self.uid}_requests", None, SETTINGS)
                   .column(0)[0].as_py())

    def tenant_names(self) -> list[str]:
        self._ensure("requests")
        return self.target.query_arrow(f"SELECT DISTINCT tenant_h FROM {self.uid}_requests WHERE tenant_h IS NOT NULL "
                                       "ORDER BY tenant_h", None, SETTINGS).column(0).to_pylist()

    def foreign_requests(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> bool:
        text = self._bind(ch_sql("fleet_present"))
        return bool(self.target.query_arrow(text, self._params(text, start, end, {}), SETTINGS).column(0)[0].as_py())

    def page_ledgers(self) -> pl.DataFrame:
        return self.query("runs").select("boot", "page_ledger")

    def rows(self, table: str) -> int:
        if table not in arrow_schemas():
            raise KeyError(f"no table {table!r} in the store schema")
        text = self._bind(f"SELECT count() FROM {table}")
        return int(self.target.query_arrow(text, self._params(text, None, None, {}), SETTINGS).column(0)[0].as_py())

    def close(self) -> None:
        self._drop()
        self.target.close()


def _drop_temporary(target: Target, uid: str, made: list[str]) -> None:
    """Drop an instance's temporary tables (on close, or when it is garbage collected: a dashboard
    opens a snapshot per refresh, and chdb's session outlives them all)."""
    for m in made:
        try:
            target.command(f"DROP TEMPORARY TABLE IF EXISTS {uid}_{m}")
        except ClickHouseError:
            pass
    made.clear()


def to_polars(t: pa.Table) -> pl.DataFrame:
    """ClickHouse's Arrow in DuckDB's types: naive UTC timestamps, signed integers."""
    cols = []
    for f, col in zip(t.schema, t.columns):
        typ = f.type
        if pa.types.is_timestamp(typ) and typ.tz is not None:
            col = col.cast(pa.timestamp(typ.unit))
        elif pa.types.is_unsigned_integer(typ):
            col = col.cast(pa.int64())
        elif pa.types.is_dictionary(typ):
            col = col.cast(typ.value_type)
        cols.append(col)
    return pl.from_arrow(pa.Table.from_arrays(cols, names=t.column_names))


def open_forensics(store, run=None, *, engine: str = "duckdb", dsn: str | None = None, **kw) -> ForensicsBackend:
    """The forensics of one engine: DuckDB (the default) over the local store, or ClickHouse."""
    if engine == "duckdb":
        if dsn:
            raise ClickHouseError("--dsn is for --engine clickhouse")
        from forensics.queries.duckdb import Forensics
        return Forensics(store, run, **{k: v for k, v in kw.items() if k not in CLICKHOUSE_ONLY})
    return ClickHouseForensics(store, run, engine=engine, dsn=dsn, **kw)
