use std::sync::Arc;

use tower::Layer;

use super::{GrpcConfig, service::GrpcIdempotency};
use crate::Client;

/// Applies the `idempotency-key` contract to the tonic services it wraps.
#[derive(Debug, Clone)]
pub struct GrpcIdempotencyLayer {
    client: Client,
    config: Arc<GrpcConfig>,
}

impl GrpcIdempotencyLayer {
    /// A layer that keeps its keys at the service behind `client`.
    pub fn new(client: Client, config: GrpcConfig) -> Self {
        Self {
            client,
            config: Arc::new(config),
        }
    }
}

impl<S> Layer<S> for GrpcIdempotencyLayer {
    type Service = GrpcIdempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcIdempotency::new(inner, self.client.clone(), self.config.clone())
    }
}
