-- kvledger store schema: the single source of truth for every table (Arrow schemas, the
-- segment writer, the forensic queries and the README all derive from this file).
--
-- Logical order: `lclock` is a per-node counter bumped by every engine step and every transfer
-- landing on that node; joins and ordering use it (and `step`, transfer `seq`), never wall
-- clocks, which are for people (`ts`, unix nanoseconds as TIMESTAMP_NS).
-- Runs: `boot` names one start of a deployment (16 hex chars, new at every start, unique across
-- restarts and machines; '' in stores written before it). Node names, page numbers and logical
-- counters restart with every boot, so every join and ordering keys on (node, boot); a store
-- holding many runs answers the union of each run's answer. Incarnation ids are unique across boots.
-- Pseudonyms: `*_h` columns are keyed with the store secret (HMAC-SHA256, 16 hex chars for ids;
-- AES-256 under the store's keys, 64 bits, for content tags and n-grams). Tenant ids, scopes and
-- prompt text are never stored in clear.
-- ClickHouse (telemetry/clickhouse/ddl.py generates its DDL from this file): the `-- clickhouse:` line
-- above each table gives its MergeTree sorting key, its partition (by day where the table has a
-- time) and, on a cluster, its sharding key - `everywhere`: a small table every shard holds whole.
-- A page's reads and writes share a shard (the exposure as-of join never crosses shards).

-- One row per run of KV slots written together: one write event (a prefill chunk, a decode append,
-- a transfer call landing, an offload, a reload) of consecutive slots of one page by one writer at
-- consecutive positions. Lossless: slot slot_first + i holds position position_first + i, whose
-- content tag's pseudonym is tag_h[i + 1]. (A prefill chunk fills whole pages: about page_size
-- slots per row instead of one.)
-- clickhouse: ORDER BY (node, boot, page, lclock) PARTITION BY toDate(ts) SHARD BY cityHash64(node, boot, page)
CREATE TABLE page_writes (
    node        VARCHAR NOT NULL,
    boot        VARCHAR NOT NULL,     -- the run (see the top of this file)
    lclock      BIGINT NOT NULL,
    ts          TIMESTAMP_NS NOT NULL,
    page        INTEGER NOT NULL,     -- page index in that node's pool (host tier: host page)
    generation  BIGINT NOT NULL,      -- the page's allocation generation at write time
    slot_first  SMALLINT NOT NULL,    -- offset inside the page of the run's first slot
    n_slots     SMALLINT NOT NULL,    -- slots in the run
    position_first INTEGER NOT NULL,  -- logical token position of the first slot in the writer's sequence
    writer      BIGINT NOT NULL,      -- writer request incarnation (from the tag plane's writer word)
    scope_h     VARCHAR,              -- the writer's cache scope (keyed; NULL: writer unknown to this process)
    tag_h       BIGINT[] NOT NULL,    -- keyed pseudonym of each slot's content tag, in slot order
    path        VARCHAR NOT NULL,     -- prefill | decode | transfer_landing | offload | reload
    trace_id    VARCHAR,
    span_id     VARCHAR
);

-- One row per (reader, page, generation, block-table column) over a run of reads that found the
-- same generation and failing slots and the same writer in every slot, either reading the same
-- slots each time or one slot more each time (the page the reader fills with its own decode).
-- Lossless: every read step is inside exactly one row's [step_first, step_last] with n_reads
-- counting them, and the k-th read (k = 0 .. n_reads - 1) read slots_first + k slots if
-- slots_read > slots_first, else slots_read; found_writers holds what every read found there.
-- clickhouse: ORDER BY (node, boot, page, reader, lclock_first) PARTITION BY toDate(ts_first) SHARD BY cityHash64(node, boot, page)
CREATE TABLE page_reads (
    node            VARCHAR NOT NULL,
    boot            VARCHAR NOT NULL,
    reader          BIGINT NOT NULL,  -- reader request incarnation
    scope_h         VARCHAR,          -- the reader's cache scope (keyed)
    page            INTEGER NOT NULL,
    generation      BIGINT NOT NULL,  -- generation the reader was granted for this page
    found_generation BIGINT NOT NULL, -- generation found in the page header at read time
    block_index     INTEGER NOT NULL, -- column in the reader's block table: positions block_index*S + slot
    slots_read      SMALLINT NOT NULL, -- slots read by the run's last read (the most)
    slots_first     SMALLINT,          -- slots read by its first read (NULL in stores written before it)
    bad_mask        BIGINT NOT NULL,  -- bit s set: slot s failed the read check (generation or content tag)
    check_passed    BOOLEAN NOT NULL,
    found_writers   BIGINT[] NOT NULL, -- writer incarnation per slot found in the tag plane (-1: slot not read)
    found_scopes_h  VARCHAR[],         -- cache scope (keyed) of each slot's found writer (NULL: not read / unknown)
    attention_mass  DOUBLE,           -- summed over the run: mean softmax mass on the page per step, averaged
                                      -- over layers. Measured on decode reads and on every page of a prefill
                                      -- chunk that reads a page the read check flags; NULL where a read of the
                                      -- run went through the fused kernel unmeasured (EngineConfig.exact_mass)
    step_first      BIGINT NOT NULL,
    step_last       BIGINT NOT NULL,
    lclock_first    BIGINT NOT NULL,
    lclock_last     BIGINT NOT NULL,
    n_reads         INTEGER NOT NULL,
    ts_first        TIMESTAMP_NS NOT NULL,
    ts_last         TIMESTAMP_NS NOT NULL,
    trace_id        VARCHAR,
    span_id         VARCHAR
);

-- The exposure index: the slot-level as-of join (forensics/sql/exposure_slots.sql) computed by the
-- ledger writer as it folds each batch of steps, from the same rows it writes (the reads that
-- failed the check, and the last write recorded before each read in each failing slot), flushed
-- with the page_reads rows it derives from and chained and signed like every table. One row per
-- (group of failing reads, write found in some of their failing slots): the reads of one (node,
-- reader, page, generation, block column, found generation, failing slots, epoch) in one fold,
-- and one write they found (its writer is the donor; -1: no write recorded in those slots). The
-- read aggregates (n_reads .. span_id) are the group's, repeated on each of its rows (part 0
-- carries them once). Derived, never trusted: `kvledger forensics verify-index` recomputes the
-- join from the ledger and names any difference.
-- clickhouse: ORDER BY (node, boot, page, reader, lclock_first) PARTITION BY toDate(ts_first) SHARD BY cityHash64(node, boot, page)
CREATE TABLE exposure_index (
    node            VARCHAR NOT NULL,
    boot            VARCHAR NOT NULL,
    reader          BIGINT NOT NULL,  -- the response (reader incarnation)
    page            INTEGER NOT NULL,
    generation      BIGINT NOT NULL,  -- generation the reader was granted
    found_generation BIGINT NOT NULL,
    block_index     INTEGER NOT NULL,
    bad_mask        BIGINT NOT NULL,  -- the reads' failing slots
    epoch           BIGINT NOT NULL,  -- clock of the last write to any failing slot at or before the reads (-1: none)
    part            SMALLINT NOT NULL, -- the write's rank among the group's (0: the row that carries the aggregates)
    slot_mask       BIGINT NOT NULL,  -- the failing slots where this write was found (the reader's own left out)
    donor           BIGINT NOT NULL,  -- its writer (-1: no write recorded: unwritten)
    donor_held      BOOLEAN,          -- the donor read this page in write_generation itself (a holder), as far
                                      -- as the ledger had recorded by this fold
    write_lclock    BIGINT,
    write_generation BIGINT,
    write_path      VARCHAR,
    written_at      TIMESTAMP_NS,
    position_offset INTEGER,          -- donor position of slot s: s + position_offset
    slots_read      SMALLINT NOT NULL, -- the most slots one of the reads read
    attention_mass  DOUBLE,           -- summed over the group's reads (NULL: a read unmeasured)
    n_reads         INTEGER NOT NULL,
    step_first      BIGINT NOT NULL,
    step_last       BIGINT NOT NULL,
    lclock_first    BIGINT NOT NULL,
    lclock_last     BIGINT NOT NULL,
    ts_first        TIMESTAMP_NS NOT NULL,
    ts_last         TIMESTAMP_NS NOT NULL,
    trace_id        VARCHAR,
    span_id         VARCHAR
);

-- One row per KV transfer (disaggregated mode), written when it lands or fails.
-- clickhouse: ORDER BY (src_node, boot, ts_submit, transfer_id) PARTITION BY toDate(ts_submit) SHARD BY cityHash64(incarnation)
CREATE TABLE transfers (
    transfer_id     BIGINT NOT NULL,
    seq             BIGINT NOT NULL,  -- transfer sequence number on the source node
    incarnation     BIGINT NOT NULL,
    src_node        VARCHAR NOT NULL,
    boot            VARCHAR NOT NULL,  -- the run of both nodes (a deployment starts its nodes together)
    dst_node        VARCHAR NOT NULL,
    reserved_slots  INTEGER[] NOT NULL,  -- logical positions decode reserved
    sent_slots      INTEGER[] NOT NULL,  -- logical positions prefill sent
    landed_slots    INTEGER[] NOT NULL,  -- logical positions whose records landed
    n_reserved      INTEGER,              -- len(reserved_slots), len(sent_slots), len(landed_slots) and
    n_sent          INTEGER,              -- whether landed_slots = reserved_slots as sets: computed from
    n_landed        INTEGER,              -- the same sets as they are written, so integrity queries need
    landed_is_reserved BOOLEAN,           -- not read the lists (NULL in stores written before them)
    checksum_src    VARCHAR,
    checksum_dst    VARCHAR,              -- NULL when decode did not verify
    checksum_ok     BOOLEAN,
    outcome         VARCHAR NOT NULL,     -- admitted | rejected: <reason> | abandoned
    lclock_dst      BIGINT NOT NULL,
    ts_submit       TIMESTAMP_NS NOT NULL,
    ts_landed       TIMESTAMP_NS NOT NULL,
    trace_id        VARCHAR,
    span_id         VARCHAR
);

-- One row per request incarnation as a node admits it, written by the page ledger in the fold
-- before any of its reads: who the request is for before its finished span exists, so a response
-- still running, or cut off by a crash, has its tenant and arrival in the store (requests.sql
-- takes these for incarnations with no request span: finished = false). Sharded as the request
-- spans are (by incarnation): a shard holds both halves of its requests.
-- clickhouse: ORDER BY (node, boot, incarnation) PARTITION BY toDate(ts) SHARD BY cityHash64(toString(incarnation))
CREATE TABLE arrivals (
    node          VARCHAR NOT NULL,
    boot          VARCHAR NOT NULL,
    incarnation   BIGINT NOT NULL,
    tenant_h      VARCHAR NOT NULL,     -- the tenant's pseudonym
    scope_h       VARCHAR NOT NULL,     -- its cache scope's pseudonym
    prompt_tokens BIGINT NOT NULL,      -- prompt tokens received (what a finished request is billed)
    ts            TIMESTAMP_NS NOT NULL
);

-- One row per page-set release.
-- clickhouse: ORDER BY (node, boot, lclock) PARTITION BY toDate(ts) SHARD BY cityHash64(node, boot)
CREATE TABLE releases (
    node        VARCHAR NOT NULL,
    boot        VARCHAR NOT NULL,
    incarnation BIGINT NOT NULL,
    pages       INTEGER[] NOT NULL,
    kind        VARCHAR NOT NULL,     -- immediate | deferred
    ended_by    VARCHAR NOT NULL,     -- immediate | drain | timeout
    hold_ns     BIGINT NOT NULL,
    lclock      BIGINT NOT NULL,
    ts          TIMESTAMP_NS NOT NULL
);

-- One row per node at start (and whenever its configuration changes).
-- clickhouse: ORDER BY (node, boot, ts) PARTITION BY toYYYYMM(ts) SHARD BY everywhere
CREATE TABLE config_snapshots (
    node            VARCHAR NOT NULL,
    boot            VARCHAR NOT NULL,
    role            VARCHAR NOT NULL,
    ts              TIMESTAMP_NS NOT NULL,
    pool_tokens     BIGINT NOT NULL,
    context_length  BIGINT NOT NULL,      -- the context this node serves (after preflight=fit: lowered)
    advertised_context BIGINT NOT NULL,   -- the context it was configured to advertise
    page_size       INTEGER NOT NULL,
    pool_fits_context BOOLEAN NOT NULL,   -- pool_tokens >= advertised_context
    preflight_action VARCHAR NOT NULL,    -- ok | recorded (started anyway) | lowered (context fitted to the pool)
    policy          VARCHAR NOT NULL,
    guards          MAP(VARCHAR, BOOLEAN) NOT NULL,
    isolation_level VARCHAR NOT NULL,
    model           VARCHAR NOT NULL,
    kv_format_version VARCHAR NOT NULL,
    kvledger_version VARCHAR NOT NULL,
    page_ledger     BOOLEAN,              -- the run records page reads and writes (NULL: written before this column)
    exposure_index  BOOLEAN               -- its ledger writes the exposure index beside it (NULL: written before it)
);

-- Spans, modelled on the OpenTelemetry Collector's ClickHouse `otel_traces` table; attributes as
-- maps, hot fields promoted to typed columns (snake_case, after the Collector's columns).
-- clickhouse: ORDER BY (ServiceName, SpanName, toDateTime(Timestamp)) PARTITION BY toDate(Timestamp) SHARD BY cityHash64(ifNull(toString(incarnation), TraceId))
CREATE TABLE spans (
    "Timestamp"        TIMESTAMP_NS NOT NULL,
    "TraceId"          VARCHAR NOT NULL,
    "SpanId"           VARCHAR NOT NULL,
    "ParentSpanId"     VARCHAR NOT NULL,
    "TraceState"       VARCHAR NOT NULL,
    "SpanName"         VARCHAR NOT NULL,
    "SpanKind"         VARCHAR NOT NULL,
    "ServiceName"      VARCHAR NOT NULL,
    "ResourceAttributes" MAP(VARCHAR, VARCHAR) NOT NULL,
    "ScopeName"        VARCHAR NOT NULL,
    "ScopeVersion"     VARCHAR NOT NULL,
    "SpanAttributes"   MAP(VARCHAR, VARCHAR) NOT NULL,
    "Duration"         BIGINT NOT NULL,   -- nanoseconds
    "StatusCode"       VARCHAR NOT NULL,
    "StatusMessage"    VARCHAR NOT NULL,
    "Events.Timestamp" TIMESTAMP_NS[] NOT NULL,
    "Events.Name"      VARCHAR[] NOT NULL,
    "Links.TraceId"    VARCHAR[] NOT NULL,
    "Links.SpanId"     VARCHAR[] NOT NULL,
    incarnation        BIGINT,
    node               VARCHAR,
    boot               VARCHAR,           -- the run (kvledger.boot resource attribute)
    operation          VARCHAR,           -- request | admission | prefill | kv_transfer | decode
    tenant_h           VARCHAR,
    scope_h            VARCHAR,
    input_tokens       BIGINT,            -- billed prompt tokens (gen_ai.usage.input_tokens)
    prefilled_tokens   BIGINT,            -- prompt tokens whose KV this request actually computed
    cached_tokens      BIGINT,            -- served from the prefix cache
    output_tokens      BIGINT,
    ttft_s             DOUBLE,
    finish_reason      VARCHAR,
    error_type         VARCHAR,
    rejected_at        VARCHAR,           -- router | prefill:<node> | decode:<node>
    request_id         VARCHAR            -- the engine's own request id (gen_ai.request.id / gen_ai.response.id)
);

-- Metric points from the OpenTelemetry metrics SDK (one row per data point per export).
-- clickhouse: ORDER BY (name, node, boot, ts) PARTITION BY toDate(ts) SHARD BY cityHash64(node, boot)
CREATE TABLE metrics (
    ts              TIMESTAMP_NS NOT NULL,
    node            VARCHAR NOT NULL,
    boot            VARCHAR NOT NULL,
    name            VARCHAR NOT NULL,
    kind            VARCHAR NOT NULL,     -- sum | gauge | histogram
    attributes      MAP(VARCHAR, VARCHAR) NOT NULL,
    value           DOUBLE,               -- sum / gauge value
    count           BIGINT,               -- histogram
    sum             DOUBLE,
    bucket_counts   BIGINT[],
    boundaries      DOUBLE[]
);

-- Keyed hashes (store secret) of every n-gram of n tokens of each request's prompt and output that
-- can be evidence (at least 4 distinct tokens holding a letter or digit: never a run of spaces or
-- punctuation), computed as the request streams (its prompt at the first fold after its arrival,
-- its output as it comes, each window once): a response still running or cut off by a crash is
-- judged on what it had streamed. Forensics tells "surfaced" from "read" with no
-- plaintext, and ``pos`` tells whether the recipient read the slots that n-gram's KV sits in.
-- clickhouse: ORDER BY (incarnation, role, hash) SHARD BY cityHash64(incarnation)
CREATE TABLE ngrams (
    incarnation BIGINT NOT NULL,
    role        VARCHAR NOT NULL,     -- prompt | output
    n           SMALLINT NOT NULL,
    hash        BIGINT NOT NULL,
    pos         INTEGER               -- the window's first token in that prompt / output (NULL: written before it)
);

-- External probes (`kvledger probe --store`): one row per check of a probe run against an endpoint.
-- The API keys and canaries never appear in clear: keyed pseudonyms only.
-- clickhouse: ORDER BY (boot, check_name) PARTITION BY toYYYYMM(ts) SHARD BY everywhere
CREATE TABLE probe_runs (
    boot            VARCHAR NOT NULL,  -- the probe run (one id per `kvledger probe` invocation)
    ts              TIMESTAMP_NS NOT NULL, -- when the run finished
    base_url        VARCHAR NOT NULL,
    model           VARCHAR,
    tenant_a_h      VARCHAR NOT NULL,  -- keyed pseudonym of tenant A's API key (plants canaries)
    tenant_b_h      VARCHAR NOT NULL,  -- keyed pseudonym of tenant B's API key (looks for them)
    pool_tokens     BIGINT,            -- as discovered (or given)
    context_length  BIGINT,
    discovered_from VARCHAR,
    check_name      VARCHAR NOT NULL,  -- limits | usage | canary | salt | timing | abort
    verdict         VARCHAR NOT NULL,  -- pass | finding | inconclusive
    detail          VARCHAR NOT NULL,
    requests        INTEGER NOT NULL   -- requests the whole run sent
);

-- clickhouse: ORDER BY (boot, check_name) SHARD BY everywhere
CREATE TABLE probe_findings (
    boot            VARCHAR NOT NULL,  -- the probe run
    check_name      VARCHAR NOT NULL,
    response_id     VARCHAR,           -- the endpoint's id of the response that showed it
    prompt_tokens   BIGINT,
    canary_h        VARCHAR,           -- keyed pseudonym of the canary that showed (canary, abort)
    why             VARCHAR NOT NULL,
    evidence        VARCHAR NOT NULL   -- the finding as JSON, canary text removed
);

-- KV cache events from vLLM / SGLang publishers (`kvledger collect --kv-events`): one row per event.
-- clickhouse: ORDER BY (instance, seq) PARTITION BY toDate(ts) SHARD BY cityHash64(instance)
CREATE TABLE kv_events (
    boot            VARCHAR NOT NULL,  -- the collect run
    instance        VARCHAR NOT NULL,  -- the publisher (its endpoint, or the name given to it)
    topic           VARCHAR NOT NULL,
    epoch           INTEGER,           -- 0, then +1 each time the publisher's sequence restarts (NULL: before epochs)
    seq             BIGINT NOT NULL,   -- the publisher's batch sequence number, within its epoch
    ts              TIMESTAMP_NS NOT NULL, -- the batch's own time
    dp_rank         INTEGER,           -- data-parallel rank (newer publishers)
    kind            VARCHAR NOT NULL,  -- BlockStored | BlockRemoved | AllBlocksCleared
    block_hashes    VARCHAR[] NOT NULL, -- the engine's own value: bytes as hex, ints as signed decimal
    parent_hash     VARCHAR,
    token_count     INTEGER,
    block_size      INTEGER,
    lora            VARCHAR,           -- lora_name, else lora_id
    medium          VARCHAR,           -- GPU | CPU | ... (NULL: not reported)
    group_idx       INTEGER,
    scope_h         VARCHAR            -- keyed pseudonym of the chain's first block's extra keys (cache_salt,
                                       -- LoRA, MM ids): blocks chained by parent hash inherit it; NULL: none
);

-- Telemetry the collector knows it lost: sequence gaps in KV event streams (and whether the replay
-- socket filled them), spans refused under back-pressure. Missing data is never a clean bill.
-- clickhouse: ORDER BY (instance, detected_at) PARTITION BY toYYYYMM(detected_at) SHARD BY everywhere
CREATE TABLE telemetry_gaps (
    boot            VARCHAR NOT NULL,
    instance        VARCHAR NOT NULL,
    source          VARCHAR NOT NULL,  -- kv_events | otlp
    first_missing   BIGINT,            -- sequence numbers (kv_events)
    last_missing    BIGINT,
    items           BIGINT NOT NULL,   -- batches or spans lost (before any replay)
    filled          BOOLEAN NOT NULL,  -- recovered from the replay socket
    detected_at     TIMESTAMP_NS NOT NULL,
    note            VARCHAR NOT NULL
);

-- Capacity each foreign engine instance reported in its start-up log (`kvledger ingest-logs`):
-- vLLM's "GPU KV cache size: N tokens" / "# GPU blocks: N", SGLang's max_total_num_tokens.
-- clickhouse: ORDER BY (instance, ingested_at) SHARD BY everywhere
CREATE TABLE capacity (
    boot            VARCHAR NOT NULL,  -- the ingest run
    instance        VARCHAR NOT NULL,  -- name it as the spans' service.instance.id to join them
    pool_tokens     BIGINT,
    context_length  BIGINT,
    source          VARCHAR NOT NULL,  -- which line, which file
    ingested_at     TIMESTAMP_NS NOT NULL
);

-- Corruption detectors' lines from a foreign engine's log (`kvledger ingest-logs`): KV canary
-- violations and KV checksum mismatches, one row per line.
-- clickhouse: ORDER BY (instance, source_file, line_no) SHARD BY everywhere
CREATE TABLE engine_log_events (
    boot            VARCHAR NOT NULL,
    instance        VARCHAR NOT NULL,
    kind            VARCHAR NOT NULL,  -- kv_canary | kv_checksum
    line_no         BIGINT NOT NULL,
    logged_at       TIMESTAMP_NS,      -- the line's own time, when it has one (taken as UTC)
    source_file     VARCHAR NOT NULL,
    line            VARCHAR NOT NULL   -- the line, at most 500 characters
);
