-- The durable ceiling as it was until 2026-12-06 (ceiling_pair.sql is the
-- one measured now): the same statements, but the :keys keys of a statement
-- are adjacent in the primary key ('c-<client>-<r>-<i>'), so each statement
-- touches one or two leaf pages, where the service's statements (and
-- ceiling_pair.sql's) touch one per key. make bench measures it at its
-- highest concurrency beside the ceiling, to show what the layout changed
-- (docs/performance.md, "The ceiling's keys").
--
-- Run with: pgbench -M prepared -n -f ceiling_pair_adjacent.sql -D payload=256 -D keys=32 ...
-- keys/s = transactions/s x :keys. (The UPDATE's keys are an array, `= ANY`,
-- so that its prepared plan is an index scan whatever :keys is: with `IN
-- (SELECT ...)` the generic plan expects 1,000 rows and scans the table.)
\set r random(1, 1000000000000000)
INSERT INTO idempotency_records
    (namespace, operation, subject, key, state, fingerprint, fencing_token,
     created_at, expires_at, lease_expires_at)
SELECT 'bench', 'POST /bench', 'pgbench', 'c-' || :client_id || '-' || :r || '-' || i, 'in_progress',
       '\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f'::bytea, 1,
       now(), now() + interval '24 hours', now() + interval '60 seconds'
FROM generate_series(1, :keys) AS i
ON CONFLICT DO NOTHING
RETURNING fencing_token;
UPDATE idempotency_records
SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
    response_status = 201, response_body = convert_to(repeat('x', :payload), 'UTF8'),
    response_headers = '{}'
WHERE namespace = 'bench' AND operation = 'POST /bench' AND subject = 'pgbench'
  AND key = ANY (ARRAY(SELECT 'c-' || :client_id || '-' || :r || '-' || i
                       FROM generate_series(1, :keys) AS i))
  AND fencing_token = 1;
