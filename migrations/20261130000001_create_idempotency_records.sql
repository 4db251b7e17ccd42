-- One row per idempotency key. The primary key is the whole scope, so a key
-- sent by one service, route or user never answers another's.
CREATE TABLE idempotency_records (
    namespace        text        NOT NULL,
    operation        text        NOT NULL,
    subject          text        NOT NULL,
    key              text        NOT NULL,
    -- in_progress: an attempt holds (or held) the lease;
    -- completed / failed: the response below is stored;
    -- released: a retryable failure gave the key back for the next attempt.
    state            text        NOT NULL
        CHECK (state IN ('in_progress', 'completed', 'failed', 'released')),
    -- Empty when the caller asked not to check.
    fingerprint      bytea       NOT NULL,
    -- Fencing token of the current attempt: 1, then +1 on every takeover.
    fencing_token    bigint      NOT NULL CHECK (fencing_token > 0),
    created_at       timestamptz NOT NULL,
    -- After this the row acts as absent, whether or not cleanup removed it.
    expires_at       timestamptz NOT NULL,
    -- Set only while in_progress.
    lease_expires_at timestamptz,
    -- Set only when completed or failed.
    completed_at     timestamptz,
    response_status  integer,
    response_body    bytea,
    response_headers jsonb,
    PRIMARY KEY (namespace, operation, subject, key),
    CHECK ((state = 'in_progress') = (lease_expires_at IS NOT NULL)),
    CHECK ((state IN ('completed', 'failed')) = (completed_at IS NOT NULL)),
    CHECK ((state IN ('completed', 'failed')) = (response_status IS NOT NULL))
);

-- Cleanup deletes expired rows in batches by this index instead of scanning the table.
CREATE INDEX idempotency_records_expires_at_idx ON idempotency_records (expires_at);
