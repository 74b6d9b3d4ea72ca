-- External probes run against endpoints, newest first (see ../probes.sql).
SELECT r.boot AS probe_run, r.ts AS ts, r.base_url AS base_url, r.check_name AS "check", r.verdict AS verdict,
       toInt64(count(f.check_name)) AS findings, r.pool_tokens AS pool_tokens, r.context_length AS context_length,
       r.requests AS requests, r.detail AS detail
FROM probe_runs AS r
LEFT JOIN probe_findings AS f ON f.boot = r.boot AND f.check_name = r.check_name
GROUP BY r.boot, r.ts, r.base_url, r.check_name, r.verdict, r.pool_tokens, r.context_length, r.requests, r.detail
ORDER BY ts DESC, probe_run, "check"
