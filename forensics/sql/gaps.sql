-- Telemetry the collector knows it lost, oldest first: KV event sequence gaps per publisher, and
-- whether its replay socket filled them. A store with unfilled gaps is not a clean bill.
SELECT instance, source, first_missing, last_missing, items, filled, detected_at, note
FROM telemetry_gaps
ORDER BY detected_at, instance, first_missing
