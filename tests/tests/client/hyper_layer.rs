//! The HTTP layer on plain hyper, without axum: hyper's own request body
//! (`Incoming`) goes in, the layer's `RequestBody` reaches the handler.

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, server::conn::http1};
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use idempotency_client::http::{HttpConfig, IdempotencyLayer, RequestBody};
use idempotency_tests::{http_app::HttpClient, spawn_app, unique_key};
use tower::{Layer, ServiceExt, service_fn};

use crate::support::*;

/// Serves `/payments` with hyper alone; the handler echoes its body and counts its calls.
async fn hyper_payments(
    client: idempotency_client::Client,
) -> (std::net::SocketAddr, Arc<AtomicU32>) {
    let charges = Arc::new(AtomicU32::default());
    let handler = {
        let charges = charges.clone();
        service_fn(move |request: Request<RequestBody>| {
            let charges = charges.clone();
            async move {
                let body = request.into_body().collect().await.unwrap().to_bytes();
                tokio::time::sleep(Duration::from_millis(300)).await;
                let call = charges.fetch_add(1, Ordering::SeqCst) + 1;
                let answer = format!(
                    r#"{{"call":{call},"request":{}}}"#,
                    String::from_utf8_lossy(&body)
                );
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(answer)))
                        .unwrap(),
                )
            }
        })
    };
    let service = IdempotencyLayer::new(client, HttpConfig::new("shop")).layer(handler);
    // The layer takes hyper's body as it comes: no conversion in between.
    let service = service.map_request(|request: Request<Incoming>| request);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
        }
    });
    (addr, charges)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_hyper_service_runs_once_and_replays_with_hyper_s_own_body() {
    let app = spawn_app().await;
    let (addr, charges) = hyper_payments(client_of(&app.server)).await;
    let http = HttpClient::new(addr);
    let key = unique_key("hyper");

    let (first, second) = tokio::join!(
        http.post("/payments", Some(&key), "alice", r#"{"amount":1000}"#),
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            http.post("/payments", Some(&key), "alice", r#"{"amount":1000}"#)
                .await
        }
    );
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.body, r#"{"call":1,"request":{"amount":1000}}"#);
    assert_eq!(second.status, 409, "{second:?}");

    let replay = http
        .post("/payments", Some(&key), "alice", r#"{ "amount" : 1000 }"#)
        .await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    let other = http
        .post("/payments", Some(&key), "alice", r#"{"amount":2000}"#)
        .await;
    assert_eq!(other.status, 422, "{other:?}");
    // A request without a key passes through, its body intact.
    let unkeyed = http
        .post("/payments", None, "alice", r#"{"amount":5}"#)
        .await;
    assert_eq!(unkeyed.body, r#"{"call":2,"request":{"amount":5}}"#);
    assert_eq!(charges.load(Ordering::SeqCst), 2);
}
