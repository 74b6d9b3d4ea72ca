-- Telemetry the collector knows it lost, oldest first (see ../gaps.sql).
SELECT instance, source, first_missing, last_missing, items, filled, detected_at, note
FROM telemetry_gaps
ORDER BY detected_at, instance, first_missing
