//! The client crate end to end: the typed client, `Client::run`, and the
//! HTTP and gRPC layers, against the real server and a real Postgres.

mod batching;
mod connection;
mod grpc_layer;
mod http_layer;
mod run;
mod support;
mod typed;
