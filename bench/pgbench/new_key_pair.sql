-- One "pair" as a service would write it by hand against idempotency_records:
-- reserve a fresh key (INSERT ... ON CONFLICT DO NOTHING RETURNING), then store
-- the response (UPDATE to completed, fenced by the token). Two autocommit
-- statements, two commits, like the service's Acquire then Complete.
--
-- Run with: pgbench -M prepared -n -f new_key_pair.sql -D payload=256 ...
-- Keys: 'pg-<random_seed>-<client_id>-<random bigint>', laid out in the index
-- as the load generator's are: a region per run (pgbench's :random_seed, a
-- new one per run), in it one per client (the load generator's: one per
-- caller), and a random place in that.
-- The fingerprint is the 32 bytes 0x00..0x1f, the load generator's.
\set r random(1, 1000000000000000)
INSERT INTO idempotency_records
    (namespace, operation, subject, key, state, fingerprint, fencing_token,
     created_at, expires_at, lease_expires_at)
VALUES ('bench', 'POST /bench', 'pgbench', 'pg-' || :random_seed || '-' || :client_id || '-' || :r, 'in_progress',
        '\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f'::bytea, 1,
        now(), now() + interval '24 hours', now() + interval '60 seconds')
ON CONFLICT DO NOTHING
RETURNING fencing_token;
UPDATE idempotency_records
SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
    response_status = 201, response_body = convert_to(repeat('x', :payload), 'UTF8'),
    response_headers = '{}'
WHERE namespace = 'bench' AND operation = 'POST /bench' AND subject = 'pgbench'
  AND key = 'pg-' || :random_seed || '-' || :client_id || '-' || :r AND fencing_token = 1;
