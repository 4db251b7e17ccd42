use std::time::Duration;

use idempotency_client::{
    AcquireRequest, Acquisition, Client, ClientOptions, Lease, RecordId, RecordState, RetryPolicy,
};
use idempotency_tests::{TestServer, unique_key};

/// A client of `server` with default options.
pub fn client_of(server: &TestServer) -> Client {
    client_at(server.addr)
}

/// A client of `addr` (a server, or a proxy in front of one) with default
/// options.
pub fn client_at(addr: std::net::SocketAddr) -> Client {
    Client::builder()
        .endpoint(format!("http://{addr}"))
        .connect_lazy()
        .unwrap()
}

/// A client of an address where nothing listens, retrying briefly.
pub async fn client_of_nothing() -> Client {
    // A socket bound and never listening: connections to its port are
    // refused, and while it stays bound (without SO_REUSEADDR, so no
    // listener of a test running beside this one can share it) the port
    // cannot be handed to another test's server, as a port freed here could.
    let reserved = tokio::net::TcpSocket::new_v4().unwrap();
    reserved.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = reserved.local_addr().unwrap();
    std::mem::forget(reserved);
    Client::builder()
        .endpoint(format!("http://{addr}"))
        .connect_timeout(Duration::from_millis(200))
        .connect_lazy()
        .unwrap()
        .with_options(ClientOptions {
            timeout: Duration::from_millis(500),
            retry: RetryPolicy {
                max_attempts: 2,
                initial_backoff: Duration::from_millis(10),
                max_backoff: Duration::from_millis(20),
                max_elapsed: Duration::from_secs(1),
            },
            ..ClientOptions::default()
        })
}

pub fn request(label: &str) -> AcquireRequest {
    AcquireRequest::new(
        RecordId::new("payments", "POST /payments", unique_key(label)).with_subject("user-1"),
        b"fingerprint".to_vec(),
    )
}

/// Acquires a key the caller expects to hold (free, or taken over), and
/// returns its lease.
pub async fn proceed(client: &Client, request: &AcquireRequest) -> Lease {
    let key = &request.id.key;
    match client.acquire(request).await {
        Ok(Acquisition::Proceed(lease)) => lease,
        other => panic!("{key}: expected to proceed, got {other:?}"),
    }
}

/// Waits until the record reaches `state` (releases on drop are asynchronous).
pub async fn wait_for_state(client: &Client, id: &RecordId, state: RecordState) {
    for _ in 0..100 {
        if client.get(id).await.unwrap().map(|record| record.state) == Some(state) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the record never became {state:?}");
}
