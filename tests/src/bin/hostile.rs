//! `idempotency-hostile`: the hostile inputs of issue 16, many at once,
//! against a running server, to measure the server's peak memory
//! (`scripts/memory-check.sh` reads its VmHWM around each case).
//!
//! Each case runs `--concurrency` calls at once over `--connections`
//! connections and prints one JSON line: the case and how its calls ended.
//! Usage: idempotency-hostile --endpoint http://127.0.0.1:50051 CASE...
//! Cases: huge-batch, full-batch, header-map, large-replies, stream-flood, idle-connections.

use std::{collections::BTreeMap, time::Duration};

use bytes::Bytes;
use idempotency_client::pb::{self, idempotency_service_client::IdempotencyServiceClient};
use idempotency_tests::raw;
use tonic::transport::{Channel, Endpoint};

struct Options {
    endpoint: String,
    concurrency: usize,
    connections: usize,
    cases: Vec<String>,
}

fn options() -> Options {
    let mut options = Options {
        endpoint: "http://127.0.0.1:50051".into(),
        concurrency: 64,
        connections: 8,
        cases: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().expect("a value after the flag");
        match arg.as_str() {
            "--endpoint" => options.endpoint = value(),
            "--concurrency" => options.concurrency = value().parse().expect("a number"),
            "--connections" => options.connections = value().parse().expect("a number"),
            case => options.cases.push(case.to_owned()),
        }
    }
    options
}

async fn channels(endpoint: &str, count: usize) -> Vec<Channel> {
    let mut channels = Vec::new();
    for _ in 0..count.max(1) {
        let channel = Endpoint::from_shared(endpoint.to_owned())
            .expect("an endpoint URL")
            .connect()
            .await
            .expect("connecting");
        channels.push(channel);
    }
    channels
}

/// Runs `calls` raw calls at once, round-robin over `channels`; counts the
/// answers by code.
async fn at_once(
    channels: &[Channel],
    calls: usize,
    method: &'static str,
    message: Bytes,
) -> BTreeMap<String, usize> {
    let tasks: Vec<_> = (0..calls)
        .map(|i| {
            let channel = channels[i % channels.len()].clone();
            let message = message.clone();
            tokio::spawn(async move { raw::call(channel, method, message).await })
        })
        .collect();
    let mut codes = BTreeMap::new();
    for task in tasks {
        let code = match task.await.expect("call task") {
            Ok(_) => "ok".to_owned(),
            Err(status) => format!("{:?}", status.code()),
        };
        *codes.entry(code).or_insert(0) += 1;
    }
    codes
}

fn record_id(key: &str) -> pb::RecordId {
    pb::RecordId {
        namespace: "hostile".into(),
        operation: "POST /x".into(),
        subject: String::new(),
        key: key.into(),
    }
}

/// Acquires and completes a record holding the largest response the
/// defaults allow: 1 MiB in all, over 128 headers.
async fn largest_record(channel: Channel) -> pb::RecordId {
    let mut client = IdempotencyServiceClient::new(channel);
    let id = record_id(&format!("large-{}", std::process::id()));
    let acquired = client
        .acquire(pb::AcquireRequest {
            id: Some(id.clone()),
            ..Default::default()
        })
        .await
        .expect("Acquire")
        .into_inner();
    let Some(pb::acquire_response::Outcome::Acquired(acquired)) = acquired.outcome else {
        return id; // Completed by an earlier run.
    };
    let headers: std::collections::HashMap<String, String> = (0..128)
        .map(|i| (format!("x-header-{i:03}"), "v".repeat(100)))
        .collect();
    let header_bytes: usize = headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    client
        .complete(pb::CompleteRequest {
            id: Some(id.clone()),
            fencing_token: acquired.fencing_token,
            response: Some(pb::StoredResponse {
                status_code: 200,
                body: vec![b'x'; 1024 * 1024 - header_bytes],
                headers,
            }),
        })
        .await
        .expect("Complete");
    id
}

#[tokio::main]
async fn main() {
    let options = options();
    let channels = channels(&options.endpoint, options.connections).await;
    let c = options.concurrency;
    for case in &options.cases {
        let codes = match case.as_str() {
            // 2.09 million empty items in 4 MiB.
            "huge-batch" => {
                let message = raw::empty_batch_acquire((4 * 1024 * 1024 - 16) / 2);
                at_once(&channels, c, "BatchAcquire", message).await
            }
            // The largest BatchAcquire accepted (100 items of 8 KiB), all empty items.
            "full-batch" => {
                let message = raw::empty_batch_acquire(100 * 8 * 1024 / 2);
                at_once(&channels, c, "BatchAcquire", message).await
            }
            // A Complete whose response holds 60,000 headers.
            "header-map" => {
                let request = pb::CompleteRequest {
                    id: Some(record_id("header-map-0001")),
                    fencing_token: 1,
                    response: None,
                };
                let message = raw::complete_with_headers(&request, 60_000);
                at_once(&channels, c, "Complete", message).await
            }
            // Gets of the largest stored response.
            "large-replies" => {
                let id = largest_record(channels[0].clone()).await;
                let message = prost::Message::encode_to_vec(&pb::GetRequest { id: Some(id) });
                at_once(&channels, c, "Get", message.into()).await
            }
            // Thousands of calls at once on one connection.
            "stream-flood" => {
                let message = prost::Message::encode_to_vec(&pb::AcquireRequest {
                    id: Some(record_id("stream-flood-0001")),
                    ..Default::default()
                });
                at_once(&channels[..1], c * 32, "Acquire", message.into()).await
            }
            // Connections that never send a byte, held for 15 s.
            "idle-connections" => {
                let addr = options
                    .endpoint
                    .trim_start_matches("http://")
                    .trim_end_matches('/')
                    .to_owned();
                let mut idle = Vec::new();
                let mut codes = BTreeMap::new();
                for _ in 0..1000 {
                    let outcome = match tokio::net::TcpStream::connect(&addr).await {
                        Ok(stream) => {
                            idle.push(stream);
                            "connected"
                        }
                        Err(_) => "refused",
                    };
                    *codes.entry(outcome.to_owned()).or_insert(0) += 1;
                }
                tokio::time::sleep(Duration::from_secs(15)).await;
                drop(idle);
                codes
            }
            other => panic!("unknown case {other}"),
        };
        let codes: Vec<String> = codes.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
        println!(
            "{{\"case\": \"{case}\", \"answers\": {{{}}}}}",
            codes.join(", ")
        );
    }
}
