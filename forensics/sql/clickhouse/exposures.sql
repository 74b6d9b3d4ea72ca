-- Exposures in the window [from, to] (see exposures_in.sql).
SELECT * FROM (@exposures_in@)
