//! What a connection's HTTP/2 codec writes, held until it flushes, so that
//! the frames of one flush leave in one write, whatever their sizes.
//!
//! h2 writes a DATA payload of 1 KiB or more (256 bytes or more on a
//! vectored stream) apart from its buffer: on a stream that is not vectored,
//! as a write of the buffer and a write of the payload's rest. Held, both
//! join in one write at the flush. (On a vectored stream h2 would write
//! both in one `writev`, but must flush a payload of 256 bytes or more
//! before it can buffer the next frame: an answer's trailers went out in a
//! second write. See `Connection::is_write_vectored`.)

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use tokio::io::AsyncWrite;

/// Bytes held before they are written without waiting for the flush: a
/// threshold, not a bound on one write (h2 hands over at most a frame, 16
/// KiB by default, at a time).
const MOST_HELD: usize = 64 * 1024;

/// The buffer kept between flushes; a larger one (a large batch's) is freed
/// once written.
const KEPT_CAPACITY: usize = 16 * 1024;

#[derive(Debug, Default)]
pub struct WriteHold {
    held: Vec<u8>,
    /// How much of `held` is already written.
    written: usize,
}

impl WriteHold {
    /// Holds `bufs`, after writing what was held when that is above the
    /// threshold. Ready with the bytes taken: all of `bufs`.
    pub fn poll_hold<IO: AsyncWrite + Unpin>(
        &mut self,
        io: &mut IO,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.held.len() >= MOST_HELD {
            ready!(self.poll_write_held(io, cx))?;
        }
        let mut taken = 0;
        for buf in bufs {
            self.held.extend_from_slice(buf);
            taken += buf.len();
        }
        Poll::Ready(Ok(taken))
    }

    /// Writes what is held, all of it.
    pub fn poll_write_held<IO: AsyncWrite + Unpin>(
        &mut self,
        io: &mut IO,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while self.written < self.held.len() {
            let written = ready!(Pin::new(&mut *io).poll_write(cx, &self.held[self.written..]))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += written;
        }
        self.held.clear();
        self.written = 0;
        if self.held.capacity() > KEPT_CAPACITY {
            self.held = Vec::new();
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use super::*;

    /// Takes at most `most` bytes per write, or none (pending) while `stuck`.
    #[derive(Default)]
    struct Socket {
        writes: Vec<Vec<u8>>,
        most: Option<usize>,
        stuck: bool,
    }

    impl AsyncWrite for Socket {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            if self.stuck {
                return Poll::Pending;
            }
            let taken = self.most.map_or(buf.len(), |most| most.min(buf.len()));
            self.writes.push(buf[..taken].to_vec());
            Poll::Ready(Ok(taken))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn hold(writes: &mut WriteHold, socket: &mut Socket, bytes: &[u8]) -> Poll<io::Result<usize>> {
        let mut cx = Context::from_waker(Waker::noop());
        writes.poll_hold(socket, &mut cx, &[io::IoSlice::new(bytes)])
    }

    fn write_held(writes: &mut WriteHold, socket: &mut Socket) -> Poll<io::Result<()>> {
        let mut cx = Context::from_waker(Waker::noop());
        writes.poll_write_held(socket, &mut cx)
    }

    #[test]
    fn held_writes_leave_together_and_in_order() {
        let (mut writes, mut socket) = (WriteHold::default(), Socket::default());
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(
            hold(&mut writes, &mut socket, b"head"),
            Poll::Ready(Ok(4))
        ));
        let slices = [io::IoSlice::new(b"+da"), io::IoSlice::new(b"ta")];
        assert!(matches!(
            writes.poll_hold(&mut socket, &mut cx, &slices),
            Poll::Ready(Ok(5))
        ));
        assert!(socket.writes.is_empty(), "nothing before the flush");

        assert!(write_held(&mut writes, &mut socket).is_ready());
        assert_eq!(socket.writes, vec![b"head+data".to_vec()]);
        assert!(write_held(&mut writes, &mut socket).is_ready());
        assert_eq!(socket.writes.len(), 1, "nothing held: nothing written");
    }

    #[test]
    fn a_short_or_pending_socket_gets_the_rest_later() {
        let (mut writes, mut socket) = (WriteHold::default(), Socket::default());
        let _ = hold(&mut writes, &mut socket, b"0123456789");
        socket.most = Some(4);
        socket.stuck = true;
        assert!(write_held(&mut writes, &mut socket).is_pending());
        socket.stuck = false;
        assert!(write_held(&mut writes, &mut socket).is_ready());
        assert_eq!(socket.writes.concat(), b"0123456789");
        assert_eq!(socket.writes.len(), 3);
    }

    #[test]
    fn a_full_hold_is_written_before_more_is_held() {
        let (mut writes, mut socket) = (WriteHold::default(), Socket::default());
        let chunk = vec![1u8; MOST_HELD / 2];
        for _ in 0..3 {
            assert!(hold(&mut writes, &mut socket, &chunk).is_ready());
        }
        assert_eq!(socket.writes.concat().len(), MOST_HELD, "the first two");
        assert!(write_held(&mut writes, &mut socket).is_ready());
        assert_eq!(socket.writes.concat().len(), 3 * chunk.len());
        assert_eq!(writes.held.capacity(), 0, "a large buffer is not kept");
    }

    #[test]
    fn a_socket_that_takes_nothing_is_an_error() {
        let (mut writes, mut socket) = (WriteHold::default(), Socket::default());
        let _ = hold(&mut writes, &mut socket, b"bytes");
        socket.most = Some(0);
        let Poll::Ready(Err(error)) = write_held(&mut writes, &mut socket) else {
            panic!("a write of zero bytes fails the flush");
        };
        assert_eq!(error.kind(), io::ErrorKind::WriteZero);
    }
}
