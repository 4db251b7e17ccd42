//! Bodies: reading requests and responses with a bound, and the one body type
//! the layer answers with.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};

/// Errors of any body the layer passes on.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body your service receives from the layer, whatever body the server
/// gave it (hyper's `Incoming`, axum's `Body`, …): the request's bytes,
/// buffered when the layer read them for the fingerprint, else the original
/// body, boxed.
#[derive(Debug)]
pub struct RequestBody(ResponseBody);

impl RequestBody {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        Self(full(bytes))
    }

    pub(crate) fn boxed<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self(boxed(body))
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.get_mut().0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}

/// The body of every response the layer gives: the handler's own (passed
/// through), a buffered one, or a replayed one.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

pub(crate) fn full(bytes: Bytes) -> ResponseBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub(crate) fn boxed<B>(body: B) -> ResponseBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

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
    let mut body = Box::pin(body);
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        // Trailers are not kept: stored responses are status, headers and body.
        if let Ok(data) = frame?.into_data() {
            read.extend_from_slice(&data);
            if read.len() > limit {
                return Ok(Captured::TooLarge {
                    read: read.freeze(),
                    rest: body,
                });
            }
        }
    }
    Ok(Captured::Whole(read.freeze()))
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
