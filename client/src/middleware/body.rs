//! Reading request and response bodies with a bound.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

/// A body read up to a limit.
pub(crate) enum Captured<B> {
    /// All of it, within the limit.
    Whole(Bytes),
    /// It went past the limit: what was read, and the unread rest.
    TooLarge { read: Bytes, rest: Pin<Box<B>> },
}

/// Reads `body` until its end or until more than `limit` bytes arrived.
pub(crate) async fn capture<B>(body: B, limit: usize) -> Result<Captured<B>, B::Error>
where
    B: Body<Data = Bytes>,
{
    // Trailers are not kept: stored HTTP responses are status, headers and body.
    Ok(capture_with_trailers(body, limit).await?.0)
}

/// [`capture`], and the trailers when the whole body was read (gRPC answers
/// with its status in them).
pub(crate) async fn capture_with_trailers<B>(
    body: B,
    limit: usize,
) -> Result<(Captured<B>, Option<HeaderMap>), B::Error>
where
    B: Body<Data = Bytes>,
{
    let mut body = Box::pin(body);
    let mut read = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = body.frame().await {
        match frame?.into_data() {
            Ok(data) => {
                read.extend_from_slice(&data);
                if read.len() > limit {
                    let read = read.freeze();
                    return Ok((Captured::TooLarge { read, rest: body }, None));
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
            }
        }
    }
    Ok((Captured::Whole(read.freeze()), trailers))
}

/// The bytes already read, then the rest of the original body.
pub(crate) struct Prefixed<B> {
    prefix: Option<Bytes>,
    rest: Pin<Box<B>>,
}

impl<B> Prefixed<B> {
    pub(crate) fn new(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            prefix: Some(prefix),
            rest,
        }
    }
}

impl<B: Body<Data = Bytes>> Body for Prefixed<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if let Some(prefix) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        this.rest.as_mut().poll_frame(cx)
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let mut hint = SizeHint::new();
        // Upper first: SizeHint refuses a lower bound above its upper one.
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + prefix);
        }
        hint.set_lower(rest.lower() + prefix);
        hint
    }
}
