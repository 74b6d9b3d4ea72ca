"""Engines' Prometheus ``/metrics``, read the way Prometheus reads them (``prometheus_client``'s own
text parser): into ``metrics`` rows for ``collect --scrape``, and into the few numbers ``preflight``
and ``probe`` need from a running vLLM or SGLang.

vLLM (``vllm/v1/metrics/loggers.py``): ``vllm:cache_config_info`` (an info gauge whose labels carry
``kv_cache_size_tokens``, ``num_gpu_blocks``, ``block_size``, ``enable_prefix_caching``),
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``
(tokens), ``vllm:num_requests_running`` / ``_waiting``, ``vllm:num_preemptions_total``.
SGLang (``sglang/srt/metrics/collector.py``): ``sglang:max_total_num_tokens``,
``sglang:token_usage``, ``sglang:cache_hit_rate``, ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:num_retracted_reqs``.
Only the ``vllm:`` and ``sglang:`` families are stored (and ``up``, 0 or 1 per scrape, as Prometheus
records it); ``*_created`` timestamps are not.
"""
from __future__ import annotations

import math
import threading
import time
from typing import NamedTuple

import pyarrow as pa

FAMILIES = ("vllm:", "sglang:")
MAX_SCRAPE = 16 << 20            # bytes of one /metrics page


class Sample(NamedTuple):
    family: str
    kind: str             # counter | gauge | histogram | info | summary | unknown
    name: str             # the sample's own name (..._total, ..._bucket)
    labels: dict
    value: float


def parse(text: str, families: tuple[str, ...] = FAMILIES) -> list[Sample]:
    """The samples of the named families (a prefix match) in a Prometheus text page; ValueError if
    the page is not one."""
    from prometheus_client.parser import text_string_to_metric_families
    out = []
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(families) or fam.name.endswith("_created"):
            continue
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out.append(Sample(fam.name, fam.type, s.name, dict(s.labels), float(s.value)))
    return out


def total(samples: list[Sample], name: str) -> float | None:
    """The sum of a sample name over its label sets (engines, ranks), None when absent."""
    vals = [s.value for s in samples if s.name == name]
    return sum(vals) if vals else None


class EngineMetrics(NamedTuple):
    """What a running engine's /metrics says about its pool and prefix cache."""
    engine: str | None                  # vllm | sglang
    pool_tokens: int | None
    prefix_caching: bool | None
    cache_queries: float | None         # tokens looked up in the prefix cache, so far
    cache_hits: float | None            # of which found


def engine_metrics(samples: list[Sample]) -> EngineMetrics:
    info = [s.labels for s in samples if s.name == "vllm:cache_config_info"]
    if info or any(s.family.startswith("vllm:") for s in samples):
        pool = None
        for labels in info:
            size = _int(labels.get("kv_cache_size_tokens"))
            if size is None and _int(labels.get("num_gpu_blocks")) and _int(labels.get("block_size")):
                size = _int(labels["num_gpu_blocks"]) * _int(labels["block_size"])
            pool = size if pool is None or (size is not None and size < pool) else pool
        caching = None if not info else info[0].get("enable_prefix_caching") == "True"
        return EngineMetrics("vllm", pool, caching, total(samples, "vllm:prefix_cache_queries_total"),
                             total(samples, "vllm:prefix_cache_hits_total"))
    if any(s.family.startswith("sglang:") for s in samples):
        pools = [int(s.value) for s in samples if s.name == "sglang:max_total_num_tokens" and s.value > 0]
        return EngineMetrics("sglang", min(pools) if pools else None, None, None, None)
    return EngineMetrics(None, None, None, None, None)


def _int(text) -> int | None:
    try:
        return int(str(text).replace(",", ""))
    except (TypeError, ValueError):
        return None


def metric_table(samples: list[Sample], ts_ns: int, node: str) -> pa.Table:
    """Samples as ``metrics`` rows: counters as ``sum``, gauges and info as ``gauge``, a histogram
    as one row per label set with OTLP's per-bucket counts and explicit bounds."""
    cols: dict[str, list] = {c: [] for c in ("name", "kind", "attributes", "value", "count", "sum",
                                             "bucket_counts", "boundaries")}

    def row(name, kind, labels, value=None, count=None, sm=None, buckets=None, bounds=None):
        cols["name"].append(name)
        cols["kind"].append(kind)
        cols["attributes"].append(sorted(labels.items()))
        cols["value"].append(value)
        cols["count"].append(count)
        cols["sum"].append(sm)
        cols["bucket_counts"].append(buckets)
        cols["boundaries"].append(bounds)
    hists: dict[tuple, dict] = {}
    for s in samples:
        if s.kind == "histogram":
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            h = hists.setdefault((s.family, tuple(sorted(labels.items()))), {"labels": labels, "le": []})
            if s.name.endswith("_bucket"):
                h["le"].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                h["count"] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
            continue
        row(s.name, "sum" if s.kind == "counter" else "gauge", s.labels, s.value)
    for (family, _), h in hists.items():
        le = sorted(h["le"])
        cumulative = [int(v) for _, v in le]
        per = [b - a for a, b in zip([0] + cumulative[:-1], cumulative)]
        row(family, "histogram", h["labels"], None, int(h.get("count", cumulative[-1] if cumulative else 0)),
            h.get("sum"), per, [b for b, _ in le if not math.isinf(b)])
    n = len(cols["name"])
    types = {"attributes": pa.map_(pa.string(), pa.string()), "value": pa.float64(), "count": pa.int64(),
             "sum": pa.float64(), "bucket_counts": pa.list_(pa.int64()), "boundaries": pa.list_(pa.float64())}
    table = {k: pa.array(v, types.get(k, pa.string())) for k, v in cols.items()}
    return pa.table({"ts": pa.array([ts_ns] * n, pa.timestamp("ns")), "node": pa.array([node] * n, pa.string()),
                     **table})


class Scraper:
    """Polls one target's /metrics every ``interval`` seconds on a thread, into the writer's
    ``metrics`` table; a failed scrape is an ``up`` of 0 (and the reason kept for the summary)."""

    def __init__(self, writer, url: str, instance: str, interval: float = 5.0):
        import httpx
        self.writer, self.url, self.instance, self.interval = writer, url, instance, interval
        self.http = httpx.Client(timeout=min(10.0, max(1.0, interval)), follow_redirects=False)
        self.scrapes = self.failures = self.rows = 0
        self.last_error: str | None = None
        self.last_ok = False             # the last scrape succeeded (collect's own /metrics says so)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"scrape {url}", daemon=True)

    def start(self) -> "Scraper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        self.http.close()

    def scrape_once(self) -> None:
        now = time.time_ns()
        try:
            text = self._get()
            table = metric_table(parse(text), now, self.instance)
            up = 1.0
        except Exception as e:          # noqa: BLE001 - a target down or a page that is not Prometheus text
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {e}"[:200]
            table, up = None, 0.0
        self.scrapes += 1
        self.last_ok = up == 1.0
        upt = metric_table([Sample("up", "gauge", "up", {"instance": self.instance}, up)], now, self.instance)
        self.writer.submit("metrics", upt if table is None else pa.concat_tables([table, upt]))
        self.rows += upt.num_rows + (0 if table is None else table.num_rows)

    def _get(self) -> str:
        with self.http.stream("GET", self.url, headers={"Accept": "text/plain"}) as r:
            r.raise_for_status()
            body = bytearray()
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > MAX_SCRAPE:
                    raise ValueError(f"/metrics page over {MAX_SCRAPE} bytes")
        return body.decode("utf-8", errors="replace")

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.scrape_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def summary(self) -> str:
        return (f"{self.instance}: {self.scrapes} scrape(s) of {self.url}, {self.failures} failed"
                + (f" (last: {self.last_error})" if self.last_error else "") + f", {self.rows} metric rows")
