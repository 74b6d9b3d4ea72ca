-- External probes run against endpoints (`kvledger probe --store`), newest first: one row per check
-- of each probe run, its verdict, how many findings it recorded and what it measured.
SELECT r.boot AS probe_run, r.ts, r.base_url, r.check_name AS "check", r.verdict,
       count(f.check_name) AS findings, r.pool_tokens, r.context_length, r.requests, r.detail
FROM probe_runs r
LEFT JOIN probe_findings f ON f.boot = r.boot AND f.check_name = r.check_name
GROUP BY ALL
ORDER BY r.ts DESC, r.boot, r.check_name
