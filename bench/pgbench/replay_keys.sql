-- The completed keys replay.sql and acquire_replay.sql read, 'replay-1' ..
-- 'replay-<keys>', stored the way the service stores them (a 32-byte
-- fingerprint, a <payload>-byte body, no headers). Run by scripts/bench.sh
-- and scripts/bench-budget.sh:
--   psql -v keys=1000 -v payload=256 -f replay_keys.sql
INSERT INTO idempotency_records
    (namespace, operation, subject, key, state, fingerprint, fencing_token, created_at,
     expires_at, lease_expires_at, completed_at, response_status, response_body, response_headers)
SELECT 'bench', 'POST /bench', 'pgbench', 'replay-' || i, 'completed',
       '\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f'::bytea, 1, now(),
       now() + interval '24 hours', NULL, now(), 201, convert_to(repeat('x', :payload), 'UTF8'), '{}'
FROM generate_series(1, :keys) AS i
ON CONFLICT DO NOTHING;
