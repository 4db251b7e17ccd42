-- Fencing tokens come from one sequence, for every record, so that no two
-- attempts ever hold the same token. A per-record counter started again at 1
-- whenever a record expired: a holder that overran its lease on a record whose
-- TTL was no longer than the lease (so the record expired with the lease) saw
-- its token 1 accepted for the next, unrelated attempt, and Complete stored the
-- stale holder's response.
--
-- A key's attempts still get increasing tokens: a takeover draws its token
-- while it holds the row, after the previous holder's token was drawn, and a
-- new record for the key is inserted only after the old row is gone.
--
-- NO CYCLE (the default): the sequence errors out rather than hand out a token
-- twice; at a million new attempts a second it lasts 290,000 years.
CREATE SEQUENCE idempotency_fencing_tokens AS bigint MINVALUE 1 NO CYCLE;

-- Start above every token the table holds now. Tokens of records deleted
-- before this migration were per-record counters, as small as these.
SELECT setval('idempotency_fencing_tokens',
              coalesce((SELECT max(fencing_token) FROM idempotency_records), 0) + 1,
              false);
