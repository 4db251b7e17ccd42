//! `--raw-stream`: a caller's batches as messages of one long-lived
//! bidirectional stream instead of one unary RPC each. The floor
//! (`--serve-floor`) serves it beside the service's API, and so does the
//! server with the measurement prototype `bench/prototypes/server-steps.patch`
//! applied (`make bench-stream`); the service itself does not. It measures
//! what a streaming RPC would save a batching service and its callers: an
//! HTTP/2 stream opened and closed, headers and trailers encoded and
//! decoded, and a task per RPC on each side, where a message on an open
//! stream is a DATA frame (docs/performance.md, "A stream of batches").
//!
//! No `.proto`: the two messages wrap the service's own batch messages, and
//! the method is served and called through tonic's generic codec paths, so
//! the contract in `proto/` gains nothing. Each message is answered in
//! order, one at a time, by the unary batch RPC's handler. Unlike a unary
//! call, an error for a message as a whole (the handler's `Err`, e.g. the
//! database unreachable) ends the stream: the caller opens another.

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use futures_util::{StreamExt, future::BoxFuture, stream::BoxStream};
use idempotency_proto::pb::{self, idempotency_service_server::IdempotencyService};
use tonic::{
    Request, Response, Status, Streaming,
    body::Body,
    codegen::{Service, http},
    server::NamedService,
    transport::Channel,
};
use tonic_prost::ProstCodec;

/// The method's path: a service of the bench's own, not the contract's.
const PATH: &str = "/idempotency.bench.v1.FloorSteps/Steps";

/// One batch of one kind.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Step {
    #[prost(oneof = "step::Batch", tags = "1, 2")]
    pub batch: Option<step::Batch>,
}

pub mod step {
    use super::pb;

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Batch {
        #[prost(message, tag = "1")]
        Acquire(pb::BatchAcquireRequest),
        #[prost(message, tag = "2")]
        Complete(pb::BatchCompleteRequest),
    }
}

/// A step's answer: what the unary batch RPC would have answered.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StepReply {
    #[prost(oneof = "step_reply::Batch", tags = "1, 2")]
    pub batch: Option<step_reply::Batch>,
}

pub mod step_reply {
    use super::pb;

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Batch {
        #[prost(message, tag = "1")]
        Acquire(pb::BatchAcquireResponse),
        #[prost(message, tag = "2")]
        Complete(pb::BatchCompleteResponse),
    }
}

/// The server side: each message answered in order by `floor`'s own batch
/// RPCs, in the stream's task (no task of its own, as hyper gives each
/// unary RPC).
pub struct Steps<F> {
    floor: Arc<F>,
}

impl<F> Steps<F> {
    pub fn new(floor: Arc<F>) -> Self {
        Self { floor }
    }
}

impl<F> Clone for Steps<F> {
    fn clone(&self) -> Self {
        Self {
            floor: self.floor.clone(),
        }
    }
}

impl<F> NamedService for Steps<F> {
    const NAME: &'static str = "idempotency.bench.v1.FloorSteps";
}

impl<F> Service<http::Request<Body>> for Steps<F>
where
    F: IdempotencyService,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let floor = self.floor.clone();
        Box::pin(async move {
            if request.uri().path() != PATH {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<StepReply, Step>::default());
            Ok(grpc.streaming(Answer { floor }, request).await)
        })
    }
}

struct Answer<F> {
    floor: Arc<F>,
}

impl<F: IdempotencyService> tonic::server::StreamingService<Step> for Answer<F> {
    type Response = StepReply;
    type ResponseStream = BoxStream<'static, Result<StepReply, Status>>;
    type Future = BoxFuture<'static, Result<Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: Request<Streaming<Step>>) -> Self::Future {
        let floor = self.floor.clone();
        let steps = request.into_inner();
        let replies = futures_util::stream::unfold((floor, steps), |(floor, mut steps)| async {
            let step = match steps.message().await {
                Ok(Some(step)) => step,
                Ok(None) => return None,
                Err(status) => return Some((Err(status), (floor, steps))),
            };
            let reply = answer(&*floor, step).await;
            Some((reply, (floor, steps)))
        });
        Box::pin(async move { Ok(Response::new(replies.boxed())) })
    }
}

async fn answer<F: IdempotencyService>(floor: &F, step: Step) -> Result<StepReply, Status> {
    use step_reply::Batch as Reply;
    let batch = match step.batch {
        Some(step::Batch::Acquire(batch)) => {
            Reply::Acquire(floor.batch_acquire(Request::new(batch)).await?.into_inner())
        }
        Some(step::Batch::Complete(batch)) => Reply::Complete(
            floor
                .batch_complete(Request::new(batch))
                .await?
                .into_inner(),
        ),
        None => return Err(Status::invalid_argument("batch: required")),
    };
    Ok(StepReply { batch: Some(batch) })
}

/// The caller's side: one stream, one step in flight at a time.
pub struct StepStream {
    sender: tokio::sync::mpsc::Sender<Step>,
    replies: Streaming<StepReply>,
    timeout: Duration,
}

impl StepStream {
    /// Opens the stream on `channel`, waiting `timeout` at most for the
    /// server's headers; each step then waits `timeout` at most.
    pub async fn open(channel: Channel, timeout: Duration) -> Result<Self, Status> {
        tokio::time::timeout(timeout, Self::opened(channel, timeout))
            .await
            .map_err(|_| Status::deadline_exceeded("the stream did not open in time"))?
    }

    async fn opened(channel: Channel, timeout: Duration) -> Result<Self, Status> {
        let (sender, mut outbound) = tokio::sync::mpsc::channel::<Step>(1);
        let steps = futures_util::stream::poll_fn(move |cx| outbound.poll_recv(cx));
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready()
            .await
            .map_err(|error| Status::unavailable(error.to_string()))?;
        let replies = grpc
            .streaming(
                Request::new(steps),
                http::uri::PathAndQuery::from_static(PATH),
                ProstCodec::<Step, StepReply>::default(),
            )
            .await?
            .into_inner();
        Ok(Self {
            sender,
            replies,
            timeout,
        })
    }

    /// A BatchAcquire's answer, sent as a step.
    pub async fn acquire(
        &mut self,
        batch: pb::BatchAcquireRequest,
    ) -> Result<pb::BatchAcquireResponse, Status> {
        match self.step(step::Batch::Acquire(batch)).await? {
            step_reply::Batch::Acquire(reply) => Ok(reply),
            step_reply::Batch::Complete(_) => Err(Status::internal("a Complete's answer")),
        }
    }

    /// A BatchComplete's answer, sent as a step.
    pub async fn complete(
        &mut self,
        batch: pb::BatchCompleteRequest,
    ) -> Result<pb::BatchCompleteResponse, Status> {
        match self.step(step::Batch::Complete(batch)).await? {
            step_reply::Batch::Complete(reply) => Ok(reply),
            step_reply::Batch::Acquire(_) => Err(Status::internal("an Acquire's answer")),
        }
    }

    /// One message and its answer. After an error the stream is not to be
    /// used again (a late answer would be taken for the next message's).
    async fn step(&mut self, batch: step::Batch) -> Result<step_reply::Batch, Status> {
        let exchange = async {
            self.sender
                .send(Step { batch: Some(batch) })
                .await
                .map_err(|_| Status::unavailable("the stream closed"))?;
            self.replies
                .message()
                .await?
                .and_then(|reply| reply.batch)
                .ok_or_else(|| Status::unavailable("the stream ended"))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| Status::deadline_exceeded("the step's deadline passed"))?
    }
}
