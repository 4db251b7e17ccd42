use tower::Layer;

use super::{HttpConfig, service::Idempotency};
use crate::Client;

/// Applies the `Idempotency-Key` contract to the services it wraps.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    client: Client,
    config: std::sync::Arc<HttpConfig>,
}

impl IdempotencyLayer {
    /// A layer that keeps its keys at the service behind `client`.
    pub fn new(client: Client, config: HttpConfig) -> Self {
        Self {
            client,
            config: std::sync::Arc::new(config),
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.client.clone(), self.config.clone())
    }
}
