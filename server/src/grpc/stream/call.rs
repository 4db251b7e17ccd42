//! One stream message served as the unary batch call it stands for, by the
//! same checks in the same order, called directly rather than through an
//! HTTP request: the call limit, the call's span, auth with the stream's
//! credential as it stands now, the deadline, admission of the batch's
//! bytes, then the service's `BatchAcquire` or `BatchComplete` handler,
//! whose reply is encoded once, straight into the answer.

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures_util::future::{Either, ready};
use http::HeaderMap;
use idempotency_proto::trace::TraceContext;
use prost::Message;
use tonic::{Code, Status};
use tracing::Instrument as _;

use super::{
    super::{
        GrpcService,
        admission::{AdmissionLayer, Charge},
        auth::{Caller, authenticate},
        call_limit::CallLimitLayer,
        deadline::Deadline,
        pb::{self, idempotency_service_server::IdempotencyService as _},
        trace::{call_span, log_code},
    },
    envelope::{self, Content, Kind},
};
use crate::security::Auth;

/// What serves a stream's messages: the port's call limit and admission,
/// auth, and the service's handlers, with the server's bounds.
#[derive(Debug, Clone)]
pub struct Calls {
    pub limit: CallLimitLayer,
    pub admission: AdmissionLayer,
    pub auth: Option<Arc<Auth>>,
    pub service: GrpcService,
    /// `--request-timeout`: a message's call ends by it, or by the
    /// message's own timeout when shorter.
    pub request_timeout: Duration,
    /// `--log-calls`: a line per message, as per unary call.
    pub log_calls: bool,
}

/// Where a stream's messages come from: its metadata and its connection's
/// extensions (the peer's address and certificate), which authenticate
/// each message.
pub(super) struct Origin {
    pub headers: HeaderMap,
    pub extensions: http::Extensions,
}

/// A message's answer (a gRPC message), what it holds until written, and
/// the status that ends the stream when the message's credential no longer
/// checked out.
pub(super) struct Served {
    pub answer: Bytes,
    pub charge: Option<Charge>,
    pub unauthenticated: Option<Status>,
}

impl Served {
    fn failed(id: u64, status: Status) -> Self {
        Self {
            answer: envelope::error(id, &status),
            charge: None,
            unauthenticated: (status.code() == Code::Unauthenticated).then_some(status),
        }
    }
}

impl Calls {
    /// Serves message `id`, whose bytes the stream charged (`charge`). What
    /// can be decided at once (the call limit, auth, admission) is; what is
    /// left is the handler, bounded by the deadline.
    pub(super) fn serve(
        self: &Arc<Self>,
        id: u64,
        content: Content,
        origin: &Origin,
        charge: Charge,
    ) -> impl Future<Output = Served> + Send + 'static {
        let kind = content.kind;
        let rpc = kind.rpc();
        let in_flight = match self.limit.enter() {
            Ok(in_flight) => in_flight,
            Err(status) => return Either::Left(ready(Served::failed(id, status))),
        };
        let span = call_span(rpc, TraceContext::parse(content.traceparent.as_bytes()));
        let started = Instant::now();
        // Admission charges the message again, as it charges a unary call's:
        // the stream's charge for it ends first, so that it is not counted
        // twice.
        drop(charge);
        let admitted = span.in_scope(|| self.admit(kind, &content.batch, origin));
        let deadline = Deadline::of(content.timeout, self.request_timeout);
        let calls = self.clone();
        let served = async move {
            let (result, charge) = match admitted {
                Err(status) => (Err(status), None),
                Ok((caller, charge)) => {
                    let handled = calls.handle(id, kind, content.batch, caller);
                    let result = tokio::time::timeout(deadline.timeout, handled)
                        .await
                        .unwrap_or_else(|_| Err(deadline.expired(rpc)));
                    (result, Some(charge))
                }
            };
            drop(in_flight);
            if calls.log_calls {
                let code = result.as_ref().map_or_else(Status::code, |_| Code::Ok);
                log_code(rpc, Some(code), started);
            }
            match result {
                Ok(answer) => {
                    let charge = charge.map(|mut charge| {
                        // As a unary reply is, until it is written.
                        charge.add(answer.len());
                        charge
                    });
                    Served {
                        answer,
                        charge,
                        unauthenticated: None,
                    }
                }
                Err(status) => Served {
                    charge,
                    ..Served::failed(id, status)
                },
            }
        };
        Either::Right(served.instrument(span))
    }

    /// Who calls, and the message's charge: as the auth and admission
    /// layers decide for a unary call.
    fn admit(
        &self,
        kind: Kind,
        batch: &[u8],
        origin: &Origin,
    ) -> Result<(Option<Caller>, Charge), Status> {
        let caller = self
            .auth
            .as_ref()
            .map(|auth| authenticate(auth, kind.path(), &origin.headers, &origin.extensions))
            .transpose()?;
        let charge = self.admission.admit_message(kind.path(), batch)?;
        Ok((caller, charge))
    }

    /// The handler's answer, as message `id`'s answer.
    async fn handle(
        &self,
        id: u64,
        kind: Kind,
        batch: Bytes,
        caller: Option<Caller>,
    ) -> Result<Bytes, Status> {
        match kind {
            Kind::Acquire => {
                let request = request(pb::BatchAcquireRequest::decode(batch), caller)?;
                let reply = self.service.batch_acquire(request).await?;
                Ok(envelope::answer(id, kind, reply.get_ref()))
            }
            Kind::Complete => {
                let request = request(pb::BatchCompleteRequest::decode(batch), caller)?;
                let reply = self.service.batch_complete(request).await?;
                Ok(envelope::answer(id, kind, reply.get_ref()))
            }
        }
    }
}

/// The handler's request: the decoded batch, and who calls as the auth
/// layer records it. A batch that is not protobuf fails as tonic's codec
/// fails a unary call's (`INTERNAL`, per gRPC's status code guide).
fn request<T>(
    decoded: Result<T, prost::DecodeError>,
    caller: Option<Caller>,
) -> Result<tonic::Request<T>, Status> {
    let mut request =
        tonic::Request::new(decoded.map_err(|error| Status::internal(error.to_string()))?);
    if let Some(caller) = caller {
        request.extensions_mut().insert(caller);
    }
    Ok(request)
}
