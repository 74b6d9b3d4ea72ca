-- KV canary and KV checksum lines from foreign engines' logs (see ../canary.sql).
SELECT instance, kind, logged_at, source_file, line_no, line
FROM engine_log_events
ORDER BY logged_at NULLS LAST, instance, source_file, line_no
