//! The client crate end to end: the typed client, `Client::run`, and the
//! HTTP and gRPC layers, and trace context, against the real server and a real Postgres.

mod batching;
mod connection;
mod grpc_layer;
mod http_layer;
mod hyper_layer;
mod run;
mod stream;
mod support;
mod trace;
mod typed;
