//! The idempotency service. The request path, top to bottom:
//!
//! - [`settings`]: command line and environment, each setting declared once
//!   ([`database_url`]: the database URL, checked, and redacted for logs);
//! - [`startup`]: builds everything from the settings (the metrics recorder
//!   first, the pool, the listeners bound, the parts wired), then serves
//!   until a shutdown future resolves, and drains;
//! - [`grpc`]: thin adapters, protobuf in and out, errors mapped to statuses
//!   in one place ([`grpc::status`]);
//! - [`engine`]: the rules (acquire, complete, fail, renew, get; leases and fencing),
//!   with [`replay_cache`] answering repeated Acquires of finished records;
//! - [`store`]: the only module with SQL;
//! - [`domain`]: the types every layer speaks (ids, fingerprints, responses, limits).
//!
//! Around them: [`security`] (TLS, caller identity, the namespace policy;
//! applied to calls by `grpc::auth`), [`db`] (pool and migrations), [`health`] (the database probe
//! behind `grpc.health.v1`), [`telemetry`] (logs and the metrics recorder;
//! `otel`, with the feature of that name: OpenTelemetry export of each call's span),
//! [`metrics`] (the name and HELP text of every metric), [`maintenance`]
//! (the reaper and the table gauges), [`admin`] (the operator commands),
//! [`shutdown`] (the process signal), [`join`] (a batch's per-item futures,
//! run together).
//!
//! A call followed file by file, the batching path and the tasks: `docs/architecture.md`.
#![forbid(unsafe_code)]

pub mod admin;
pub mod database_url;
pub mod db;
pub mod domain;
pub mod engine;
pub mod error;
pub mod grpc;
pub mod health;
pub mod join;
pub mod maintenance;
pub mod metrics;
#[cfg(feature = "otel")]
pub mod otel;
pub mod replay_cache;
pub mod security;
pub mod settings;
pub mod shutdown;
pub mod startup;
pub mod store;
pub mod telemetry;
