-- A replay as the service runs it: the Acquire statement of
-- server/src/store/statements.rs (`insert_or_read`) for one completed key.
-- The server binds each column as an array; here each array is built from
-- one pgbench variable, which pgbench binds as a parameter, so that the
-- planner sees what it sees for the server's (arrays of unknown length, a
-- generic plan). Beside replay.sql (the plain SELECT of the same key) it
-- shows what the statement's shape costs in Postgres, apart from the
-- server's own time (scripts/bench-budget.sh prints both). Keep it in step
-- with `insert_or_read`.
--
-- Run with: pgbench -M prepared -n -f acquire_replay.sql -D keys=1000
--   -D ns=bench -D "op=POST /bench" -D sub=pgbench -D "ttl=24 hours"
--   -D "lease=60 s" -D wait=100ms
--   -D fp='\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f' ...
-- (the keys of replay.sql, 'replay-1' .. 'replay-<keys>', stored beforehand).
\set k random(1, :keys)
WITH input AS (
    SELECT * FROM unnest(ARRAY[:ns]::text[], ARRAY[:op]::text[], ARRAY[:sub]::text[], ARRAY['replay-' || :k]::text[], ARRAY[:fp::bytea]::bytea[],
                         ARRAY[:ttl::interval]::interval[], ARRAY[:lease::interval]::interval[])
        WITH ORDINALITY AS v(namespace, operation, subject, key, fingerprint, ttl, lease, ord)
    WHERE set_config('lock_timeout', coalesce(:wait, current_setting('lock_timeout')), true)
          IS NOT NULL
), inserted AS (
    INSERT INTO idempotency_records
        (namespace, operation, subject, key, state, fingerprint, fencing_token,
         created_at, expires_at, lease_expires_at)
    SELECT namespace, operation, subject, key, 'in_progress', fingerprint,
           idempotency_lifetime_token(),
           now(), now() + greatest(ttl, lease), now() + lease
    FROM input
    ORDER BY ord
    ON CONFLICT (namespace, operation, subject, key) DO NOTHING
    RETURNING namespace, operation, subject, key, state, fingerprint, fencing_token,
              created_at, expires_at, lease_expires_at, completed_at,
              response_status, response_body, response_headers
)
SELECT i.ord, true AS inserted, x.state, x.fingerprint, x.fencing_token, x.created_at,
       x.expires_at, x.lease_expires_at, x.completed_at, x.response_status,
       x.response_body, x.response_headers, now() AS db_now
FROM input i JOIN inserted x USING (namespace, operation, subject, key)
UNION ALL
SELECT i.ord, false, r.state, r.fingerprint, r.fencing_token, r.created_at,
       r.expires_at, r.lease_expires_at, r.completed_at, r.response_status,
       r.response_body, r.response_headers, now()
FROM input i JOIN idempotency_records r USING (namespace, operation, subject, key)
WHERE NOT EXISTS (SELECT 1 FROM inserted x
                  WHERE (x.namespace, x.operation, x.subject, x.key)
                      = (i.namespace, i.operation, i.subject, i.key));
