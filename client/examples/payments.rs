//! An HTTP payments service made idempotent by one layer.
//!
//! `POST /payments` "calls the bank" (sleeps `--bank-delay`), counts a
//! charge, and answers `201`. Run the idempotency service (`make run`), then:
//!
//! ```sh
//! cargo run -p idempotency-client --features http --example payments
//! # a client that gives up after 1 s, then retries with the same key:
//! curl -m 1 -X POST localhost:3000/payments -H 'Idempotency-Key: 6f1c2d3e-demo' \
//!      -H 'x-user-id: user-42' -H 'content-type: application/json' -d '{"amount": 1000}'
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: 6f1c2d3e-demo' ...   # 409, Retry-After
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: 6f1c2d3e-demo' ...   # 201, Idempotent-Replayed: true
//! curl localhost:3000/charges                                                        # 1
//! ```
use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::{get, post},
};
use clap::Parser;
use idempotency_client::{
    Client,
    http::{HttpConfig, IdempotencyLayer},
};

#[derive(Debug, Parser)]
struct Args {
    /// The idempotency service.
    #[arg(
        long,
        env = "IDEMPOTENCY_ENDPOINT",
        default_value = "http://127.0.0.1:50051"
    )]
    idempotency: String,
    /// Where this example listens.
    #[arg(long, env = "PAYMENTS_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// How long "the bank" takes.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    bank_delay: Duration,
}

#[derive(Clone)]
struct Bank {
    charges: Arc<AtomicU64>,
    delay: Duration,
}

async fn create_payment(State(bank): State<Bank>, body: Bytes) -> impl IntoResponse {
    tokio::time::sleep(bank.delay).await; // "calling the bank"
    let id = bank.charges.fetch_add(1, Ordering::SeqCst) + 1;
    let body = format!(
        r#"{{"payment":"pay_{id}","request":{}}}"#,
        String::from_utf8_lossy(&body)
    );
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json".to_string()),
            (header::LOCATION, format!("/payments/pay_{id}")),
        ],
        body,
    )
}

async fn charges(State(bank): State<Bank>) -> String {
    format!("{}\n", bank.charges.load(Ordering::SeqCst))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args = Args::parse();
    let client = Client::builder()
        .endpoint(&args.idempotency)
        .connect_lazy()?;
    let config = HttpConfig::new("payments-example")
        .require_key(true)
        .exclude_json_pointer("/meta/trace_id")
        .subject(|request| {
            request
                .headers
                .get("x-user-id")
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        });
    let bank = Bank {
        charges: Arc::default(),
        delay: args.bank_delay,
    };
    let app = Router::new()
        .route("/payments", post(create_payment))
        .layer(IdempotencyLayer::new(client, config))
        .route("/charges", get(charges))
        .with_state(bank);
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "payments example listening");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
