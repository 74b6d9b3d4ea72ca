-- The foreign engines' own corruption detectors (`kvledger ingest-logs`): KV canary violations and
-- KV checksum mismatches, by instance and time.
SELECT instance, kind, logged_at, source_file, line_no, line
FROM engine_log_events
ORDER BY logged_at NULLS LAST, instance, source_file, line_no
