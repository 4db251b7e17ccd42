//! Bodies: the one body type the layer hands your service, the one it
//! answers with, and (shared with the gRPC layer) reading with a bound.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};

// Shared with the gRPC layer.
pub(crate) use crate::middleware::body::{Captured, Prefixed, capture};

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
