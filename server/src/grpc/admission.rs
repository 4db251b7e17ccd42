//! Admission: what a call may cost, decided before its message is decoded.
//!
//! tonic buffers a whole request message and decodes it before the handler
//! runs, so a limit the handler checks comes after the memory is spent: a
//! 4 MiB BatchAcquire of two million empty items decodes into ~330 MiB. This
//! layer reads the gRPC length prefix first and refuses
//! - a message longer than its method can validly be (`OUT_OF_RANGE`,
//!   reason `MESSAGE_TOO_LARGE`), before reading it;
//! - a call that would carry the bytes of the calls in flight past the
//!   memory budget (`UNAVAILABLE`, reason `OVERLOADED`): load shedding, so
//!   the process stays inside its memory limit and the caller retries,
//!   perhaps on another replica;
//! - a batch with more items than the limit, or a stored response with more
//!   headers, counted on the wire before anything is allocated
//!   (`INVALID_ARGUMENT`, the answer the handler would give).
//!
//! A call's charge is its message (twice: tonic's buffer and the decoded
//! request) plus [`PER_CALL_BYTES`]; its reply's bytes are added as they are
//! produced, and the whole charge is held until the reply has been sent.
//!
//! Only `idempotency.v1.IdempotencyService` is admitted here (a unit test
//! checks that `Method::of` knows each of its methods); the other services
//! on the port, health and reflection, pass through uncharged, and their
//! servers hold a request to a small message's size instead (`startup.rs`).

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use http::HeaderMap;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt as _;
use tonic::{Code, Status, body::Body};

use super::{
    metrics::{CallMetrics, CallSeries},
    status::{reason, to_status, with_reason},
    wire,
};
use crate::{domain::InvalidField, domain::Limits, metrics, telemetry::MetricsRecorder};

/// What a call costs beyond its messages: its HTTP/2 stream, request and
/// task state. bench/connections.py measured 9.1 KiB of server RSS per call
/// in flight waiting for its request (plain text; 9.0 KiB over TLS).
pub const PER_CALL_BYTES: usize = 10 * 1024;

/// The gRPC message prefix: a compression flag and a 4-byte length.
const PREFIX_BYTES: usize = 5;

const SERVICE_PREFIX: &str = "/idempotency.v1.IdempotencyService/";

/// Bytes of the calls in flight, against a limit.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: AtomicUsize,
    gauge: ::metrics::Gauge,
}

impl MemoryBudget {
    /// Built after the metrics recorder is installed (hence the proof): it
    /// registers its gauge here, once, and publishes its limit.
    pub fn new(limit: usize, _installed: &MetricsRecorder) -> Arc<Self> {
        let gauge = ::metrics::gauge!(metrics::IN_FLIGHT_BYTES);
        gauge.set(0.0);
        ::metrics::gauge!(metrics::IN_FLIGHT_BYTES_LIMIT).set(limit as f64);
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
            gauge,
        })
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Charges `bytes` if they fit under the limit.
    pub(super) fn try_charge(self: &Arc<Self>, bytes: usize) -> Option<Charge> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .ok()?;
        self.publish();
        Some(Charge {
            budget: self.clone(),
            bytes,
        })
    }

    fn publish(&self) {
        self.gauge.set(self.used() as f64);
    }
}

/// Bytes charged to the budget until dropped.
#[derive(Debug)]
pub(super) struct Charge {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Charge {
    /// Adds bytes already spent (a reply being sent): charged even past the
    /// limit, so that the calls after it are refused until it is sent.
    pub(super) fn add(&mut self, bytes: usize) {
        self.budget.used.fetch_add(bytes, Ordering::AcqRel);
        self.bytes += bytes;
        self.budget.publish();
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        self.budget.publish();
    }
}

/// The service's methods, as admission tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Small(&'static str),
    Complete,
    Fail,
    BatchAcquire,
    BatchComplete,
}

impl Method {
    fn of(path: &str) -> Option<Self> {
        Some(match path.strip_prefix(SERVICE_PREFIX)? {
            "Acquire" => Self::Small("Acquire"),
            "Renew" => Self::Small("Renew"),
            "Get" => Self::Small("Get"),
            "Complete" => Self::Complete,
            "Fail" => Self::Fail,
            "BatchAcquire" => Self::BatchAcquire,
            "BatchComplete" => Self::BatchComplete,
            _ => return None,
        })
    }

    fn rpc(self) -> &'static str {
        match self {
            Self::Small(rpc) => rpc,
            Self::Complete => "Complete",
            Self::Fail => "Fail",
            Self::BatchAcquire => "BatchAcquire",
            Self::BatchComplete => "BatchComplete",
        }
    }

    /// The longest message a valid call of this method can have.
    fn max_bytes(self, limits: &Limits) -> usize {
        match self {
            Self::Small(_) => limits.max_small_message_bytes(),
            Self::Complete | Self::Fail => limits.max_finish_message_bytes(),
            Self::BatchAcquire => limits.max_batch_acquire_message_bytes(),
            Self::BatchComplete => limits.max_message_bytes(),
        }
    }

    /// What is counted on the wire, before decoding.
    fn counted(self, limits: &Limits) -> Vec<Counted> {
        let headers = limits.max_response_headers;
        let items = limits.max_batch_items;
        match self {
            Self::Small(_) => Vec::new(),
            Self::Complete => vec![Counted::headers(&[3, 3], headers, "response.headers")],
            Self::Fail => vec![Counted::headers(&[4, 3], headers, "error_response.headers")],
            Self::BatchAcquire => vec![Counted::items(items)],
            // Each item's headers are checked as its unary call would check
            // them (failing that item alone); the total bounds the decoding.
            Self::BatchComplete => vec![
                Counted::items(items),
                Counted::headers(&[1, 3, 3], items.saturating_mul(headers), "requests"),
            ],
        }
    }
}

/// A repeated field counted before decoding, and its most.
struct Counted {
    path: &'static [u32],
    max: usize,
    field: &'static str,
    kind: Kind,
}

/// What a [`Counted`] field holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Items,
    Headers,
}

impl Counted {
    /// A batch's items.
    fn items(max: usize) -> Self {
        Self {
            path: &[1],
            max,
            field: "requests",
            kind: Kind::Items,
        }
    }

    /// The headers of stored responses at `path`.
    fn headers(path: &'static [u32], max: usize, field: &'static str) -> Self {
        Self {
            path,
            max,
            field,
            kind: Kind::Headers,
        }
    }

    /// The refusal's metric reason.
    fn reason(&self) -> &'static str {
        match self.kind {
            Kind::Items => "too_many_items",
            Kind::Headers => "too_many_headers",
        }
    }

    /// Refuses the message when it holds more than `max`, in the handler's own words.
    fn check(&self, message: &[u8]) -> Result<(), InvalidField> {
        let count = wire::count(message, self.path).map_err(|_| {
            InvalidField::new(
                "",
                "is not a valid protobuf message of this method's request type",
            )
        })?;
        let problem = match self.kind {
            Kind::Items => super::service::batch_size_problem(count, self.max),
            Kind::Headers if count > self.max => Some(format!(
                "{} {count} headers; the limit is {}",
                if self.path.len() > 2 { "hold" } else { "has" },
                self.max
            )),
            Kind::Headers => None,
        };
        problem.map_or(Ok(()), |problem| {
            Err(InvalidField::new(self.field, problem))
        })
    }
}

/// Refuses, before decoding, what a call may not cost (see the module docs).
#[derive(Debug, Clone)]
pub struct AdmissionLayer {
    rules: Arc<Rules>,
}

#[derive(Debug)]
struct Rules {
    limits: Limits,
    budget: Arc<MemoryBudget>,
    series: CallSeries,
}

impl AdmissionLayer {
    pub fn new(limits: Limits, budget: Arc<MemoryBudget>, series: CallSeries) -> Self {
        Self {
            rules: Arc::new(Rules {
                limits,
                budget,
                series,
            }),
        }
    }
}

impl AdmissionLayer {
    /// Admits a whole, uncompressed message of the call to `path` (a
    /// BatchStream message's batch), as a unary call's is admitted: its
    /// charge, held until its answer is written, or the call's answer.
    pub(super) fn admit_message(&self, path: &str, message: &[u8]) -> Result<Charge, Status> {
        let method = Method::of(path).expect("a method of the service");
        let rules = &self.rules;
        charged(method, rules, message.len())
            .and_then(|charge| {
                count(method, &method.counted(&rules.limits), message).map(|()| charge)
            })
            .inspect_err(|status| {
                CallMetrics::start(method.rpc(), &rules.series)
                    .finish(&Err::<(), _>(status.clone()))
            })
    }
}

impl<S> tower::Layer<S> for AdmissionLayer {
    type Service = Admitted<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Admitted {
            inner,
            rules: self.rules.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Admitted<S> {
    inner: S,
    rules: Arc<Rules>,
}

impl<S> tower::Service<http::Request<Body>> for Admitted<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The clone that was driven to readiness serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(method) = Method::of(request.uri().path()) else {
            // Health and reflection: their servers bound their requests.
            return Box::pin(inner.call(request));
        };
        let rules = self.rules.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            match admit(method, &rules, body).await {
                Ok((body, charge)) => {
                    let response = inner.call(http::Request::from_parts(parts, body)).await?;
                    Ok(response.map(|body| {
                        Body::new(Charged {
                            inner: body,
                            charge,
                        })
                    }))
                }
                Err(status) => {
                    CallMetrics::start(method.rpc(), &rules.series)
                        .finish(&Err::<(), _>(status.clone()));
                    Ok(status.into_http())
                }
            }
        })
    }
}

/// Counts a refusal by its reason.
fn refused(reason: &'static str) {
    ::metrics::counter!(metrics::ADMISSION_REFUSED_TOTAL, "reason" => reason).increment(1);
}

/// Reads as much of the request as the checks need, charges the budget, and
/// hands back a body that replays what was read, then the rest.
async fn admit(method: Method, rules: &Rules, mut body: Body) -> Result<(Body, Charge), Status> {
    let mut read = Read::default();
    read.until(&mut body, PREFIX_BYTES).await?;
    let Some(length) = read.message_length() else {
        // No complete prefix: the body ended early, tonic says so.
        let charge = rules
            .budget
            .try_charge(PER_CALL_BYTES)
            .ok_or_else(overloaded)?;
        return Ok((read.replay(body), charge));
    };
    let charge = charged(method, rules, length)?;
    let counted = method.counted(&rules.limits);
    if !counted.is_empty() && read.compression_flag() == Some(0) {
        read.reserve(PREFIX_BYTES + length);
        read.until(&mut body, PREFIX_BYTES + length).await?;
        if let Some(message) = read.message(length) {
            count(method, &counted, message)?;
        }
    }
    Ok((read.replay(body), charge))
}

/// A message of `length` bytes within its method's limit, charged to the budget.
fn charged(method: Method, rules: &Rules, length: usize) -> Result<Charge, Status> {
    let max = method.max_bytes(&rules.limits);
    if length > max {
        refused("message_too_large");
        return Err(with_reason(
            Code::OutOfRange,
            format!(
                "the {} message is {length} bytes; the server takes at most {max}",
                method.rpc()
            ),
            reason::MESSAGE_TOO_LARGE,
        ));
    }
    rules
        .budget
        .try_charge(PER_CALL_BYTES + 2 * length)
        .ok_or_else(overloaded)
}

/// Checks `message`'s item and header counts.
fn count(method: Method, counted: &[Counted], message: &[u8]) -> Result<(), Status> {
    for count in counted {
        if let Err(invalid) = count.check(message) {
            refused(count.reason());
            return Err(to_status(method.rpc(), invalid.into()));
        }
    }
    Ok(())
}

fn overloaded() -> Status {
    refused("overloaded");
    with_reason(
        Code::Unavailable,
        "the server is at its memory budget for calls in flight (--max-in-flight-bytes); retry \
         with backoff"
            .into(),
        reason::OVERLOADED,
    )
}

/// What was read of a request body before the call went on.
#[derive(Default)]
struct Read {
    bytes: BytesMut,
    trailers: Option<HeaderMap>,
    ended: bool,
}

impl Read {
    /// Reads until `wanted` bytes are here or the body ends.
    async fn until(&mut self, body: &mut Body, wanted: usize) -> Result<(), Status> {
        while self.bytes.len() < wanted && !self.ended {
            match body.frame().await {
                None => self.ended = true,
                Some(Err(status)) => return Err(status),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.bytes.extend_from_slice(&data),
                    Err(frame) => {
                        self.trailers = frame.into_trailers().ok();
                        self.ended = true;
                    }
                },
            }
        }
        Ok(())
    }

    fn reserve(&mut self, total: usize) {
        self.bytes.reserve(total.saturating_sub(self.bytes.len()));
    }

    fn compression_flag(&self) -> Option<u8> {
        self.bytes.first().copied()
    }

    fn message_length(&self) -> Option<usize> {
        let prefix = self.bytes.get(..PREFIX_BYTES)?;
        let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
        usize::try_from(length).ok()
    }

    /// The message, once all of it was read.
    fn message(&self, length: usize) -> Option<&[u8]> {
        self.bytes.get(PREFIX_BYTES..PREFIX_BYTES + length)
    }

    /// A body that yields what was read, then the rest of `body`.
    fn replay(self, body: Body) -> Body {
        Body::new(Replayed {
            head: Some(self.bytes.freeze()).filter(|head| !head.is_empty()),
            trailers: self.trailers,
            rest: (!self.ended).then_some(body),
        })
    }
}

/// The request body as tonic reads it: what admission read, then the rest.
struct Replayed {
    head: Option<Bytes>,
    trailers: Option<HeaderMap>,
    rest: Option<Body>,
}

impl http_body::Body for Replayed {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Some(trailers) = self.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(|rest| rest.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let head = self.head.as_ref().map_or(0, |head| head.len() as u64);
        let mut hint = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |rest| rest.size_hint());
        hint.set_lower(hint.lower() + head);
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + head);
        }
        hint
    }
}

/// A reply that keeps its call's charge, and adds its own bytes to it,
/// until it has been sent (or the client went away).
struct Charged {
    inner: Body,
    charge: Charge,
}

impl http_body::Body for Charged {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.charge.add(data.len());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::{grpc::pb, metrics::NamespaceLabels};

    fn framed(message: &impl Message) -> Bytes {
        let encoded = message.encode_to_vec();
        let mut bytes = vec![0u8];
        bytes.extend((encoded.len() as u32).to_be_bytes());
        bytes.extend(encoded);
        bytes.into()
    }

    fn rules(budget: usize) -> Rules {
        Rules {
            limits: Limits::default(),
            budget: MemoryBudget::new(budget, &MetricsRecorder::install()),
            series: CallSeries::new(NamespaceLabels::new(10), &MetricsRecorder::install()),
        }
    }

    /// A body arriving in chunks of `chunk` bytes.
    fn body(bytes: Bytes, chunk: usize) -> Body {
        let chunks: Vec<Result<Frame<Bytes>, Status>> = bytes
            .chunks(chunk)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
            chunks,
        )))
    }

    async fn collected(body: Body) -> Bytes {
        body.collect().await.unwrap().to_bytes()
    }

    #[tokio::test]
    async fn what_was_read_reaches_the_service_unchanged() {
        let rules = rules(1 << 20);
        let message = framed(&pb::BatchAcquireRequest {
            requests: vec![pb::AcquireRequest::default(); 3],
        });
        for chunk in [1, 3, 5, 7, 1000] {
            let (body, charge) = admit(Method::BatchAcquire, &rules, body(message.clone(), chunk))
                .await
                .unwrap();
            assert_eq!(collected(body).await, message, "chunks of {chunk}");
            assert_eq!(charge.bytes, PER_CALL_BYTES + 2 * (message.len() - 5));
        }
        assert_eq!(rules.budget.used(), 0);
    }

    #[tokio::test]
    async fn too_many_items_are_refused_before_decoding() {
        let rules = rules(64 << 20);
        let items = Limits::default().max_batch_items + 1;
        let message = framed(&pb::BatchAcquireRequest {
            requests: vec![pb::AcquireRequest::default(); items],
        });
        let status = admit(Method::BatchAcquire, &rules, body(message, 4096))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains("requests"), "{status:?}");
        assert_eq!(rules.budget.used(), 0);
    }

    #[tokio::test]
    async fn a_message_longer_than_its_method_allows_is_refused_unread() {
        let rules = rules(64 << 20);
        // Only the prefix: the rest is never read.
        let mut prefix = vec![0u8];
        prefix.extend(((64 * 1024) as u32).to_be_bytes());
        let status = admit(Method::Small("Acquire"), &rules, body(prefix.into(), 5))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange);
    }

    #[tokio::test]
    async fn calls_past_the_budget_are_shed_until_charges_are_released() {
        let message = framed(&pb::AcquireRequest::default());
        let rules = rules(2 * PER_CALL_BYTES + 10);
        let first = admit(Method::Small("Acquire"), &rules, body(message.clone(), 100))
            .await
            .unwrap();
        let second = admit(Method::Small("Acquire"), &rules, body(message.clone(), 100))
            .await
            .unwrap();
        let shed = admit(Method::Small("Acquire"), &rules, body(message.clone(), 100))
            .await
            .unwrap_err();
        assert_eq!(shed.code(), Code::Unavailable);
        drop((first, second));
        assert_eq!(rules.budget.used(), 0);
        assert!(
            admit(Method::Small("Acquire"), &rules, body(message, 100))
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn a_reply_is_charged_until_it_is_sent() {
        let rules = rules(1 << 20);
        let charge = rules.budget.try_charge(100).unwrap();
        let mut reply = Body::new(Charged {
            inner: body(Bytes::from(vec![0u8; 5000]), 5000),
            charge,
        });
        let frame = reply.frame().await.unwrap().unwrap();
        assert_eq!(frame.data_ref().map(Bytes::len), Some(5000));
        assert_eq!(rules.budget.used(), 5100);
        drop(reply);
        assert_eq!(rules.budget.used(), 0);
    }

    #[test]
    fn header_counts_are_checked_per_method() {
        let limits = Limits {
            max_response_headers: 2,
            ..Limits::default()
        };
        let complete = |headers: usize| pb::CompleteRequest {
            response: Some(pb::StoredResponse {
                headers: (0..headers)
                    .map(|i| (format!("h{i}"), String::new()))
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let check = |method: Method, message: &[u8]| {
            method
                .counted(&limits)
                .iter()
                .try_for_each(|counted| counted.check(message))
        };
        assert!(check(Method::Complete, &complete(2).encode_to_vec()).is_ok());
        let error = check(Method::Complete, &complete(3).encode_to_vec()).unwrap_err();
        assert_eq!(error.field, "response.headers");
        let batch = pb::BatchCompleteRequest {
            requests: vec![complete(3), complete(0)],
        };
        // 3 headers in one item, 4 allowed in all: left to the item's own check.
        assert!(check(Method::BatchComplete, &batch.encode_to_vec()).is_ok());
    }

    /// A method `Method::of` does not know passes admission unchecked: an
    /// RPC added to the proto must be added there too.
    #[test]
    fn admission_knows_every_method_of_the_service() {
        let files = prost_types::FileDescriptorSet::decode(pb::FILE_DESCRIPTOR_SET).unwrap();
        let service = files
            .file
            .iter()
            .filter(|file| file.package() == "idempotency.v1")
            .flat_map(|file| &file.service)
            .find(|service| service.name() == "IdempotencyService")
            .expect("idempotency.v1.IdempotencyService in the descriptor set");
        assert_eq!(
            SERVICE_PREFIX,
            format!("/idempotency.v1.{}/", service.name())
        );
        assert!(!service.method.is_empty());
        for method in &service.method {
            let path = format!("{SERVICE_PREFIX}{}", method.name());
            let known = Method::of(&path).unwrap_or_else(|| panic!("admission skips {path}"));
            assert_eq!(known.rpc(), method.name());
        }
    }
}
