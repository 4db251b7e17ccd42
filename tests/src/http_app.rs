//! A payments HTTP service wrapped in the idempotency layer, and an HTTP
//! client to call it over 127.0.0.1.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client as HyperClient, connect::HttpConnector},
    rt::TokioExecutor,
};
use idempotency_client::{
    Client,
    http::{HttpConfig, IdempotencyLayer},
};
use tokio::task::JoinHandle;

/// What the fake bank did, per route and user.
#[derive(Debug, Default)]
pub struct Ledger {
    calls: Mutex<HashMap<String, u32>>,
}

impl Ledger {
    fn record(&self, what: String) -> u32 {
        let mut calls = self.calls.lock().unwrap();
        let count = calls.entry(what).or_default();
        *count += 1;
        *count
    }

    /// How often the handler ran for `route` on behalf of `user`.
    pub fn calls(&self, route: &str, user: &str) -> u32 {
        self.calls
            .lock()
            .unwrap()
            .get(&format!("{route} {user}"))
            .copied()
            .unwrap_or(0)
    }
}

#[derive(Clone)]
struct AppState {
    ledger: Arc<Ledger>,
    bank_delay: Duration,
}

/// The handler behind both routes: waits for "the bank", then answers by
/// the `outcome` the request asks for (`ok`, `declined` → 402, `bank_down` → 500),
/// or with the `status` it asks for (`{"status":429}`), its body naming the call.
async fn charge(route: &'static str, state: AppState, headers: HeaderMap, body: Bytes) -> Response {
    tokio::time::sleep(state.bank_delay).await;
    let user = headers
        .get("x-user-id")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("anonymous");
    let call = state.ledger.record(format!("{route} {user}"));
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if let Some(status) = request["status"]
        .as_u64()
        .and_then(|code| u16::try_from(code).ok())
        .and_then(|code| StatusCode::from_u16(code).ok())
    {
        return (
            status,
            format!(r#"{{"status":{},"call":{call}}}"#, status.as_u16()),
        )
            .into_response();
    }
    match request["outcome"].as_str().unwrap_or("ok") {
        "declined" => {
            (StatusCode::PAYMENT_REQUIRED, r#"{"error":"card declined"}"#).into_response()
        }
        "bank_down" => (StatusCode::BAD_GATEWAY, "the bank is down").into_response(),
        "huge" => (StatusCode::CREATED, "x".repeat(4096)).into_response(),
        "huge_bank_down" => (StatusCode::BAD_GATEWAY, "x".repeat(4096)).into_response(),
        _ => (
            StatusCode::CREATED,
            [
                (header::CONTENT_TYPE, "application/json".to_string()),
                (header::LOCATION, format!("{route}/{user}-{call}")),
                (
                    header::HeaderName::from_static("x-not-replayed"),
                    "only-first".to_string(),
                ),
            ],
            format!(r#"{{"route":"{route}","user":"{user}","call":{call}}}"#),
        )
            .into_response(),
    }
}

/// The payments app on 127.0.0.1, `/payments` and `/refunds` behind the layer.
pub struct PaymentsApp {
    pub addr: SocketAddr,
    pub ledger: Arc<Ledger>,
    task: JoinHandle<()>,
}

impl PaymentsApp {
    /// `config` is completed with the subject (`x-user-id`) and the excluded `/meta/trace_id`.
    pub async fn start(client: Client, config: HttpConfig, bank_delay: Duration) -> Self {
        let config = config
            .exclude_json_pointer("/meta/trace_id")
            .subject(|request| {
                request
                    .headers
                    .get("x-user-id")
                    .and_then(|value| value.to_str().ok())
                    .map(str::to_owned)
            });
        let ledger = Arc::new(Ledger::default());
        let state = AppState {
            ledger: ledger.clone(),
            bank_delay,
        };
        let app = Router::new()
            .route(
                "/payments",
                post(|State(s): State<AppState>, h: HeaderMap, b: Bytes| {
                    charge("/payments", s, h, b)
                }),
            )
            .route(
                "/payments/{id}/capture",
                post(|State(s): State<AppState>, h: HeaderMap, b: Bytes| {
                    charge("/payments/{id}/capture", s, h, b)
                }),
            )
            .route(
                "/refunds",
                post(|State(s): State<AppState>, h: HeaderMap, b: Bytes| {
                    charge("/refunds", s, h, b)
                }),
            )
            .layer(IdempotencyLayer::new(client, config))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { addr, ledger, task }
    }
}

impl Drop for PaymentsApp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A response as the end client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpAnswer {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
}

impl HttpAnswer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }
}

/// An HTTP/1.1 client for the app.
#[derive(Clone)]
pub struct HttpClient {
    base: String,
    inner: HyperClient<HttpConnector, Full<Bytes>>,
}

impl HttpClient {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            base: format!("http://{addr}"),
            inner: HyperClient::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// POSTs JSON `body` to `path` with the key (when given) on behalf of `user`.
    pub async fn post(&self, path: &str, key: Option<&str>, user: &str, body: &str) -> HttpAnswer {
        self.post_with(path, key, user, body, &[]).await
    }

    /// [`Self::post`] with `headers` added (e.g. a `traceparent`).
    pub async fn post_with(
        &self,
        path: &str,
        key: Option<&str>,
        user: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> HttpAnswer {
        let mut request = http::Request::post(format!("{}{path}", self.base))
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-user-id", user);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        let response = self.inner.request(request).await.expect("the app answers");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        HttpAnswer {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }
}
