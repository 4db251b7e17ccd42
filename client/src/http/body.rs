//! Bodies: reading requests and responses with a bound, and the one body type
//! the layer answers with.

use bytes::Bytes;
use http_body::Body;
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};

// Shared with the gRPC layer.
pub(crate) use crate::middleware::body::{Captured, Prefixed, capture};

/// Errors of any body the layer passes on.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
