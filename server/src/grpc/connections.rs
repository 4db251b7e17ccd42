//! Limits on the gRPC port's client connections: how many may be open, how
//! soon each must greet, and the HTTP/2 settings each is served with.
//!
//! Every accepted TCP connection first takes a permit from a [`Gate`]. With
//! none left it is closed at once, so the client fails fast and may try
//! another replica instead of waiting in the kernel's backlog for its connect
//! timeout. The permit goes back when the connection ends, however it ends.
//!
//! From its acceptance a connection has `handshake_timeout` to finish its TLS
//! handshake (when TLS is on) and send the 24-byte HTTP/2 client preface;
//! otherwise it is closed. After the preface, HTTP/2 keepalive pings close
//! peers that stop answering, and `--max-connection-age` ends live ones.
//!
//! The probe port (`--health-addr`) and `/metrics` are served apart and are
//! not counted, so a full gRPC port does not fail the pod's probes.

use std::{
    convert::Infallible,
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use futures_util::{Stream, StreamExt};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::{Instant, Sleep},
};
use tonic::transport::{Server, server::Connected, server::TcpIncoming};

use tower::layer::util::{Identity, Stack};

use super::{call_limit::CallLimitLayer, write_hold::WriteHold};
use crate::metrics::{GRPC_CONNECTIONS, GRPC_CONNECTIONS_CLOSED_TOTAL};

/// `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`, which every HTTP/2 client sends first.
const PREFACE_LEN: usize = 24;

/// After a failed accept, how long to wait before the next.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// How the gRPC port treats client connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionSettings {
    /// Most connections open at once; the next one is closed at once.
    pub max_connections: usize,
    /// From acceptance to the end of the HTTP/2 preface (TLS handshake included).
    pub handshake_timeout: Duration,
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`: calls in flight per connection.
    pub max_concurrent_streams: u32,
    /// Quiet time after which the server pings the client.
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Streams the client opened and reset before the server took them up,
    /// waiting at once, before the connection is closed as a rapid-reset
    /// attack (GOAWAY `ENHANCE_YOUR_CALM`).
    pub max_pending_accept_reset_streams: usize,
    /// Streams the server reset for the client's protocol errors over the
    /// connection's life before it is closed (the "made you reset" attack).
    pub max_local_error_reset_streams: usize,
    /// Calls in flight across every connection; one more is answered
    /// `UNAVAILABLE` at once ([`super::call_limit`]).
    pub max_concurrent_calls: usize,
}

impl Default for ConnectionSettings {
    /// The defaults of `idempotencyd serve` (see `settings::ConnectionArgs`).
    fn default() -> Self {
        Self {
            max_connections: 1000,
            handshake_timeout: Duration::from_secs(10),
            max_concurrent_streams: 100,
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            max_pending_accept_reset_streams: 1000,
            max_local_error_reset_streams: 1024,
            max_concurrent_calls: 4096,
        }
    }
}

impl ConnectionSettings {
    /// The cap on calls in flight across the port (`max_concurrent_calls`).
    pub fn call_limit(&self) -> CallLimitLayer {
        CallLimitLayer::new(self.max_concurrent_calls)
    }

    /// A server builder with these HTTP/2 settings, `outermost` (the
    /// BatchStream layer, each of whose messages takes a permit of
    /// `call_limit` too), then `call_limit`.
    pub fn server<L>(
        &self,
        outermost: L,
        call_limit: CallLimitLayer,
    ) -> Server<Stack<CallLimitLayer, Stack<L, Identity>>> {
        Server::builder()
            .max_concurrent_streams(self.max_concurrent_streams)
            .http2_keepalive_interval(Some(self.keepalive_interval))
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
            .http2_max_pending_accept_reset_streams(Some(self.max_pending_accept_reset_streams))
            .http2_max_local_error_reset_streams(Some(self.max_local_error_reset_streams))
            .layer(outermost)
            .layer(call_limit)
    }

    /// The gate that counts connections against `max_connections`.
    pub fn gate(&self) -> Gate {
        // Exported from the start, not from the first connection on.
        metrics::gauge!(GRPC_CONNECTIONS).increment(0.0);
        Gate {
            permits: Arc::new(Semaphore::new(self.max_connections)),
            handshake_timeout: self.handshake_timeout,
        }
    }
}

/// Counts open connections against the cap. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Gate {
    permits: Arc<Semaphore>,
    handshake_timeout: Duration,
}

impl Gate {
    /// A connection was just accepted: its admission, or `None` when the cap
    /// is reached (counted; the caller drops the socket, which closes it).
    pub fn admit(&self) -> Option<Admission> {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                metrics::gauge!(GRPC_CONNECTIONS).increment(1.0);
                Some(Admission {
                    slot: Slot { _permit: permit },
                    deadline: Instant::now() + self.handshake_timeout,
                })
            }
            Err(_) => {
                closed("refused");
                None
            }
        }
    }
}

/// A connection was closed by the server before it was served, and why.
pub(crate) fn closed(reason: &'static str) {
    metrics::counter!(GRPC_CONNECTIONS_CLOSED_TOTAL, "reason" => reason).increment(1);
}

/// One connection's place under the cap, given back on drop.
#[derive(Debug)]
struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        metrics::gauge!(GRPC_CONNECTIONS).decrement(1.0);
    }
}

/// An accepted connection's place under the cap and its greeting deadline.
#[derive(Debug)]
pub struct Admission {
    slot: Slot,
    deadline: Instant,
}

impl Admission {
    /// When the TLS handshake and the HTTP/2 preface must be done.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// `io`, which keeps this place under the cap until it is dropped, and
    /// fails its reads once the deadline passes before the preface is in.
    pub fn connection<IO>(self, io: IO) -> Connection<IO> {
        let greeting = Greeting {
            left: PREFACE_LEN,
            deadline: Box::pin(tokio::time::sleep_until(self.deadline)),
        };
        Connection {
            io,
            greeting: Some(greeting),
            writes: WriteHold::default(),
            _slot: self.slot,
        }
    }
}

/// The plain-text connections of `listener`, each admitted by `gate`.
pub fn plaintext(
    listener: TcpListener,
    gate: Gate,
) -> impl Stream<Item = Result<Connection<TcpStream>, Infallible>> {
    TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .filter_map(move |accepted| {
            let gate = gate.clone();
            async move {
                match accepted {
                    Ok(tcp) => gate.admit().map(|admission| Ok(admission.connection(tcp))),
                    Err(error) => {
                        // Out of file descriptors and the like: wait, do not
                        // spin (the TLS path does the same).
                        tracing::warn!(%error, "accepting a connection failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                        None
                    }
                }
            }
        })
}

/// The preface bytes still due, and when.
#[derive(Debug)]
struct Greeting {
    left: usize,
    deadline: Pin<Box<Sleep>>,
}

/// A client connection under the cap, as the gRPC server reads it.
#[derive(Debug)]
pub struct Connection<IO> {
    io: IO,
    /// `None` once the preface is in.
    greeting: Option<Greeting>,
    /// What the codec wrote since its last flush.
    writes: WriteHold,
    _slot: Slot,
}

impl<IO: Connected> Connected for Connection<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Connection<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let Some(greeting) = &mut this.greeting else {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        };
        // The server reads until the preface is in, so this is polled (and
        // the timer's wake-up heard) for as long as the client keeps quiet.
        if greeting.deadline.as_mut().poll(cx).is_ready() {
            closed("handshake_timeout");
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no HTTP/2 preface within the handshake timeout",
            )));
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
        let read = buf.filled().len() - before;
        greeting.left = greeting.left.saturating_sub(read);
        if greeting.left == 0 {
            this.greeting = None;
        }
        Poll::Ready(Ok(()))
    }
}

/// Writes are held until the codec flushes (see [`WriteHold`]), so that what
/// h2 writes in one flush leaves in one write.
impl<IO: AsyncWrite + Unpin> AsyncWrite for Connection<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        this.writes
            .poll_hold(&mut this.io, cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        this.writes.poll_hold(&mut this.io, cx, bufs)
    }

    /// Not vectored, whatever the stream under it: h2 then copies a DATA
    /// payload under 1 KiB into its buffer, where vectored it writes one of
    /// 256 bytes or more as a second slice (`CHAIN_THRESHOLD`) that it must
    /// flush before it can buffer the next frame. A replay's answer with a
    /// stored body of a few hundred bytes went out as two writes, its
    /// trailers second, and the client often woke twice for it; now as one
    /// (`docs/performance.md`, "One write per request and per answer").
    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.writes.poll_write_held(&mut this.io, cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.writes.poll_write_held(&mut this.io, cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn settings(max_connections: usize) -> ConnectionSettings {
        ConnectionSettings {
            max_connections,
            handshake_timeout: Duration::from_secs(1),
            ..ConnectionSettings::default()
        }
    }

    /// A vectored stream, as a TCP stream is, that counts the writes it is
    /// given.
    struct CountedWrites {
        io: tokio::io::DuplexStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncRead for CountedWrites {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for CountedWrites {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let written = ready!(Pin::new(&mut self.io).poll_write(cx, buf))?;
            self.writes.fetch_add(1, Ordering::Relaxed);
            Poll::Ready(Ok(written))
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            // One write of all the slices, as `writev` makes.
            let joined: Vec<u8> = bufs.iter().flat_map(|buf| buf.iter().copied()).collect();
            let written = ready!(Pin::new(&mut self.io).poll_write(cx, &joined))?;
            self.writes.fetch_add(1, Ordering::Relaxed);
            Poll::Ready(Ok(written))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    /// The server's writes for `ANSWERS` answers shaped as gRPC's (headers,
    /// a DATA frame of `body` bytes, trailers), after a first answer, over an
    /// HTTP/2 connection served on the stream `wrap` makes.
    async fn writes_of_answers<IO>(body: usize, wrap: impl FnOnce(CountedWrites) -> IO) -> usize
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        use http_body_util::{BodyExt, Empty, StreamBody};
        use hyper::body::Frame;
        use hyper_util::rt::{TokioExecutor, TokioIo};

        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let writes = Arc::<AtomicUsize>::default();
        let server_io = wrap(CountedWrites {
            io: server_io,
            writes: writes.clone(),
        });
        let answer = hyper::service::service_fn(move |_request| async move {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let frames = [
                Frame::data(bytes::Bytes::from(vec![b'x'; body])),
                Frame::trailers(trailers),
            ];
            let body = StreamBody::new(futures_util::stream::iter(
                frames.map(Ok::<_, std::convert::Infallible>),
            ));
            Ok::<_, std::convert::Infallible>(http::Response::new(body))
        });
        tokio::spawn(
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(server_io), answer),
        );
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client_io))
                .await
                .unwrap();
        tokio::spawn(connection);
        let mut ask = async || {
            let request =
                http::Request::post("http://server/idempotency.v1.IdempotencyService/Acquire")
                    .body(Empty::<bytes::Bytes>::new())
                    .unwrap();
            let answer = sender.send_request(request).await.unwrap();
            let body = answer.into_body().collect().await.unwrap();
            assert!(body.trailers().is_some());
        };
        ask().await;
        let before = writes.load(Ordering::Relaxed);
        for _ in 0..ANSWERS {
            ask().await;
        }
        writes.load(Ordering::Relaxed) - before
    }

    const ANSWERS: usize = 10;

    #[tokio::test]
    async fn an_answer_with_a_body_under_a_kib_goes_out_in_one_write() {
        let gate = settings(2).gate();
        let through_connection =
            writes_of_answers(300, |io| gate.admit().unwrap().connection(io)).await;
        assert_eq!(through_connection, ANSWERS, "one write per answer");
        // The stream alone: the headers and body, then the trailers.
        assert!(writes_of_answers(300, |io| io).await > ANSWERS);
    }

    #[tokio::test]
    async fn a_larger_answer_goes_out_in_no_more_writes_than_over_the_stream_alone() {
        let gate = settings(2).gate();
        let through_connection =
            writes_of_answers(4096, |io| gate.admit().unwrap().connection(io)).await;
        // Headers and data in one write, the trailers in a second.
        assert_eq!(through_connection, 2 * ANSWERS);
        assert_eq!(writes_of_answers(4096, |io| io).await, 2 * ANSWERS);
    }

    #[test]
    fn the_gate_admits_up_to_the_cap_and_again_once_one_ends() {
        let gate = settings(2).gate();
        let first = gate.admit().expect("first");
        let _second = gate.admit().expect("second");

        assert!(gate.admit().is_none(), "the third is refused");
        drop(first);
        assert!(gate.admit().is_some(), "a place was given back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_fails_its_read_at_the_deadline() {
        let (client, server) = tokio::io::duplex(64);
        let mut connection = settings(1).gate().admit().unwrap().connection(server);

        let error = connection.read(&mut [0; 64]).await.unwrap_err();

        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        drop(client);
    }

    #[tokio::test(start_paused = true)]
    async fn a_partial_preface_fails_at_the_deadline_and_a_whole_one_never() {
        let (mut client, server) = tokio::io::duplex(64);
        let mut connection = settings(1).gate().admit().unwrap().connection(server);
        client.write_all(&[b'P'; PREFACE_LEN - 1]).await.unwrap();
        assert_eq!(
            connection.read(&mut [0; 64]).await.unwrap(),
            PREFACE_LEN - 1
        );
        assert_eq!(
            connection.read(&mut [0; 64]).await.unwrap_err().kind(),
            io::ErrorKind::TimedOut
        );

        let (mut client, server) = tokio::io::duplex(64);
        let mut connection = settings(1).gate().admit().unwrap().connection(server);
        client.write_all(&[b'P'; PREFACE_LEN]).await.unwrap();
        assert_eq!(connection.read(&mut [0; 64]).await.unwrap(), PREFACE_LEN);
        tokio::time::sleep(Duration::from_secs(5)).await;
        client.write_all(b"later").await.unwrap();
        assert_eq!(connection.read(&mut [0; 64]).await.unwrap(), 5);
    }
}
