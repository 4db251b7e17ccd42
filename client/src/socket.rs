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
    time::Duration,
};

use hyper_util::{client::legacy::connect::HttpConnector, rt::TokioIo};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};
use tonic::codegen::{Service, StdError, http};

/// Bytes held before they are written without waiting for the flush: a
/// threshold, not a bound on what one write may carry (h2 hands over at
/// most a frame at a time).
const MOST_HELD: usize = 64 * 1024;

/// The hold's buffer kept between writes; a larger one (a large batch's) is
/// freed once written.
const KEPT_CAPACITY: usize = 16 * 1024;

/// A connection whose writes wait for the flush that follows them, and whose
/// first flush after new writes yields once to the scheduler, so that frames
/// other tasks queue meanwhile go out in the same write.
///
/// The cost: one scheduler turn before a write, and a copy of the bytes
/// written. The flush that yields wakes its task first, and writes when the
/// task polls it again (h2 writes only within a flush, and its connection's
/// task always flushes before it waits). On a runtime of several threads
/// another worker may poll the connection's task before the body's task has
/// run: that request goes out as two writes, as without this.
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
        // Written: the next flush of new writes yields again.
        self.yielded = false;
        // A large batch's buffer is not kept for every later small one.
        if self.held.capacity() > KEPT_CAPACITY {
            self.held = Vec::new();
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
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    /// All the slices, held as one (a TLS stream above this one writes its
    /// records vectored), after writing what was held when that is above
    /// the threshold.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.held.len() >= MOST_HELD {
            ready!(self.poll_write_held(cx))?;
        }
        let mut written = 0;
        for buf in bufs {
            self.held.extend_from_slice(buf);
            written += buf.len();
        }
        Poll::Ready(Ok(written))
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

/// Connects by TCP as tonic's own connector does (hyper's `HttpConnector`:
/// every address the host resolves to, IPv6 and IPv4 raced, the connect
/// timeout shared among them, Nagle's algorithm off), through
/// [`CoalescedWrites`]. tonic layers its own TLS (`ClientTlsConfig`) over it
/// for `https://` endpoints.
#[derive(Debug, Clone)]
pub(crate) struct TcpConnector {
    http: HttpConnector,
}

impl TcpConnector {
    pub(crate) fn new(connect_timeout: Duration) -> Self {
        let mut http = HttpConnector::new();
        // `https://` endpoints too: tonic's TLS, or ours, goes over it.
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        Self { http }
    }

    /// A TCP connection to `uri`'s host and port (80 for `http`, 443 for
    /// `https`).
    pub(crate) async fn tcp(&self, uri: http::Uri) -> Result<TcpStream, StdError> {
        let mut http = self.http.clone();
        Ok(http.call(uri).await?.into_inner())
    }
}

impl Service<http::Uri> for TcpConnector {
    type Response = TokioIo<CoalescedWrites<TcpStream>>;
    type Error = StdError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, StdError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), StdError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connector = self.clone();
        Box::pin(async move {
            let tcp = connector.tcp(uri).await?;
            Ok(TokioIo::new(CoalescedWrites::new(tcp)))
        })
    }
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
                    let tcp = TcpConnector::new(Duration::from_secs(2)).tcp(uri).await?;
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
        // The connection's preface and settings, and the client's probe
        // for BatchStream (which the fake has not).
        client.get(&request(0).id).await.unwrap();
        let _probed = client.acquire(&request(CALLS)).await.unwrap();
        // The refused stream's end, written after its answer.
        tokio::time::sleep(Duration::from_millis(100)).await;
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
        // Without it hyper writes the HEADERS frame, then the DATA frame.
        let alone = socket_writes(|io| io).await;
        assert!(alone > CALLS, "{alone} writes for {CALLS} calls without it");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_goes_out_in_one_write_on_a_runtime_of_several_threads() {
        let writes = socket_writes(CoalescedWrites::new).await;
        // Another worker may poll the connection's task before the body's
        // task has run: then that call goes out as two writes, never more.
        assert!(
            (CALLS..=2 * CALLS).contains(&writes),
            "{writes} writes for {CALLS} calls"
        );
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
