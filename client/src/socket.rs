//! The client's connections: TCP without delay, and a request's HTTP/2
//! frames sent in one write.
//!
//! hyper's HTTP/2 client writes a request's HEADERS frame before the request
//! body's task has had its turn to queue the DATA frame (the body waits for
//! flow-control capacity, which the connection's task assigns when it opens
//! the stream): every unary call left as two writes, two TCP segments. The
//! server then often woke for the first, went back to sleep, and woke again
//! for the second. [`CoalescedWrites`] gives the other tasks one scheduler
//! turn before it writes, so that the body's frame joins its headers: one
//! write per call (30 to 50 µs less per Acquire-and-Complete pair at one
//! caller on the bench machine, where each wake-up costs tens of µs;
//! `docs/performance.md`, "One write per request and per answer").

use std::{
    future::Future,
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};
use tonic::codegen::{Service, StdError, http};

/// Bytes held before a write goes out without waiting for the flush: above
/// any batch of frames a connection sends at once (HTTP/2 frames are at
/// most 16 KiB here).
const MOST_HELD: usize = 64 * 1024;

/// A connection whose writes wait for the flush that follows them, and whose
/// first flush after new writes yields once to the scheduler, so that frames
/// other tasks queue meanwhile go out in the same write.
///
/// The cost: one scheduler turn before a write (about a µs on an idle
/// runtime), and a copy of the bytes written. It never holds bytes past a
/// flush: the flush that yields is polled again at once, and writes.
#[derive(Debug)]
pub(crate) struct CoalescedWrites<IO> {
    io: IO,
    held: Vec<u8>,
    /// How much of `held` is already written.
    written: usize,
    /// The flush in progress has given its turn away.
    yielded: bool,
}

impl<IO> CoalescedWrites<IO> {
    pub(crate) fn new(io: IO) -> Self {
        Self {
            io,
            held: Vec::new(),
            written: 0,
            yielded: false,
        }
    }
}

impl<IO: AsyncWrite + Unpin> CoalescedWrites<IO> {
    /// Writes what is held, all of it.
    fn poll_write_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.held.len() {
            let written =
                ready!(Pin::new(&mut self.io).poll_write(cx, &self.held[self.written..]))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += written;
        }
        self.held.clear();
        self.written = 0;
        // A large batch's buffer is not kept for every later small one.
        if self.held.capacity() > MOST_HELD {
            self.held.shrink_to(MOST_HELD);
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for CoalescedWrites<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for CoalescedWrites<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.held.len() >= MOST_HELD {
            ready!(self.poll_write_held(cx))?;
        }
        self.held.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.written < self.held.len() && !self.yielded {
            // To the back of the run queue: the tasks woken meanwhile (a
            // request body's, ready to queue its DATA frame) run first, and
            // the connection's task, polled again, writes their frames too.
            self.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        ready!(self.poll_write_held(cx))?;
        self.yielded = false;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_write_held(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    /// Not vectored: h2 then copies DATA payloads under 1 KiB into its own
    /// buffer instead of writing them as a second slice that it must flush
    /// before the next frame (h2's `CHAIN_THRESHOLD`).
    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// Connects by TCP, without delay (Nagle's algorithm off), through
/// [`CoalescedWrites`]. tonic layers its own TLS (`ClientTlsConfig`) over it
/// for `https://` endpoints.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TcpConnector;

impl Service<http::Uri> for TcpConnector {
    type Response = TokioIo<CoalescedWrites<TcpStream>>;
    type Error = StdError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, StdError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), StdError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        Box::pin(async move {
            let tcp = connect_tcp(&uri).await?;
            Ok(TokioIo::new(CoalescedWrites::new(tcp)))
        })
    }
}

/// A TCP connection without delay to `uri`'s host and port (80 for `http`,
/// 443 for `https`), trying each address the host resolves to.
pub(crate) async fn connect_tcp(uri: &http::Uri) -> Result<TcpStream, StdError> {
    let host = uri.host().ok_or_else(|| format!("no host in {uri}"))?;
    // An IPv6 address comes in brackets.
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let default_port = if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    };
    let port = uri.port_u16().unwrap_or(default_port);
    let tcp = TcpStream::connect((host, port))
        .await
        .map_err(|error| format!("connecting to {host}:{port}: {error}"))?;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            Arc, Mutex,
            atomic::{AtomicUsize, Ordering},
        },
        task::Waker,
    };

    use tonic::transport::Endpoint;

    use super::*;
    use crate::{
        AcquireRequest, Acquisition, Client, RecordId, StoredResponse, testing::FakeService,
    };

    /// Records each write it is given.
    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Recorder {
        fn writes(&self) -> Vec<Vec<u8>> {
            self.0.lock().unwrap().clone()
        }
    }

    impl AsyncWrite for Recorder {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.0.lock().unwrap().push(buf.to_vec());
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// A TCP stream that counts the writes reaching its socket.
    struct CountedWrites {
        tcp: TcpStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncRead for CountedWrites {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.tcp).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for CountedWrites {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let written = ready!(Pin::new(&mut self.tcp).poll_write(cx, buf))?;
            self.writes.fetch_add(1, Ordering::Relaxed);
            Poll::Ready(Ok(written))
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let written = ready!(Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs))?;
            self.writes.fetch_add(1, Ordering::Relaxed);
            Poll::Ready(Ok(written))
        }

        fn is_write_vectored(&self) -> bool {
            self.tcp.is_write_vectored()
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.tcp).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.tcp).poll_shutdown(cx)
        }
    }

    /// The socket writes of `CALLS` Acquires and Completes (a stored body of
    /// 300 bytes, above h2's 256-byte chaining threshold), one after
    /// another through a real tonic client, each connection's stream made
    /// by `wrap`.
    async fn socket_writes<IO>(wrap: fn(CountedWrites) -> IO) -> usize
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let service = FakeService::plain().await;
        let writes = Arc::<AtomicUsize>::default();
        let connector = tower::service_fn({
            let writes = writes.clone();
            move |uri: http::Uri| {
                let writes = writes.clone();
                async move {
                    let tcp = connect_tcp(&uri).await?;
                    Ok::<_, StdError>(TokioIo::new(wrap(CountedWrites { tcp, writes })))
                }
            }
        });
        let channel = Endpoint::from_shared(format!("http://{}", service.addr))
            .unwrap()
            .connect_with_connector(connector)
            .await
            .unwrap();
        let client = Client::from_channel(channel);
        let request = |n: usize| {
            AcquireRequest::new(
                RecordId::new("shop", "POST /pay", format!("key-{n}")),
                b"f".to_vec(),
            )
        };
        // The connection's preface and settings.
        client.get(&request(0).id).await.unwrap();
        let before = writes.load(Ordering::Relaxed);
        for n in 0..CALLS / 2 {
            let Acquisition::Proceed(mut lease) = client.acquire(&request(n)).await.unwrap() else {
                panic!("the fake service grants every Acquire");
            };
            lease
                .complete(&StoredResponse::new(201, "x".repeat(300)))
                .await
                .unwrap();
        }
        writes.load(Ordering::Relaxed) - before
    }

    const CALLS: usize = 20;

    #[tokio::test]
    async fn a_call_goes_out_in_one_write_where_h2_alone_makes_two() {
        assert_eq!(
            socket_writes(CoalescedWrites::new).await,
            CALLS,
            "one write per call"
        );
        // Without it: the HEADERS frame, then the DATA frame.
        assert!(socket_writes(|io| io).await >= 2 * CALLS);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_goes_out_in_one_write_on_a_runtime_of_several_threads() {
        let writes = socket_writes(CoalescedWrites::new).await;
        // Another thread may run the body's task late; most calls still
        // go out whole.
        assert!(writes < CALLS * 3 / 2, "{writes} writes for {CALLS} calls");
    }

    #[test]
    fn writes_before_the_second_flush_go_out_as_one() {
        let recorder = Recorder::default();
        let mut io = CoalescedWrites::new(recorder.clone());
        let mut cx = Context::from_waker(Waker::noop());

        assert!(Pin::new(&mut io).poll_write(&mut cx, b"headers").is_ready());
        assert!(
            Pin::new(&mut io).poll_flush(&mut cx).is_pending(),
            "the first flush yields"
        );
        assert!(recorder.writes().is_empty(), "nothing written yet");
        assert!(Pin::new(&mut io).poll_write(&mut cx, b"+data").is_ready());
        assert!(Pin::new(&mut io).poll_flush(&mut cx).is_ready());

        assert_eq!(recorder.writes(), vec![b"headers+data".to_vec()]);
        assert!(
            Pin::new(&mut io).poll_flush(&mut cx).is_ready(),
            "nothing held: no yield"
        );
    }

    #[test]
    fn a_flush_yields_once_then_writes_what_it_holds() {
        let recorder = Recorder::default();
        let mut io = CoalescedWrites::new(recorder.clone());
        let mut cx = Context::from_waker(Waker::noop());

        for round in 0..3 {
            let bytes = format!("frame {round}");
            assert!(
                Pin::new(&mut io)
                    .poll_write(&mut cx, bytes.as_bytes())
                    .is_ready()
            );
            assert!(Pin::new(&mut io).poll_flush(&mut cx).is_pending());
            assert!(Pin::new(&mut io).poll_flush(&mut cx).is_ready());
            assert_eq!(recorder.writes().last().unwrap(), bytes.as_bytes());
        }
        assert_eq!(recorder.writes().len(), 3);
    }

    #[test]
    fn a_full_hold_is_written_without_a_flush_and_shutdown_writes_the_rest() {
        let recorder = Recorder::default();
        let mut io = CoalescedWrites::new(recorder.clone());
        let mut cx = Context::from_waker(Waker::noop());
        let chunk = vec![7u8; MOST_HELD / 4];

        for _ in 0..5 {
            assert!(Pin::new(&mut io).poll_write(&mut cx, &chunk).is_ready());
        }
        assert_eq!(
            recorder.writes().concat().len(),
            MOST_HELD,
            "the first four went out"
        );
        assert!(Pin::new(&mut io).poll_shutdown(&mut cx).is_ready());
        assert_eq!(recorder.writes().concat().len(), MOST_HELD + chunk.len());
    }
}
