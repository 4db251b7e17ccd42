//! One method per RPC: convert the request, call the engine, convert back.
//! A batch RPC runs its items as the unary calls, concurrently, so that the
//! store's group commit puts them in shared statements.

use std::{
    collections::HashMap,
    future::Future,
    sync::atomic::{AtomicUsize, Ordering},
};

use futures_util::future::join_all;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::{
    auth::{Authorizer, Caller},
    convert,
    metrics::{CallMetrics, record_batch_items},
    pb,
    status::{batch_reply_full, to_rpc_status, to_status},
};
use crate::{
    domain::InvalidField, engine::Engine, metrics::NamespaceLabels, security::policy::Access,
};

pub use pb::idempotency_service_server::IdempotencyServiceServer;

/// The `idempotency.v1.IdempotencyService` implementation.
#[derive(Debug, Clone)]
pub struct GrpcService {
    engine: Engine,
    namespaces: NamespaceLabels,
    authorizer: Authorizer,
}

/// The caller the auth layer established, if auth is on.
fn caller_of<T>(request: &Request<T>) -> Option<Caller> {
    request.extensions().get::<Caller>().cloned()
}

impl GrpcService {
    pub fn new(engine: Engine, namespaces: NamespaceLabels, authorizer: Authorizer) -> Self {
        Self {
            engine,
            namespaces,
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

    async fn acquire_one(
        &self,
        request: pb::AcquireRequest,
        caller: Option<&Caller>,
    ) -> Result<pb::AcquireResponse, Status> {
        const RPC: &str = "Acquire";
        let mut call = CallMetrics::start(RPC, &self.namespaces);
        self.authorize(&mut call, caller, request.id.as_ref(), Access::Write)?;
        let result = async {
            let request = convert::acquire_request(request)?;
            call.namespace(request.id.namespace());
            self.engine.acquire(request).await
        }
        .await;
        match result {
            Ok(outcome) => {
                call.acquire_outcome(&outcome);
                Ok(convert::acquire_response(outcome))
            }
            Err(error) => {
                let status = Err(to_status(RPC, error));
                call.finish(&status);
                status
            }
        }
    }

    async fn complete_one(
        &self,
        request: pb::CompleteRequest,
        caller: Option<&Caller>,
    ) -> Result<pb::CompleteResponse, Status> {
        const RPC: &str = "Complete";
        let mut call = CallMetrics::start(RPC, &self.namespaces);
        self.authorize(&mut call, caller, request.id.as_ref(), Access::Write)?;
        let result = async {
            let id = convert::record_id(request.id)?;
            call.namespace(id.namespace());
            let token = convert::fencing_token(request.fencing_token)?;
            let response = convert::stored_response("response", request.response)?;
            self.engine.complete(id, token, response).await
        }
        .await
        .map(|completed_at| pb::CompleteResponse {
            completed_at: Some(convert::timestamp(completed_at)),
        })
        .map_err(|error| to_status(RPC, error));
        call.finish(&result);
        result
    }

    /// Checks a batch's size, runs its items, keeps the reply within the
    /// message size limit, and turns each error into the `google.rpc.Status`
    /// the unary call would have sent.
    async fn run_batch<Req, T, Fut>(
        &self,
        rpc: &'static str,
        requests: Vec<Req>,
        record: impl Fn(&Req) -> Option<&pb::RecordId>,
        run: impl Fn(Req) -> Fut,
    ) -> Result<Vec<Result<T, tonic_types::pb::Status>>, Status>
    where
        Fut: Future<Output = Result<T, Status>>,
        T: prost::Message,
    {
        self.check_batch(rpc, requests.len())?;
        record_batch_items(rpc, requests.len());
        let budget = ReplyBudget::new(self.engine.limits().max_message_bytes());
        let answers = in_rounds(requests, record, |item| {
            let answer = run(item);
            let budget = &budget;
            async move { budget.admit(answer.await) }
        })
        .await;
        Ok(answers
            .into_iter()
            .map(|answer| answer.map_err(|status| to_rpc_status(&status)))
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
        CallMetrics::start(rpc, &self.namespaces).finish(&refused);
        refused
    }
}

/// An attempt a BatchAcquire item acquired: what renews its lease.
struct Held {
    id: Option<pb::RecordId>,
    lease: Option<prost_types::Duration>,
    /// Before the item ran, so no later than its lease started.
    started: Instant,
}

impl GrpcService {
    /// A BatchAcquire answers when its last item does, and an item whose
    /// row another session holds runs alone and may wait up to the
    /// statement timeout; meanwhile the leases of the items acquired at once
    /// run down. An attempt past half its lease is renewed before the reply,
    /// as a unary Acquire whose statement was slow is (see the engine):
    /// answering with a lease that has passed would let a second caller
    /// take the key over, and both would run the business logic. If it can
    /// no longer be renewed (taken over), the item is answered UNAVAILABLE.
    async fn keep_lease_live(
        &self,
        response: &mut pb::AcquireResponse,
        held: &HashMap<u64, Held>,
    ) -> Result<(), tonic_types::pb::Status> {
        let Some(pb::acquire_response::Outcome::Acquired(acquired)) = &mut response.outcome else {
            return Ok(());
        };
        let Some(attempt) = held.get(&acquired.fencing_token) else {
            return Ok(());
        };
        // Both parsed when the item was acquired.
        let (Ok(id), Ok(lease)) = (
            convert::record_id(attempt.id.clone()),
            convert::lease(attempt.lease)
                .and_then(|lease| self.engine.limits().lease("lease", lease)),
        ) else {
            return Ok(());
        };
        if attempt.started.elapsed() < lease / 2 {
            return Ok(());
        }
        match self
            .engine
            .renew(&id, acquired.fencing_token, Some(lease))
            .await
        {
            Ok(times) => {
                acquired.lease_expires_at = Some(convert::timestamp(times.lease_expires_at));
                acquired.expires_at = Some(convert::timestamp(times.expires_at));
                Ok(())
            }
            Err(error) => {
                tracing::warn!(
                    key = %id.key(),
                    %error,
                    "a batched Acquire's lease passed while the batch's other items ran"
                );
                Err(to_rpc_status(&to_status(
                    "BatchAcquire",
                    crate::error::Error::Contention("batch acquire"),
                )))
            }
        }
    }
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
        let caller = caller_of(&request);
        self.acquire_one(request.into_inner(), caller.as_ref())
            .await
            .map(Response::new)
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let caller = caller_of(&request);
        self.complete_one(request.into_inner(), caller.as_ref())
            .await
            .map(Response::new)
    }

    async fn fail(
        &self,
        request: Request<pb::FailRequest>,
    ) -> Result<Response<pb::FailResponse>, Status> {
        const RPC: &str = "Fail";
        let mut call = CallMetrics::start(RPC, &self.namespaces);
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
            let failure = convert::failure(request.retryable, request.error_response);
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
        let mut call = CallMetrics::start(RPC, &self.namespaces);
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
            let lease = convert::lease(request.lease)?;
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
        let mut call = CallMetrics::start(RPC, &self.namespaces);
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
        let requests = request.into_inner().requests;
        // Each acquired item's attempt, by token, to renew the leases that
        // the batch's slower items kept waiting.
        let held: std::sync::Mutex<HashMap<u64, Held>> = Default::default();
        let answers = self
            .run_batch(
                "BatchAcquire",
                requests,
                |item| item.id.as_ref(),
                |item| {
                    let (id, lease) = (item.id.clone(), item.lease);
                    let started = Instant::now();
                    let held = &held;
                    let caller = caller.as_ref();
                    async move {
                        let answer = self.acquire_one(item, caller).await;
                        if let Ok(pb::AcquireResponse {
                            outcome: Some(pb::acquire_response::Outcome::Acquired(acquired)),
                        }) = &answer
                        {
                            let attempt = Held { id, lease, started };
                            let mut held = held.lock().expect("held attempts");
                            held.insert(acquired.fencing_token, attempt);
                        }
                        answer
                    }
                },
            )
            .await?;
        let held = held.into_inner().expect("held attempts");
        let answers = join_all(answers.into_iter().map(|answer| async {
            let mut response = answer?;
            self.keep_lease_live(&mut response, &held).await?;
            Ok(response)
        }))
        .await;
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
        let requests = request.into_inner().requests;
        let answers = self
            .run_batch(
                "BatchComplete",
                requests,
                |item| item.id.as_ref(),
                |item| self.complete_one(item, caller.as_ref()),
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

/// Room in a batch's reply kept for its items' errors (a few hundred bytes
/// each at most) and the reply's own framing.
const REPLY_HEADROOM: usize = 64 * 1024;
/// An answer's field tags and length prefixes in the reply.
const ANSWER_FRAMING: usize = 16;

/// Keeps a batch's reply within the message size limit, which is also what
/// gRPC clients accept by default. Replays carry stored responses of up to
/// a MiB each, so a small request (a hundred Acquires of one large record)
/// could otherwise ask for a reply of a hundred MiB, held in memory twice.
/// Answers are counted as they come (a round's items finish in any order);
/// one that does not fit is dropped at once, and its caller told to send it
/// alone. The first answer always fits: a unary reply holds it.
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

    fn admit<T: prost::Message>(&self, answer: Result<T, Status>) -> Result<T, Status> {
        let Ok(value) = answer else { return answer };
        let bytes = value.encoded_len() + ANSWER_FRAMING;
        let before = self.used.fetch_add(bytes, Ordering::Relaxed);
        if before == 0 || before + bytes <= self.max {
            Ok(value)
        } else {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
            Err(batch_reply_full(self.max))
        }
    }
}

/// Runs a batch's items concurrently, except that items for the same record
/// run one after the other, in the order given (the k-th item of a record
/// runs in round k), whether or not the store batches statements. Answers
/// come back in the items' order.
async fn in_rounds<T, R, Fut>(
    items: Vec<T>,
    record: impl Fn(&T) -> Option<&pb::RecordId>,
    run: impl Fn(T) -> Fut,
) -> Vec<R>
where
    Fut: Future<Output = R>,
{
    let mut seen: HashMap<(&str, &str, &str, &str), usize> = HashMap::new();
    let rounds: Vec<usize> = items
        .iter()
        .map(|item| {
            let Some(id) = record(item) else { return 0 };
            let key = (&*id.namespace, &*id.operation, &*id.subject, &*id.key);
            let round = seen.entry(key).or_insert(0);
            *round += 1;
            *round - 1
        })
        .collect();
    drop(seen);
    let last_round = rounds.iter().copied().max().unwrap_or(0);
    let mut items: Vec<Option<T>> = items.into_iter().map(Some).collect();
    let mut answers: Vec<Option<R>> = items.iter().map(|_| None).collect();
    for round in 0..=last_round {
        let positions: Vec<usize> = (0..items.len()).filter(|&i| rounds[i] == round).collect();
        // A round's items start in the same poll, so they queue for the
        // same statement.
        let round_answers = join_all(
            positions
                .iter()
                .map(|&i| run(items[i].take().expect("each item runs once"))),
        )
        .await;
        for (i, answer) in positions.into_iter().zip(round_answers) {
            answers[i] = Some(answer);
        }
    }
    answers
        .into_iter()
        .map(|answer| answer.expect("every item ran"))
        .collect()
}
