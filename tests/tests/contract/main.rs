//! The contract of `proto/idempotency/v1/idempotency.proto`, end to end:
//! the real server on 127.0.0.1, a real Postgres (a database per test),
//! the generated client.

mod acquire;
mod admin;
mod batch;
mod bounds;
mod complete;
mod connections;
mod fail;
mod frozen;
mod health;
mod isolation;
mod lease;
mod migrations;
mod observability;
mod outage;
mod plans;
mod race;
mod read_first;
mod reaper;
mod replay_cache;
mod replicas;
mod scoping;
mod shutdown;
mod stream;
mod support;
mod ttl;
mod validation;
