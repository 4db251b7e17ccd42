//! Connection limits on the gRPC port: silent connections are closed, the
//! connection cap refuses at once, MAX_CONCURRENT_STREAMS is advertised and
//! enforced, calls beyond the cap in flight are shed, a peer that stops
//! answering pings is closed, and a client resuming after the server was
//! paused keeps its connection. Raw HTTP/2 frames where a real client would
//! obey the limits.

use std::{
    net::SocketAddr,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idempotency_tests::{TestDb, TestServer, assert_error, http_get, metric_value, spawn_app_with};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    task::JoinSet,
};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::{outage::wait_for_health, support::wait_for_metric};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const SETTINGS: u8 = 0x4;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const GOAWAY: u8 = 0x7;
const PING: u8 = 0x6;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const REFUSED_STREAM: u32 = 0x7;

/// Longest any single wait in these tests may take: generous, as a bound
/// on a hang, not a measure of speed.
const BOUND: Duration = Duration::from_secs(30);

const OPEN: &str = "idempotency_grpc_connections";
const REFUSED: &str = r#"idempotency_grpc_connections_closed_total{reason="refused"}"#;
const IN_FLIGHT: &str = "idempotency_grpc_calls_in_flight";
const CALLS_REFUSED: &str = "idempotency_grpc_calls_refused_total";
const TIMED_OUT: &str = r#"idempotency_grpc_connections_closed_total{reason="handshake_timeout"}"#;

async fn metric(server: &TestServer, series: &str) -> Option<f64> {
    metric_value(&http_get(server.metrics_addr, "/metrics").await, series)
}

/// One HTTP/2 frame: 9-byte header, then the payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// A `grpc.health.v1.Health/Check` call's headers in HPACK, every field a
/// literal that leaves the dynamic table alone. Without END_STREAM the
/// server waits for the request message, so the stream stays open.
fn check_headers(stream: u32) -> Vec<u8> {
    fn literal(block: &mut Vec<u8>, name_index: u8, value: &str) {
        if name_index < 15 {
            block.push(name_index);
        } else {
            block.extend([0x0f, name_index - 15]);
        }
        block.push(u8::try_from(value.len()).unwrap());
        block.extend_from_slice(value.as_bytes());
    }
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    literal(&mut block, 4, "/grpc.health.v1.Health/Check"); // :path
    literal(&mut block, 1, "localhost"); // :authority
    literal(&mut block, 31, "application/grpc"); // content-type
    block.extend([0x00, 2]);
    block.extend_from_slice(b"te");
    block.push(8);
    block.extend_from_slice(b"trailers");
    frame(HEADERS, END_HEADERS, stream, &block)
}

/// Reads one frame: (type, flags, stream, payload); `None` at EOF.
async fn read_frame(tcp: &mut TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    let mut header = [0u8; 9];
    tcp.read_exact(&mut header).await.ok()?;
    let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
    let mut payload = vec![0; len];
    tcp.read_exact(&mut payload).await.ok()?;
    Some((header[3], header[4], stream, payload))
}

/// Opens an HTTP/2 connection by hand: preface and empty SETTINGS sent, the
/// server's SETTINGS read and acknowledged. Returns them as (id, value).
async fn handshake(addr: SocketAddr) -> (TcpStream, Vec<(u16, u32)>) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(PREFACE).await.unwrap();
    tcp.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    let settings = tokio::time::timeout(BOUND, async {
        loop {
            let (kind, flags, _, payload) = read_frame(&mut tcp).await.expect("server SETTINGS");
            if kind == SETTINGS && flags & ACK == 0 {
                break payload
                    .chunks_exact(6)
                    .map(|p| {
                        let id = u16::from_be_bytes([p[0], p[1]]);
                        (id, u32::from_be_bytes([p[2], p[3], p[4], p[5]]))
                    })
                    .collect::<Vec<_>>();
            }
        }
    })
    .await
    .expect("the server sends its SETTINGS");
    tcp.write_all(&frame(SETTINGS, ACK, 0, &[])).await.unwrap();
    (tcp, settings)
}

/// Reads until the server closes the connection (EOF or a reset); the
/// number of bytes it sent before.
async fn read_until_closed(mut tcp: TcpStream) -> usize {
    let mut total = 0;
    let mut buf = [0u8; 1024];
    tokio::time::timeout(BOUND, async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break total,
                Ok(n) => total += n,
            }
        }
    })
    .await
    .expect("the server closes the connection")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_and_a_stalled_preface_are_closed_after_the_handshake_timeout() {
    let app = spawn_app_with(|settings| {
        settings.connections.handshake_timeout = Duration::from_secs(1);
    })
    .await;
    let (mut greeted, _) = handshake(app.server.addr).await;
    let mut silent = JoinSet::new();
    for _ in 0..200 {
        let tcp = TcpStream::connect(app.server.addr).await.unwrap();
        silent.spawn(read_until_closed(tcp));
    }
    let mut stalled = TcpStream::connect(app.server.addr).await.unwrap();
    stalled.write_all(&PREFACE[..10]).await.unwrap();

    let closed = silent.join_all().await.len() + {
        read_until_closed(stalled).await;
        1
    };

    assert_eq!(closed, 201);
    wait_for_metric(&app.server, TIMED_OUT, |closed| closed == 201.0).await;
    // The connection that greeted in time is still served.
    wait_for_metric(&app.server, OPEN, |open| open == 1.0).await;
    greeted.write_all(&check_headers(1)).await.unwrap();
    let message = [0u8; 5]; // An empty HealthCheckRequest, uncompressed.
    greeted
        .write_all(&frame(0x0, 0x1, 1, &message))
        .await
        .unwrap();
    let answered = tokio::time::timeout(BOUND, async {
        while let Some((kind, _, stream, _)) = read_frame(&mut greeted).await {
            if kind == HEADERS && stream == 1 {
                return true;
            }
        }
        false
    })
    .await
    .unwrap();
    assert!(answered, "the greeted connection answers a call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_beyond_the_cap_is_closed_at_once_and_counted_until_one_ends() {
    let app = spawn_app_with(|settings| {
        settings.connections.max_connections = 3;
        // Far beyond BOUND: a close can only be the cap's.
        settings.connections.handshake_timeout = Duration::from_secs(600);
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(handshake(app.server.addr).await.0);
    }

    let refused = TcpStream::connect(app.server.addr).await.unwrap();
    let sent = read_until_closed(refused).await;

    assert_eq!(sent, 0, "the refused connection got no HTTP/2 SETTINGS");
    assert_eq!(metric(&app.server, REFUSED).await, Some(1.0));
    assert_eq!(metric(&app.server, OPEN).await, Some(3.0));
    drop(held.pop());
    wait_for_metric(&app.server, OPEN, |open| open == 2.0).await;
    // Served: it gets the server's SETTINGS.
    let _served = handshake(app.server.addr).await;
    assert_eq!(metric(&app.server, OPEN).await, Some(3.0));
    assert_eq!(metric(&app.server, REFUSED).await, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_cap_refuses_before_the_handshake_and_a_silent_connection_is_closed() {
    use idempotency_tests::security::{Pki, TempDir, tls_channel};
    let dir = TempDir::new("connections");
    let pki = Pki::new("connections");
    let server_cert = pki.server("server");
    dir.write("tls.crt", &server_cert.cert);
    dir.write("tls.key", &server_cert.key);
    let app = spawn_app_with(|settings| {
        settings.security.tls_cert = Some(dir.path("tls.crt"));
        settings.security.tls_key = Some(dir.path("tls.key"));
        settings.connections.max_connections = 2;
        settings.connections.handshake_timeout = Duration::from_secs(1);
    })
    .await;
    let channel = tls_channel(app.server.addr, &pki.ca_pem(), None)
        .await
        .unwrap();
    let silent = TcpStream::connect(app.server.addr).await.unwrap();
    wait_for_metric(&app.server, OPEN, |open| open == 2.0).await;

    let refused = TcpStream::connect(app.server.addr).await.unwrap();
    let sent = read_until_closed(refused).await;

    assert_eq!(sent, 0, "no TLS handshake for a refused connection");
    assert_eq!(metric(&app.server, REFUSED).await, Some(1.0));
    assert_eq!(read_until_closed(silent).await, 0);
    // Counted just after the connection is dropped: wait for it, not race it.
    wait_for_metric(&app.server, TIMED_OUT, |closed| closed == 1.0).await;
    // The connection that greeted in time outlives the deadline.
    let mut health = HealthClient::new(channel);
    health.check(HealthCheckRequest::default()).await.unwrap();
    assert_eq!(metric(&app.server, OPEN).await, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_answering_pings_is_closed() {
    let app = spawn_app_with(|settings| {
        settings.connections.http2_keepalive_interval = Duration::from_millis(500);
        settings.connections.http2_keepalive_timeout = Duration::from_millis(500);
    })
    .await;
    let (mut tcp, _) = handshake(app.server.addr).await;

    // Read everything, answer nothing: as a peer whose host vanished.
    let mut pinged = false;
    let closed = tokio::time::timeout(BOUND, async {
        while let Some((kind, flags, _, _)) = read_frame(&mut tcp).await {
            pinged |= kind == PING && flags & ACK == 0;
        }
    })
    .await;

    assert!(closed.is_ok(), "the server closes the connection");
    assert!(pinged, "after pinging it");
    wait_for_metric(&app.server, OPEN, |open| open == 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_beyond_the_advertised_max_concurrent_streams_are_refused() {
    let app = spawn_app_with(|settings| settings.connections.max_concurrent_streams = 4).await;
    let (mut tcp, settings) = handshake(app.server.addr).await;
    assert!(
        settings.contains(&(SETTINGS_MAX_CONCURRENT_STREAMS, 4)),
        "advertised: {settings:?}"
    );

    // Seven calls at once, none finished: the client ignores the limit.
    let streams: Vec<u32> = (0..7).map(|i| 1 + 2 * i).collect();
    for &stream in &streams {
        tcp.write_all(&check_headers(stream)).await.unwrap();
    }
    let mut refused = Vec::new();
    tokio::time::timeout(BOUND, async {
        while refused.len() < 3 {
            let (kind, _, stream, payload) = read_frame(&mut tcp).await.expect("open");
            assert_ne!(kind, GOAWAY, "the connection stays up");
            if kind == RST_STREAM {
                let code = u32::from_be_bytes(payload[..4].try_into().unwrap());
                assert_eq!(code, REFUSED_STREAM, "stream {stream}");
                refused.push(stream);
            }
        }
    })
    .await
    .expect("three streams are refused");

    assert_eq!(refused, streams[4..], "the streams beyond the limit");
    // The four within it are served: finishing one gets its answer.
    tcp.write_all(&frame(0x0, 0x1, 1, &[0u8; 5])).await.unwrap();
    let answered = tokio::time::timeout(BOUND, async {
        while let Some((kind, _, stream, _)) = read_frame(&mut tcp).await {
            if kind == HEADERS && stream == 1 {
                return true;
            }
        }
        false
    })
    .await
    .unwrap();
    assert!(answered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_beyond_the_cap_in_flight_is_answered_unavailable_overloaded_at_once() {
    let app = spawn_app_with(|settings| settings.connections.max_concurrent_calls = 3).await;
    // Three calls in flight, each waiting for its request message.
    let (mut holder, _) = handshake(app.server.addr).await;
    for stream in [1, 3, 5] {
        holder.write_all(&check_headers(stream)).await.unwrap();
    }
    wait_for_metric(&app.server, IN_FLIGHT, |calls| calls == 3.0).await;
    let mut health = HealthClient::new(TestServer::channel_to(app.server.addr).await);

    let refused = health.check(HealthCheckRequest::default()).await;

    assert_error(refused, tonic::Code::Unavailable, "OVERLOADED");
    assert_eq!(metric(&app.server, CALLS_REFUSED).await, Some(1.0));
    // One call finishes: there is room again.
    holder
        .write_all(&frame(0x0, 0x1, 1, &[0u8; 5]))
        .await
        .unwrap();
    wait_for_metric(&app.server, IN_FLIGHT, |calls| calls == 2.0).await;
    health.check(HealthCheckRequest::default()).await.unwrap();
}

/// The real server in a process of its own, killed on drop.
struct ServerProcess {
    child: std::process::Child,
    addr: SocketAddr,
}

impl ServerProcess {
    fn start(db: &TestDb) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_test-server"))
            .env("IDEMPOTENCY_TEST_DATABASE", &db.name)
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting test-server");
        // It prints its address once bound, or exits (closing stdout).
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().parse().expect("test-server prints its address");
        Self { child, addr }
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_calls_timed_out_during_a_server_pause_keeps_its_connection() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db);
    let connects = Arc::new(AtomicUsize::new(0));
    let channel = {
        let connects = connects.clone();
        let addr = server.addr;
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_| {
                connects.fetch_add(1, Ordering::SeqCst);
                async move {
                    let tcp = TcpStream::connect(addr).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
                }
            }))
            .await
            .unwrap()
    };
    let health = HealthClient::new(channel);
    wait_for_health(&mut health.clone(), ServingStatus::Serving).await;
    let check = move |deadline| {
        let mut health = health.clone();
        async move {
            let call = health.check(HealthCheckRequest::default());
            tokio::time::timeout(deadline, call).await
        }
    };
    assert!(matches!(check(BOUND).await, Ok(Ok(_))));

    // Eight callers keep calling with 50 ms deadlines through a 5 s pause:
    // each call times out and is cancelled (RST_STREAM), and the server
    // reads them all at once when it resumes.
    server.signal("-STOP");
    let mut callers = JoinSet::new();
    for _ in 0..8 {
        let check = check.clone();
        callers.spawn(async move {
            let mut timed_out = 0;
            let until = tokio::time::Instant::now() + Duration::from_secs(5);
            while tokio::time::Instant::now() < until {
                if check(Duration::from_millis(50)).await.is_err() {
                    timed_out += 1;
                }
            }
            timed_out
        });
    }
    let timed_out: usize = callers.join_all().await.into_iter().sum();
    server.signal("-CONT");

    let mut failed = Vec::new();
    for _ in 0..50 {
        match check(BOUND).await {
            Ok(Ok(_)) => {}
            other => failed.push(format!("{other:?}")),
        }
    }
    assert!(
        timed_out > 100,
        "calls were cancelled during the pause: {timed_out}"
    );
    assert!(
        failed.is_empty(),
        "calls after the pause failed: {failed:?}"
    );
    assert_eq!(
        connects.load(Ordering::SeqCst),
        1,
        "the channel never reconnected (no GOAWAY)"
    );
}
