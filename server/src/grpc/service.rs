//! One method per RPC: convert the request, call the engine, convert back.
//! A batch RPC takes each item as its unary call does (counted, authorized,
//! parsed: a bad item fails alone), hands the valid ones to the engine
//! together (`acquire_many`, `complete_many`), and answers each as the
//! unary call would.

use std::{
    future::Future,
    sync::atomic::{AtomicUsize, Ordering},
};

use tonic::{Request, Response, Status};

use super::{
    auth::{Authorizer, Caller},
    convert,
    metrics::{CallMetrics, CallSeries, record_batch_items},
    pb,
    status::{batch_reply_full, to_rpc_status, to_status},
};
use crate::{
    domain::{AcquireOutcome, InvalidField, RecordId, Timestamp},
    engine::{AcquireRequest, CompleteRequest, Engine},
    error::Error,
    security::policy::Access,
};

pub use pb::idempotency_service_server::IdempotencyServiceServer;

/// The `idempotency.v1.IdempotencyService` implementation.
#[derive(Debug, Clone)]
pub struct GrpcService {
    engine: Engine,
    series: CallSeries,
    authorizer: Authorizer,
}

/// The caller the auth layer established, if auth is on.
fn caller_of<T>(request: &Request<T>) -> Option<Caller> {
    request.extensions().get::<Caller>().cloned()
}

/// The status the call answers for `error`, counted.
fn failed<T>(call: &mut CallMetrics<'_>, error: Error) -> Result<T, Status> {
    let status = Err(to_status(call.rpc(), error));
    call.finish(&status);
    status
}

impl GrpcService {
    pub fn new(engine: Engine, series: CallSeries, authorizer: Authorizer) -> Self {
        Self {
            engine,
            series,
            authorizer,
        }
    }

    /// Refuses a call (or batch item) on a namespace the caller may not
    /// touch, counting it, before the request is looked at further.
    fn authorize(
        &self,
        call: &mut CallMetrics<'_>,
        caller: Option<&Caller>,
        id: Option<&pb::RecordId>,
        access: Access,
    ) -> Result<(), Status> {
        let namespace = id.map_or("", |id| id.namespace.as_str());
        self.authorizer
            .check(caller, call.rpc(), namespace, access)
            .inspect_err(|denied| call.finish(&Err::<(), _>(denied.clone())))
    }

    /// An Acquire (or BatchAcquire item) authorized, parsed and within the
    /// limits; a refusal is counted.
    fn acquire_request(
        &self,
        call: &mut CallMetrics<'_>,
        caller: Option<&Caller>,
        request: pb::AcquireRequest,
    ) -> Result<AcquireRequest, Status> {
        self.authorize(call, caller, request.id.as_ref(), Access::Write)?;
        let parsed = convert::acquire_request(request).and_then(|fields| {
            call.namespace(fields.id.namespace());
            fields.within(self.engine.limits())
        });
        parsed.or_else(|invalid| failed(call, invalid.into()))
    }

    /// A Complete (or BatchComplete item) authorized, parsed and within the
    /// limits; a refusal is counted.
    fn complete_request(
        &self,
        call: &mut CallMetrics<'_>,
        caller: Option<&Caller>,
        request: pb::CompleteRequest,
    ) -> Result<CompleteRequest, Status> {
        self.authorize(call, caller, request.id.as_ref(), Access::Write)?;
        let limits = self.engine.limits();
        let parsed = convert::record_id(request.id).and_then(|id| {
            call.namespace(id.namespace());
            Ok(CompleteRequest {
                id,
                fencing_token: convert::fencing_token(request.fencing_token)?,
                response: convert::stored_response("response", request.response, limits)?,
            })
        });
        parsed.or_else(|invalid| failed(call, invalid.into()))
    }

    /// Checks a batch's size, takes each item as its unary call would
    /// (`take`: counted, authorized, parsed), runs the valid ones in the
    /// engine together (`run`), answers each as the unary call would
    /// (`answer`), keeps the reply within the message size limit, and turns
    /// each error into the `google.rpc.Status` the unary call would have sent.
    async fn run_batch<Req, Parsed, Out, T, Fut>(
        &self,
        (rpc, item_rpc): (&'static str, &'static str),
        requests: Vec<Req>,
        take: impl Fn(&mut CallMetrics<'_>, Req) -> Result<Parsed, Status>,
        run: impl FnOnce(Vec<Parsed>) -> Fut,
        answer: impl Fn(&mut CallMetrics<'_>, Result<Out, Error>) -> Result<T, Status>,
    ) -> Result<Vec<Result<T, tonic_types::pb::Status>>, Status>
    where
        Parsed: OfRecord,
        Fut: Future<Output = Vec<Result<Out, Error>>>,
        T: ItemAnswer,
    {
        self.check_batch(rpc, requests.len())?;
        record_batch_items(rpc, requests.len());
        let mut valid = Vec::with_capacity(requests.len());
        let items: Vec<_> = requests
            .into_iter()
            .map(|request| {
                let mut call = CallMetrics::start_item(item_rpc, &self.series);
                let taken = take(&mut call, request).map(|parsed| valid.push(parsed));
                (call, taken)
            })
            .collect();
        record_namespaces(&valid);
        let mut outcomes = run(valid).await.into_iter();
        let budget = ReplyBudget::new(self.engine.limits().max_message_bytes());
        Ok(items
            .into_iter()
            .map(|(mut call, taken)| {
                let answer = taken.and_then(|()| {
                    let outcome = outcomes.next().expect("an outcome per valid item");
                    answer(&mut call, outcome)
                });
                budget
                    .admit(answer)
                    .map_err(|status| to_rpc_status(&status))
            })
            .collect())
    }

    /// Refuses an empty or oversized batch before any item runs.
    fn check_batch(&self, rpc: &'static str, items: usize) -> Result<(), Status> {
        let Some(problem) = batch_size_problem(items, self.engine.limits().max_batch_items) else {
            return Ok(());
        };
        let refused = Err(to_status(
            rpc,
            InvalidField::new("requests", problem).into(),
        ));
        CallMetrics::start(rpc, &self.series).finish(&refused);
        refused
    }
}

/// A parsed batch item: the record it is about.
trait OfRecord {
    fn record_id(&self) -> &RecordId;
}

impl OfRecord for AcquireRequest {
    fn record_id(&self) -> &RecordId {
        &self.id
    }
}

impl OfRecord for CompleteRequest {
    fn record_id(&self) -> &RecordId {
        &self.id
    }
}

/// Names a batch call's namespaces in its span, once: its valid items'
/// namespace, or, when they differ, each of them in the items' order,
/// comma-separated (a namespace holds no comma). Recording it per item
/// would repeat the field in every text log line of the call.
fn record_namespaces(items: &[impl OfRecord]) {
    let mut namespaces: Vec<&str> = Vec::new();
    for item in items {
        let namespace = item.record_id().namespace();
        if !namespaces.contains(&namespace) {
            namespaces.push(namespace);
        }
    }
    if !namespaces.is_empty() {
        tracing::Span::current().record("namespace", namespaces.join(","));
    }
}

/// An Acquire's reply, counted under its outcome.
fn acquire_answer(
    call: &mut CallMetrics<'_>,
    outcome: Result<AcquireOutcome, Error>,
) -> Result<pb::AcquireResponse, Status> {
    match outcome {
        Ok(outcome) => {
            call.acquire_outcome(&outcome);
            Ok(convert::acquire_response(outcome))
        }
        Err(error) => failed(call, error),
    }
}

/// A Complete's reply, counted.
fn complete_answer(
    call: &mut CallMetrics<'_>,
    completed: Result<Timestamp, Error>,
) -> Result<pb::CompleteResponse, Status> {
    let result = completed
        .map(|completed_at| pb::CompleteResponse {
            completed_at: Some(convert::timestamp(completed_at)),
        })
        .map_err(|error| to_status(call.rpc(), error));
    call.finish(&result);
    result
}

/// What is wrong with a batch of `items`, if anything (field `requests`).
pub(super) fn batch_size_problem(items: usize, max: usize) -> Option<String> {
    if items == 0 {
        Some("must hold at least one request".to_owned())
    } else if items > max {
        Some(format!(
            "holds {items} requests; the server takes at most {max}"
        ))
    } else {
        None
    }
}

#[tonic::async_trait]
impl pb::idempotency_service_server::IdempotencyService for GrpcService {
    async fn acquire(
        &self,
        request: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        let mut call = CallMetrics::start("Acquire", &self.series);
        let caller = caller_of(&request);
        let request = self.acquire_request(&mut call, caller.as_ref(), request.into_inner())?;
        let outcome = self.engine.acquire(request).await;
        acquire_answer(&mut call, outcome).map(Response::new)
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let mut call = CallMetrics::start("Complete", &self.series);
        let caller = caller_of(&request);
        let request = self.complete_request(&mut call, caller.as_ref(), request.into_inner())?;
        let completed = self.engine.complete(request).await;
        complete_answer(&mut call, completed).map(Response::new)
    }

    async fn fail(
        &self,
        request: Request<pb::FailRequest>,
    ) -> Result<Response<pb::FailResponse>, Status> {
        const RPC: &str = "Fail";
        let mut call = CallMetrics::start(RPC, &self.series);
        let caller = caller_of(&request);
        let request = request.into_inner();
        self.authorize(
            &mut call,
            caller.as_ref(),
            request.id.as_ref(),
            Access::Write,
        )?;
        let result = async {
            let id = convert::record_id(request.id)?;
            call.namespace(id.namespace());
            let token = convert::fencing_token(request.fencing_token)?;
            let failure = convert::failure(
                request.retryable,
                request.error_response,
                self.engine.limits(),
            )?;
            self.engine.fail(id, token, failure).await
        }
        .await
        .map(|state| {
            Response::new(pb::FailResponse {
                state: convert::record_state(state).into(),
            })
        })
        .map_err(|error| to_status(RPC, error));
        call.finish(&result);
        result
    }

    async fn renew(
        &self,
        request: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::RenewResponse>, Status> {
        const RPC: &str = "Renew";
        let mut call = CallMetrics::start(RPC, &self.series);
        let caller = caller_of(&request);
        let request = request.into_inner();
        self.authorize(
            &mut call,
            caller.as_ref(),
            request.id.as_ref(),
            Access::Write,
        )?;
        let result = async {
            let id = convert::record_id(request.id)?;
            call.namespace(id.namespace());
            let token = convert::fencing_token(request.fencing_token)?;
            let lease = convert::lease(request.lease, self.engine.limits())?;
            self.engine.renew(&id, token, lease).await
        }
        .await
        .map(|lease| Response::new(convert::renew_response(lease)))
        .map_err(|error| to_status(RPC, error));
        call.finish(&result);
        result
    }

    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        const RPC: &str = "Get";
        let mut call = CallMetrics::start(RPC, &self.series);
        let caller = caller_of(&request);
        let request = request.into_inner();
        self.authorize(
            &mut call,
            caller.as_ref(),
            request.id.as_ref(),
            Access::Read,
        )?;
        let result = async {
            let id = convert::record_id(request.id)?;
            call.namespace(id.namespace());
            self.engine.get(&id).await
        }
        .await
        .map(|record| {
            Response::new(pb::GetResponse {
                record: Some(convert::record(record)),
            })
        })
        .map_err(|error| to_status(RPC, error));
        call.finish(&result);
        result
    }

    async fn batch_acquire(
        &self,
        request: Request<pb::BatchAcquireRequest>,
    ) -> Result<Response<pb::BatchAcquireResponse>, Status> {
        let caller = caller_of(&request);
        let answers = self
            .run_batch(
                ("BatchAcquire", "Acquire"),
                request.into_inner().requests,
                |call, item| self.acquire_request(call, caller.as_ref(), item),
                |requests| self.engine.acquire_many(requests),
                acquire_answer,
            )
            .await?;
        use pb::batch_acquire_result::Result as Item;
        let results = answers
            .into_iter()
            .map(|answer| pb::BatchAcquireResult {
                result: Some(answer.map_or_else(Item::Error, Item::Response)),
            })
            .collect();
        Ok(Response::new(pb::BatchAcquireResponse { results }))
    }

    async fn batch_complete(
        &self,
        request: Request<pb::BatchCompleteRequest>,
    ) -> Result<Response<pb::BatchCompleteResponse>, Status> {
        let caller = caller_of(&request);
        let answers = self
            .run_batch(
                ("BatchComplete", "Complete"),
                request.into_inner().requests,
                |call, item| self.complete_request(call, caller.as_ref(), item),
                |requests| self.engine.complete_many(requests),
                complete_answer,
            )
            .await?;
        use pb::batch_complete_result::Result as Item;
        let results = answers
            .into_iter()
            .map(|answer| pb::BatchCompleteResult {
                result: Some(answer.map_or_else(Item::Error, Item::Response)),
            })
            .collect();
        Ok(Response::new(pb::BatchCompleteResponse { results }))
    }
}

/// Room in a batch's reply kept for what the budget admits past its limit:
/// its items' errors (a few hundred bytes each at most), its ACQUIRED
/// answers (under a hundred bytes each), and the reply's own framing. A
/// hundred items (the default `--max-batch-items`) of either fit.
const REPLY_HEADROOM: usize = 64 * 1024;
/// An answer's field tags and length prefixes in the reply.
const ANSWER_FRAMING: usize = 16;

/// A batch item's answer, as the reply budget sees it.
trait ItemAnswer: prost::Message {
    /// Whether the answer hands the caller a key (ACQUIRED): dropped, its
    /// caller would never learn its token, and sending the item again would
    /// find the key held (IN_PROGRESS) until the lease passed.
    fn holds_key(&self) -> bool;
}

impl ItemAnswer for pb::AcquireResponse {
    fn holds_key(&self) -> bool {
        matches!(
            self.outcome,
            Some(pb::acquire_response::Outcome::Acquired(_))
        )
    }
}

impl ItemAnswer for pb::CompleteResponse {
    /// A Complete sent again answers as the first did.
    fn holds_key(&self) -> bool {
        false
    }
}

/// Keeps a batch's reply within the message size limit, which is also what
/// gRPC clients accept by default. Replays carry stored responses of up to
/// a MiB each, so a small request (a hundred Acquires of one large record)
/// could otherwise ask for a reply of a hundred MiB, held in memory twice.
/// Answers are counted in the items' order; one that does not fit is
/// dropped at once, and its caller told to send it alone, which is safe for
/// every answer but one that hands over a key: that one is small, and is
/// counted but always admitted (the headroom covers a hundred of them). The
/// budget applies after the engine ran the items, so only answers whose
/// item may run again unchanged (replays, IN_PROGRESS, a mismatch, a
/// Complete's time) are dropped. The first answer always fits: a unary
/// reply holds it.
struct ReplyBudget {
    max: usize,
    used: AtomicUsize,
}

impl ReplyBudget {
    fn new(max_message_bytes: usize) -> Self {
        Self {
            max: max_message_bytes.saturating_sub(REPLY_HEADROOM),
            used: AtomicUsize::new(0),
        }
    }

    fn admit<T: ItemAnswer>(&self, answer: Result<T, Status>) -> Result<T, Status> {
        let Ok(value) = answer else { return answer };
        let bytes = value.encoded_len() + ANSWER_FRAMING;
        let before = self.used.fetch_add(bytes, Ordering::Relaxed);
        if before == 0 || before + bytes <= self.max || value.holds_key() {
            Ok(value)
        } else {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
            Err(batch_reply_full(self.max))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::acquire_response::Outcome;
    use prost::Message;

    const MAX_MESSAGE: usize = REPLY_HEADROOM + 1000;

    fn replay(body: usize) -> pb::AcquireResponse {
        pb::AcquireResponse {
            outcome: Some(Outcome::Completed(pb::Completed {
                response: Some(pb::StoredResponse {
                    status_code: 200,
                    body: vec![b'x'; body],
                    ..Default::default()
                }),
                completed_at: None,
            })),
        }
    }

    fn acquired() -> pb::AcquireResponse {
        pb::AcquireResponse {
            outcome: Some(Outcome::Acquired(pb::Acquired {
                fencing_token: u64::MAX,
                ..Default::default()
            })),
        }
    }

    fn kept(budget: &ReplyBudget, answer: pb::AcquireResponse) -> bool {
        budget.admit(Ok(answer)).is_ok()
    }

    #[test]
    fn the_first_answer_always_fits() {
        let budget = ReplyBudget::new(MAX_MESSAGE);
        assert!(kept(&budget, replay(2000)));
        assert!(!kept(&budget, replay(0)));
    }

    #[test]
    fn a_full_reply_drops_replays_but_never_an_acquired_answer() {
        let budget = ReplyBudget::new(MAX_MESSAGE);

        assert!(kept(&budget, replay(900)));
        assert!(!kept(&budget, replay(200)), "past the budget");
        assert!(kept(&budget, replay(10)), "a smaller one still fits");
        for _ in 0..100 {
            assert!(kept(&budget, acquired()), "a key is never dropped");
        }
        assert!(!kept(&budget, replay(0)), "acquired answers are counted");
    }

    #[test]
    fn an_acquired_answer_with_its_leases_is_small() {
        let answer = pb::AcquireResponse {
            outcome: Some(Outcome::Acquired(pb::Acquired {
                fencing_token: u64::MAX,
                lease_expires_at: Some(prost_types::Timestamp {
                    seconds: i64::MAX,
                    nanos: i32::MAX,
                }),
                expires_at: Some(prost_types::Timestamp {
                    seconds: i64::MAX,
                    nanos: i32::MAX,
                }),
            })),
        };
        // A hundred (the most items a batch may hold) fit the headroom.
        assert!(100 * (answer.encoded_len() + ANSWER_FRAMING) < REPLY_HEADROOM / 2);
    }
}
