//! A gRPC payments service made idempotent by one layer, with reflection so
//! that grpcurl needs no proto file.
//!
//! `payments.v1.Payments/Charge` "calls the bank" (sleeps `--bank-delay`),
//! counts a charge and answers with a `payment_id` (and `x-payment-id`
//! metadata); `Charges` tells how often the handler ran. Run the idempotency
//! service (`make run`), then:
//!
//! ```sh
//! cargo run -p idempotency-client --features grpc --example grpc_payments &
//! grpcurl -plaintext -H 'idempotency-key: 5d9e7c1a-grpc-demo' -H 'x-user-id: user-42' \
//!   -d '{"amount": 1000, "currency": "EUR"}' localhost:50052 payments.v1.Payments/Charge
//! # the same again, -v: the stored reply, with `idempotent-replayed: true`
//! grpcurl -plaintext localhost:50052 payments.v1.Payments/Charges   # attempts 1
//! ```
//!
//! The README's "gRPC services" section has the whole session.

#[path = "grpc_payments/payments.rs"]
mod payments;

use std::{net::SocketAddr, time::Duration};

use clap::Parser;
use idempotency_client::{
    Client, OnUnavailable,
    grpc::{GrpcConfig, GrpcIdempotencyLayer},
};
use payments::{DESCRIPTOR_SET, Payments, pb::payments_server::PaymentsServer};

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
    #[arg(long, env = "GRPC_PAYMENTS_LISTEN", default_value = "127.0.0.1:50052")]
    listen: SocketAddr,
    /// How long "the bank" takes.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    bank_delay: Duration,
    /// Run charges unprotected when the idempotency service is unreachable
    /// (default: answer UNAVAILABLE).
    #[arg(long)]
    fail_open: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args = Args::parse();
    let client = Client::builder()
        .endpoint(args.idempotency)
        .connect_lazy()?;
    let on_unavailable = if args.fail_open {
        OnUnavailable::FailOpen
    } else {
        OnUnavailable::FailClosed
    };
    let config = GrpcConfig::new("payments", DESCRIPTOR_SET)
        .exclude_json_pointer("/metadata/trace_id")
        .on_unavailable(on_unavailable)
        .subject(|request| {
            let user = request.headers.get("x-user-id")?;
            user.to_str().ok().map(str::to_owned)
        });
    // Both versions: grpcurl and older tools ask v1alpha. With google.rpc's
    // descriptors, so that grpcurl shows the layer's error details.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("payments (gRPC) on {}", listener.local_addr()?);
    tonic::transport::Server::builder()
        .layer(GrpcIdempotencyLayer::new(client, config))
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?)
        .add_service(PaymentsServer::new(Payments::new(args.bank_delay)))
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        )
        .await?;
    Ok(())
}
