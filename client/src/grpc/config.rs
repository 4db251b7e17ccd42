use std::{sync::Arc, time::Duration};

use http::request::Parts;
use prost_reflect::{DescriptorError, DescriptorPool};
use tonic::Code;

use super::message::Methods;
use crate::OnUnavailable;

type SubjectFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type StoreFn = dyn Fn(Code) -> bool + Send + Sync;

/// How [`super::GrpcIdempotencyLayer`] applies the contract.
#[derive(Clone)]
pub struct GrpcConfig {
    pub(crate) namespace: String,
    pub(crate) methods: Methods,
    pub(crate) require_key: bool,
    pub(crate) subject: Arc<SubjectFn>,
    pub(crate) excluded_pointers: Vec<String>,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_stored_bytes: usize,
    pub(crate) store: Arc<StoreFn>,
    pub(crate) on_unavailable: OnUnavailable,
    pub(crate) ttl: Option<Duration>,
    pub(crate) lease: Duration,
    pub(crate) renew_every: Option<Duration>,
}

impl std::fmt::Debug for GrpcConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcConfig")
            .field("namespace", &self.namespace)
            .field("unary_methods", &self.methods.len())
            .field("require_key", &self.require_key)
            .field("excluded_pointers", &self.excluded_pointers)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("max_stored_bytes", &self.max_stored_bytes)
            .field("on_unavailable", &self.on_unavailable)
            .field("ttl", &self.ttl)
            .field("lease", &self.lease)
            .field("renew_every", &self.renew_every)
            .finish_non_exhaustive()
    }
}

/// The default storage rule (see [`GrpcConfig::store_when`]).
fn store_by_default(code: Code) -> bool {
    !matches!(
        code,
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::Internal
            | Code::Unknown
    )
}

impl GrpcConfig {
    /// Defaults for a service named `namespace` (the calling service's
    /// namespace at the idempotency service), covering the unary methods of
    /// the services in `file_descriptor_set` (an encoded
    /// `google.protobuf.FileDescriptorSet`, e.g. the one `tonic-prost-build`'s
    /// `file_descriptor_set_path` writes, which tonic-reflection serves too):
    /// key optional, no subject, 4 MiB requests (tonic's decoding limit),
    /// 1 MiB stored responses, codes stored as [`GrpcConfig::stores_by_default`]
    /// says, fail closed, 60 s lease renewed every 20 s while the handler runs.
    ///
    /// # Panics
    ///
    /// When `file_descriptor_set` is not a valid descriptor set: a
    /// configuration mistake, caught at start-up. [`GrpcConfig::try_new`]
    /// returns the error instead.
    pub fn new(namespace: impl Into<String>, file_descriptor_set: impl AsRef<[u8]>) -> Self {
        Self::try_new(namespace, file_descriptor_set)
            .unwrap_or_else(|error| panic!("not a valid file descriptor set: {error}"))
    }

    /// [`GrpcConfig::new`], with an invalid descriptor set as an error.
    pub fn try_new(
        namespace: impl Into<String>,
        file_descriptor_set: impl AsRef<[u8]>,
    ) -> Result<Self, DescriptorError> {
        let pool = DescriptorPool::decode(file_descriptor_set.as_ref())?;
        Ok(Self {
            namespace: namespace.into(),
            methods: Methods::unary_of(&pool),
            require_key: false,
            subject: Arc::new(|_| None),
            excluded_pointers: Vec::new(),
            max_request_bytes: 4 * 1024 * 1024,
            max_stored_bytes: 1024 * 1024,
            store: Arc::new(store_by_default),
            on_unavailable: OnUnavailable::FailClosed,
            ttl: None,
            lease: Duration::from_secs(60),
            renew_every: Some(Duration::from_secs(20)),
        })
    }

    /// Answer `INVALID_ARGUMENT` to a covered call without `idempotency-key`
    /// metadata (otherwise it passes through unprotected).
    pub fn require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }

    /// On whose behalf a call is made, e.g. the authenticated user id from
    /// metadata, or the peer's identity from an extension your auth layer
    /// (or tonic's `TlsConnectInfo`) set. `None`: no subject.
    pub fn subject(
        mut self,
        subject: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.subject = Arc::new(subject);
        self
    }

    /// Leave a volatile field out of the fingerprint, by JSON Pointer into
    /// the message's proto3 JSON form, with its JSON (lowerCamelCase) names:
    /// e.g. `/metadata/traceId`.
    ///
    /// # Panics
    ///
    /// When `pointer` is not a JSON Pointer (it must be empty or start with `/`).
    pub fn exclude_json_pointer(mut self, pointer: impl Into<String>) -> Self {
        let pointer = pointer.into();
        assert!(
            crate::fingerprint::is_pointer(&pointer),
            "{pointer:?} is not a JSON Pointer: it must start with '/'"
        );
        self.excluded_pointers.push(pointer);
        self
    }

    /// Largest request body read, its 5-byte frame header included (default
    /// 4 MiB, tonic's own limit); larger is `RESOURCE_EXHAUSTED`, the
    /// handler not run.
    pub fn max_request_bytes(mut self, bytes: usize) -> Self {
        self.max_request_bytes = bytes;
        self
    }

    /// Largest response stored (default 1 MiB, the service's default limit).
    /// A larger one is answered, but the key then stores a terminal
    /// `INTERNAL` (`RESPONSE_NOT_REPLAYABLE`) when its code is stored: the
    /// handler ran once and must not run again, and its answer cannot be replayed.
    pub fn max_stored_bytes(mut self, bytes: usize) -> Self {
        self.max_stored_bytes = bytes;
        self
    }

    /// Which gRPC codes are stored for replay; the others release the key
    /// so the client may retry with it and the handler runs again.
    ///
    /// Default ([`GrpcConfig::stores_by_default`]): `UNAVAILABLE`,
    /// `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL` and
    /// `UNKNOWN` release the key; `OK` and every other code are stored. The
    /// released ones are those gRPC clients and meshes retry: "not now"
    /// (overload, a deadline, a rate limit, a conflict) or a failure of the
    /// server, after which running the handler again is what the caller
    /// wants. The stored ones are the call's answer (`INVALID_ARGUMENT`,
    /// `NOT_FOUND`, `FAILED_PRECONDITION`, ...), so a retry gets it again
    /// and does not repeat the effects.
    ///
    /// ```
    /// # use idempotency_client::grpc::GrpcConfig;
    /// # let descriptors = prost_types::FileDescriptorSet::default();
    /// # let descriptors = prost::Message::encode_to_vec(&descriptors);
    /// use tonic::Code;
    ///
    /// // Store a RESOURCE_EXHAUSTED your handler answers for a final "quota used up".
    /// let config = GrpcConfig::new("payments", descriptors).store_when(|code| {
    ///     code == Code::ResourceExhausted || GrpcConfig::stores_by_default(code)
    /// });
    /// ```
    pub fn store_when(mut self, store: impl Fn(Code) -> bool + Send + Sync + 'static) -> Self {
        self.store = Arc::new(store);
        self
    }

    /// The default rule of [`GrpcConfig::store_when`], to build on: whether
    /// a response ending with `code` is stored for replay.
    pub fn stores_by_default(code: Code) -> bool {
        store_by_default(code)
    }

    /// Fail closed (`UNAVAILABLE`, default) or open (run unprotected) when
    /// the idempotency service is unreachable.
    pub fn on_unavailable(mut self, policy: OnUnavailable) -> Self {
        self.on_unavailable = policy;
        self
    }

    /// How long keys are remembered (default: the service's, 24 h).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// The lease of a running handler, and how often it is renewed while the
    /// handler runs (`None`: never; the handler must finish within `lease`).
    pub fn lease(mut self, lease: Duration, renew_every: Option<Duration>) -> Self {
        self.lease = lease;
        self.renew_every = renew_every;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_default_answers_are_stored_and_retryable_codes_release_the_key() {
        let released = [
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
            Code::Aborted,
            Code::Internal,
            Code::Unknown,
        ];
        for number in 0..=16 {
            let code = Code::from_i32(number);
            assert_eq!(
                GrpcConfig::stores_by_default(code),
                !released.contains(&code),
                "{code:?}"
            );
        }
        let config = GrpcConfig::new("payments", []).store_when(|code| code == Code::Ok);
        assert!((config.store)(Code::Ok));
        assert!(
            !(config.store)(Code::InvalidArgument),
            "a rule of one's own"
        );
    }

    #[test]
    fn an_invalid_descriptor_set_is_refused_when_configured() {
        assert!(GrpcConfig::try_new("payments", b"\xff\xff").is_err());
        assert!(std::panic::catch_unwind(|| GrpcConfig::new("payments", b"\xff\xff")).is_err());
    }
}
