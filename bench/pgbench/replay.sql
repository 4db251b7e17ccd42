-- A replay as a service would write it by hand: one primary-key SELECT of a
-- completed key. The keys 'replay-1' .. 'replay-<keys>' are inserted beforehand
-- (scripts/bench.sh does it).
--
-- Run with: pgbench -M prepared -n -f replay.sql -D keys=1000 ...
\set k random(1, :keys)
SELECT state, fingerprint, fencing_token, created_at, expires_at, lease_expires_at,
       completed_at, response_status, response_body, response_headers, now() AS db_now
FROM idempotency_records
WHERE namespace = 'bench' AND operation = 'POST /bench' AND subject = 'pgbench'
  AND key = 'replay-' || :k;
