//! Harness for the end-to-end tests: a fresh database per test, the real
//! server on `127.0.0.1:0`, the generated client, and a TCP proxy that can cut
//! the server off from Postgres.

mod database;
pub mod http_app;
mod proxy;
mod server;

pub use database::TestDb;
pub use proxy::TcpProxy;
pub use server::{TestServer, server_pool, test_config};

use std::sync::atomic::{AtomicU64, Ordering};

use idempotency_client::pb;

/// A key no other test uses, 8+ printable ASCII characters.
pub fn unique_key(label: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{label}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// An id in the `payments` namespace for `POST /payments` on behalf of `user-1`.
pub fn record_id(key: &str) -> pb::RecordId {
    pb::RecordId {
        namespace: "payments".into(),
        operation: "POST /payments".into(),
        subject: "user-1".into(),
        key: key.into(),
    }
}

pub fn seconds(seconds: i64) -> prost_types::Duration {
    prost_types::Duration { seconds, nanos: 0 }
}

/// A response as an HTTP service would store it.
pub fn response(status_code: u32, body: &str) -> pb::StoredResponse {
    pb::StoredResponse {
        status_code,
        body: body.as_bytes().to_vec(),
        headers: [
            ("content-type".to_string(), "application/json".to_string()),
            ("location".to_string(), "/payments/42".to_string()),
        ]
        .into(),
    }
}
