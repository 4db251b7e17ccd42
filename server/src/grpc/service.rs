//! One method per RPC: convert the request, call the engine, convert back.

use tonic::{Request, Response, Status};

use super::{convert, metrics::CallMetrics, pb, status::to_status};
use crate::{engine::Engine, metrics::NamespaceLabels};

pub use pb::idempotency_service_server::IdempotencyServiceServer;

/// The `idempotency.v1.IdempotencyService` implementation.
#[derive(Debug, Clone)]
pub struct GrpcService {
    engine: Engine,
    namespaces: NamespaceLabels,
}

impl GrpcService {
    pub fn new(engine: Engine, namespaces: NamespaceLabels) -> Self {
        Self { engine, namespaces }
    }
}

#[tonic::async_trait]
impl pb::idempotency_service_server::IdempotencyService for GrpcService {
    async fn acquire(
        &self,
        request: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        const RPC: &str = "Acquire";
        let mut call = CallMetrics::start(RPC, &self.namespaces);
        let result = async {
            let request = convert::acquire_request(request.into_inner())?;
            call.namespace(request.id.namespace());
            self.engine.acquire(request).await
        }
        .await;
        match result {
            Ok(outcome) => {
                call.acquire_outcome(&outcome);
                Ok(Response::new(convert::acquire_response(outcome)))
            }
            Err(error) => {
                let status = Err(to_status(RPC, error));
                call.finish(&status);
                status
            }
        }
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        const RPC: &str = "Complete";
        let mut call = CallMetrics::start(RPC, &self.namespaces);
        let result = async {
            let request = request.into_inner();
            let id = convert::record_id(request.id)?;
            call.namespace(id.namespace());
            let token = convert::fencing_token(request.fencing_token)?;
            let response = convert::stored_response("response", request.response)?;
            self.engine.complete(&id, token, &response).await
        }
        .await
        .map(|completed_at| {
            Response::new(pb::CompleteResponse {
                completed_at: Some(convert::timestamp(completed_at)),
            })
        })
        .map_err(|error| to_status(RPC, error));
        call.finish(&result);
        result
    }

    async fn fail(
        &self,
        request: Request<pb::FailRequest>,
    ) -> Result<Response<pb::FailResponse>, Status> {
        const RPC: &str = "Fail";
        let mut call = CallMetrics::start(RPC, &self.namespaces);
        let result = async {
            let request = request.into_inner();
            let id = convert::record_id(request.id)?;
            call.namespace(id.namespace());
            let token = convert::fencing_token(request.fencing_token)?;
            let failure = convert::failure(request.retryable, request.error_response);
            self.engine.fail(&id, token, &failure).await
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
        let result = async {
            let request = request.into_inner();
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
        let result = async {
            let id = convert::record_id(request.into_inner().id)?;
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
}
