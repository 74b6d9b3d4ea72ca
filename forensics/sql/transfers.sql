-- KV transfers in [$from, $to]: reserved vs sent vs landed slot sets (sets, not counters) and
-- checksums at both ends; integrity_ok is false when the landed set is not the reserved set or
-- the checksums disagree.
WITH t AS (     -- the ledger's own set comparison; stores written before it compare the lists here
    SELECT * EXCLUDE (reserved_slots, sent_slots, landed_slots)
    FROM transfers
    WHERE ts_landed BETWEEN $from AND $to AND landed_is_reserved IS NOT NULL
    UNION ALL BY NAME
    SELECT * EXCLUDE (reserved_slots, sent_slots, landed_slots, n_reserved, n_sent, n_landed, landed_is_reserved),
           len(reserved_slots) AS n_reserved, len(sent_slots) AS n_sent, len(landed_slots) AS n_landed,
           CASE WHEN landed_slots = reserved_slots THEN true        -- the usual case: same order
                WHEN len(landed_slots) <> len(reserved_slots) THEN false
                ELSE list_sort(landed_slots) = list_sort(reserved_slots) END AS landed_is_reserved
    FROM transfers
    WHERE ts_landed BETWEEN $from AND $to AND landed_is_reserved IS NULL
)
SELECT transfer_id, seq, incarnation, src_node, dst_node,
       n_reserved AS reserved, n_sent AS sent, n_landed AS landed,
       landed_is_reserved AS landed_equals_reserved, checksum_ok, checksum_dst IS NOT NULL AS checksum_verified, outcome,
       landed_is_reserved AND coalesce(checksum_ok, true) AS integrity_ok,
       ts_submit, ts_landed, (epoch_ns(ts_landed) - epoch_ns(ts_submit)) / 1e6 AS transfer_ms
FROM t
ORDER BY ts_submit, transfer_id, incarnation
