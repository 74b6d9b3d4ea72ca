-- Whether [from, to] holds any foreign request span (forensics/sql/fleet_present.sql).
SELECT count() > 0 AS present
FROM (SELECT 1 FROM spans
      WHERE incarnation IS NULL AND input_tokens IS NOT NULL
        AND "Timestamp" BETWEEN {from:DateTime64(9, 'UTC')} AND {to:DateTime64(9, 'UTC')}
      LIMIT 1)
