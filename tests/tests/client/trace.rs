//! Trace context end to end: the real `idempotencyd` binary with JSON logs
//! (and once text logs) and `--log-calls`; the trace id a caller sends (`traceparent`) is found
//! in the server's line for that call, through the Rust client
//! (`trace::scope`), raw gRPC metadata, the HTTP layer and the gRPC layer;
//! a call without
//! one, or with an invalid one, gets a new trace id and succeeds.

use std::time::Duration;

use idempotency_client::{
    Acquisition, Batching, Client, ClientOptions, StoredResponse,
    http::HttpConfig,
    pb::{self, idempotency_service_client::IdempotencyServiceClient},
    trace::{self, TraceContext},
};
use idempotency_tests::{
    TestDb, http_app::PaymentsApp, process::ServerProcess, record_id, unique_key,
};
use serde_json::Value;
use tonic::{Code, transport::Channel};

use crate::support::request;

/// The server with JSON logs and a line per call.
async fn server(db: &TestDb) -> ServerProcess {
    ServerProcess::start(db.url().as_str(), &["--log-calls"]).await
}

fn client_of(server: &ServerProcess) -> Client {
    Client::builder()
        .endpoint(format!("http://{}", server.addr))
        .connect_lazy()
        .unwrap()
}

async fn raw_client(server: &ServerProcess) -> IdempotencyServiceClient<Channel> {
    IdempotencyServiceClient::connect(format!("http://{}", server.addr))
        .await
        .unwrap()
}

/// The `--log-calls` line of an `rpc` call in the trace `trace_id`.
async fn call_line(server: &mut ServerProcess, rpc: &str, trace_id: &str) -> Value {
    server
        .wait_for_line(|line| is_call(line, rpc) && line["trace_id"] == trace_id)
        .await
}

fn is_call(line: &Value, rpc: &str) -> bool {
    line["target"] == "idempotency_server::calls" && line["rpc"] == rpc
}

/// A request with `traceparent` metadata.
fn with_traceparent<T>(message: T, traceparent: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("traceparent", traceparent.parse().unwrap());
    request
}

fn assert_fresh_trace_id(line: &Value) {
    let trace_id = line["trace_id"].as_str().expect("a trace id");
    assert_eq!(trace_id.len(), 32, "{line}");
    assert!(
        trace_id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{line}"
    );
    assert_ne!(trace_id, "0".repeat(32), "{line}");
    assert!(line["span"].get("parent_span_id").is_none(), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_id_a_caller_sends_is_in_the_servers_line_for_the_call() {
    let db = TestDb::new().await;
    let mut server = server(&db).await;
    // Its calls as unary RPCs, whose lines carry their outcome (a batch's
    // line leaves the outcome to its items; the layers' tests below follow
    // the default, batches of one on the client's stream).
    let client = client_of(&server).with_options(ClientOptions {
        batching: Some(Batching {
            stream: false,
            ..Batching::default()
        }),
        ..ClientOptions::default()
    });

    // The Rust client, in the context of an incoming request.
    let sent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let context = TraceContext::parse(sent).unwrap();
    let request = request("traced");
    trace::scope(context, async {
        let Acquisition::Proceed(mut lease) = client.acquire(&request).await.unwrap() else {
            panic!("a new key proceeds");
        };
        lease
            .complete(&StoredResponse::new(201, "done"))
            .await
            .unwrap();
    })
    .await;
    let acquired = call_line(&mut server, "Acquire", "0af7651916cd43dd8448eb211c80319c").await;
    assert_eq!(
        acquired["span"]["parent_span_id"], "b7ad6b7169203331",
        "{acquired}"
    );
    assert_eq!(acquired["grpc_code"], 0, "{acquired}");
    assert_eq!(acquired["code"], "Ok", "{acquired}");
    assert_eq!(acquired["span"]["namespace"], "payments", "{acquired}");
    assert_eq!(acquired["span"]["outcome"], "acquired", "{acquired}");
    assert!(acquired["duration_ms"].as_f64().is_some(), "{acquired}");
    // The subject and the key are not logged.
    assert!(
        !acquired.to_string().contains(&request.id.key),
        "{acquired}"
    );
    let completed = call_line(&mut server, "Complete", "0af7651916cd43dd8448eb211c80319c").await;
    assert_eq!(completed["grpc_code"], 0, "{completed}");

    // Raw gRPC metadata, on a call that fails: the line has its code.
    let sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    let get = pb::GetRequest {
        id: Some(record_id(&unique_key("absent"))),
    };
    let status = raw_client(&server)
        .await
        .get(with_traceparent(get, sent))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let missed = call_line(&mut server, "Get", "4bf92f3577b34da6a3ce929d0e0e4736").await;
    assert_eq!(missed["grpc_code"], Code::NotFound as i32, "{missed}");
    assert_eq!(
        missed["span"]["parent_span_id"], "00f067aa0ba902b7",
        "{missed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_a_valid_traceparent_gets_a_new_trace_id_and_succeeds() {
    let db = TestDb::new().await;
    let mut server = server(&db).await;
    let mut raw = raw_client(&server).await;

    // No header at all.
    let renew = pb::RenewRequest {
        id: Some(record_id(&unique_key("absent"))),
        fencing_token: 1,
        lease: Some(idempotency_tests::seconds(30)),
    };
    let _ = raw.renew(renew).await;
    let untraced = server.wait_for_line(|line| is_call(line, "Renew")).await;
    assert_fresh_trace_id(&untraced);

    // An invalid header (uppercase hex) is ignored: the call succeeds.
    let invalid = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01";
    let acquire = pb::AcquireRequest {
        id: Some(record_id(&unique_key("invalid-trace"))),
        fingerprint: b"f".to_vec(),
        ..Default::default()
    };
    let answer = raw
        .acquire(with_traceparent(acquire, invalid))
        .await
        .unwrap();
    assert!(matches!(
        answer.into_inner().outcome,
        Some(pb::acquire_response::Outcome::Acquired(_))
    ));
    let line = server.wait_for_line(|line| is_call(line, "Acquire")).await;
    assert_fresh_trace_id(&line);
    assert_ne!(
        line["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736",
        "{line}"
    );
    assert_eq!(line["grpc_code"], 0, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_layer_passes_the_requests_traceparent_on_to_the_server() {
    let db = TestDb::new().await;
    let mut server = server(&db).await;
    let app = PaymentsApp::start(
        client_of(&server),
        HttpConfig::new("shop"),
        Duration::from_millis(10),
    )
    .await;
    let http = idempotency_tests::http_app::HttpClient::new(app.addr);

    let sent = "00-c0ffee0000000000000000000000c0de-1234567890abcdef-01";
    let answer = http
        .post_with(
            "/payments",
            Some(&unique_key("http-traced")),
            "alice",
            r#"{"amount":1000}"#,
            &[("traceparent", sent)],
        )
        .await;
    assert_eq!(answer.status, 201, "{answer:?}");

    // The client's lone calls travel as batches of one on its BatchStream.
    let acquired = call_line(
        &mut server,
        "BatchAcquire",
        "c0ffee0000000000000000000000c0de",
    )
    .await;
    assert_eq!(
        acquired["span"]["parent_span_id"], "1234567890abcdef",
        "{acquired}"
    );
    assert_eq!(acquired["span"]["namespace"], "shop", "{acquired}");
    call_line(
        &mut server,
        "BatchComplete",
        "c0ffee0000000000000000000000c0de",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_layer_passes_the_calls_traceparent_on_to_the_server() {
    use idempotency_client::grpc::GrpcConfig;
    use idempotency_tests::grpc_app::{DESCRIPTOR_SET, GrpcApp, keyed, pb};

    let db = TestDb::new().await;
    let mut server = server(&db).await;
    let app = GrpcApp::start(
        client_of(&server),
        GrpcConfig::new("shop", DESCRIPTOR_SET),
        Duration::from_millis(10),
    )
    .await;

    let sent = "00-beef0000000000000000000000000bee-fedcba0987654321-01";
    let charge = pb::ChargeRequest {
        amount: 1000,
        currency: "EUR".into(),
        ..Default::default()
    };
    let mut request = keyed(charge, Some(&unique_key("grpc-traced")), "alice");
    request
        .metadata_mut()
        .insert("traceparent", sent.parse().unwrap());
    app.client().await.charge(request).await.unwrap();

    let acquired = call_line(
        &mut server,
        "BatchAcquire",
        "beef0000000000000000000000000bee",
    )
    .await;
    assert_eq!(
        acquired["span"]["parent_span_id"], "fedcba0987654321",
        "{acquired}"
    );
    assert_eq!(acquired["span"]["namespace"], "shop", "{acquired}");
    call_line(
        &mut server,
        "BatchComplete",
        "beef0000000000000000000000000bee",
    )
    .await;
}

/// A batch call's span names its items' namespace, or each of them,
/// comma-separated, when they differ; its items leave the span's outcome
/// to their own answers. (A JSON line cannot show a field recorded twice:
/// its span object is parsed before it is written. The text test below
/// can.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_calls_span_names_its_namespaces_once() {
    let db = TestDb::new().await;
    let mut server = server(&db).await;
    let mut raw = raw_client(&server).await;
    let item = |namespace: &str| pb::AcquireRequest {
        id: Some(pb::RecordId {
            namespace: namespace.into(),
            ..record_id(&unique_key("batch-span"))
        }),
        fingerprint: b"f".to_vec(),
        ..Default::default()
    };
    let batches = [
        (
            "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            vec![item("alpha"), item("alpha"), item("alpha")],
            "alpha",
        ),
        (
            "00-2af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            vec![item("beta"), item("alpha"), item("beta"), item("gamma")],
            "beta,alpha,gamma",
        ),
    ];
    for (traceparent, requests, namespaces) in batches {
        let items = requests.len();
        let answer = raw
            .batch_acquire(with_traceparent(
                pb::BatchAcquireRequest { requests },
                traceparent,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.results.len(), items);
        let trace_id = &traceparent[3..35];
        let line = call_line(&mut server, "BatchAcquire", trace_id).await;
        assert_eq!(line["span"]["namespace"], namespaces, "{line}");
        assert!(line["span"].get("outcome").is_none(), "{line}");
    }
}

/// In text logs too (`--log-format text`, where a field recorded again is
/// written again): a batch call's line names its namespace once, however
/// many items it carries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_calls_text_line_names_its_namespace_once() {
    use std::io::{BufRead, BufReader};
    let db = TestDb::new().await;
    /// Kills the server however the test ends.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = std::process::Command::new(idempotency_tests::process::idempotencyd())
        .args(["serve", "--grpc-addr", "127.0.0.1:0"])
        .args(["--metrics-addr", "127.0.0.1:0", "--reaper-enabled", "false"])
        .args(["--log-format", "text", "--log-calls"])
        .env_clear()
        .env("DATABASE_URL", db.url().as_str())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map(Killed)
        .expect("starting idempotencyd");
    let (lines, mut received) = tokio::sync::mpsc::unbounded_channel();
    let stdout = child.0.stdout.take().expect("piped stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let mut next_line = async |matches: &dyn Fn(&str) -> bool| loop {
        let line = tokio::time::timeout(Duration::from_secs(30), received.recv())
            .await
            .expect("a line within 30 s")
            .expect("the server logs on");
        if matches(&line) {
            return line;
        }
    };
    let announced = next_line(&|line| line.contains("serving gRPC")).await;
    let addr = announced
        .split("addr=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the announcement names the address");
    let mut raw = IdempotencyServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let requests = (0..5)
        .map(|_| pb::AcquireRequest {
            id: Some(record_id(&unique_key("text-batch"))),
            fingerprint: b"f".to_vec(),
            ..Default::default()
        })
        .collect();
    raw.batch_acquire(pb::BatchAcquireRequest { requests })
        .await
        .unwrap();
    let line = next_line(&|line| line.contains("BatchAcquire") && line.contains("grpc_code")).await;
    drop(child);
    assert_eq!(line.matches("namespace=").count(), 1, "{line}");
    assert!(line.contains("namespace=\"payments\""), "{line}");
}
