use std::{sync::Arc, time::Duration};

use http::{HeaderName, HeaderValue, Method, StatusCode, header, request::Parts};

use super::problem::Problems;

use crate::OnUnavailable;

type SubjectFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type StoreFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// How [`super::IdempotencyLayer`] applies the contract.
#[derive(Clone)]
pub struct HttpConfig {
    pub(crate) namespace: String,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) subject: Arc<SubjectFn>,
    pub(crate) excluded_pointers: Vec<String>,
    pub(crate) max_body_bytes: usize,
    pub(crate) max_stored_bytes: usize,
    pub(crate) store: Arc<StoreFn>,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) on_unavailable: OnUnavailable,
    pub(crate) ttl: Option<Duration>,
    pub(crate) lease: Duration,
    pub(crate) renew_every: Option<Duration>,
    pub(crate) problems: Problems,
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("namespace", &self.namespace)
            .field("methods", &self.methods)
            .field("require_key", &self.require_key)
            .field("excluded_pointers", &self.excluded_pointers)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_stored_bytes", &self.max_stored_bytes)
            .field("replay_headers", &self.replay_headers)
            .field("on_unavailable", &self.on_unavailable)
            .field("ttl", &self.ttl)
            .field("lease", &self.lease)
            .field("renew_every", &self.renew_every)
            .field("problems", &self.problems)
            .finish_non_exhaustive()
    }
}

/// The default storage rule (see [`HttpConfig::store_when`]): 2xx and 4xx
/// are answers worth replaying, except the 4xx that say "not now, try
/// again" rather than "no": `408 Request Timeout`, `409 Conflict`,
/// `425 Too Early` and `429 Too Many Requests`. Those, and a 5xx, release
/// the key. Stored, a rate-limited request could never succeed under its key
/// until the key expires (24 h by default); Stripe likewise saves no result
/// for a request that did not start executing or was refused before it ran.
fn store_by_default(status: StatusCode) -> bool {
    let try_again = matches!(
        status,
        StatusCode::REQUEST_TIMEOUT
            | StatusCode::CONFLICT
            | StatusCode::TOO_EARLY
            | StatusCode::TOO_MANY_REQUESTS
    );
    status.is_success() || (status.is_client_error() && !try_again)
}

impl HttpConfig {
    /// Defaults for a service named `namespace` (the calling service's
    /// namespace at the idempotency service): POST and PATCH, key optional,
    /// no subject, 1 MiB bodies, 2xx and 4xx stored but 408, 409, 425 and
    /// 429 (see [`HttpConfig::store_when`]), fail closed, 60 s lease
    /// renewed every 20 s while the handler runs.
    pub fn new(namespace: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            methods: vec![Method::POST, Method::PATCH],
            require_key: false,
            subject: Arc::new(|_| None),
            excluded_pointers: Vec::new(),
            max_body_bytes: 1024 * 1024,
            max_stored_bytes: 1024 * 1024,
            store: Arc::new(store_by_default),
            replay_headers: vec![
                header::CONTENT_TYPE,
                header::CONTENT_ENCODING,
                header::CONTENT_LANGUAGE,
                header::LOCATION,
                header::ETAG,
                header::LAST_MODIFIED,
                header::CACHE_CONTROL,
            ],
            on_unavailable: OnUnavailable::FailClosed,
            ttl: None,
            lease: Duration::from_secs(60),
            renew_every: Some(Duration::from_secs(20)),
            problems: Problems::default(),
        }
    }

    /// The methods the contract applies to; others pass through.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Answer `400` to a covered request without `Idempotency-Key`
    /// (otherwise it passes through unprotected).
    pub fn require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }

    /// On whose behalf a request is made, e.g. the authenticated user id
    /// from a header or an extension your auth layer set. `None`: no subject.
    pub fn subject(
        mut self,
        subject: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.subject = Arc::new(subject);
        self
    }

    /// Leave a volatile JSON field out of the fingerprint, by JSON Pointer (e.g. `/meta/trace_id`).
    ///
    /// # Panics
    ///
    /// When `pointer` is not a JSON Pointer (it must be empty or start with
    /// `/`): a configuration mistake, caught at start-up rather than by
    /// every request quietly fingerprinting its raw bytes.
    pub fn exclude_json_pointer(mut self, pointer: impl Into<String>) -> Self {
        let pointer = pointer.into();
        assert!(
            crate::fingerprint::is_pointer(&pointer),
            "{pointer:?} is not a JSON Pointer: it must start with '/'"
        );
        self.excluded_pointers.push(pointer);
        self
    }

    /// Largest request body read (default 1 MiB); larger is `413`.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// Largest response stored (default 1 MiB, the service's default limit).
    /// A larger one is answered, but the key then stores a terminal 500
    /// (`response-not-replayable`): the handler ran once and must not run
    /// again, and its answer cannot be replayed.
    pub fn max_stored_bytes(mut self, bytes: usize) -> Self {
        self.max_stored_bytes = bytes;
        self
    }

    /// Which statuses are stored for replay; the others release the key so
    /// the client may retry with it and the handler runs again.
    ///
    /// Default ([`HttpConfig::stores_by_default`]): 2xx, and 4xx except
    /// `408`, `409`, `425` and `429`; those and 5xx release the key. A 2xx or
    /// an ordinary 4xx (`400`, `402`, `404`, `422`, ...) is the request's
    /// answer, so a retry must get it again and not repeat the effects. But
    /// `408 Request Timeout`, `409 Conflict`, `425 Too Early` and
    /// `429 Too Many Requests` say "not now": the request did not run or was
    /// refused before it ran, so storing one would answer every retry under
    /// the key with it until the key expires (24 h by default), and a
    /// rate-limited request could never succeed. Stripe saves no result for
    /// such requests either.
    ///
    /// A rule of your own replaces the default, e.g. to store a `409` your
    /// handler answers for a final business conflict:
    ///
    /// ```
    /// # use idempotency_client::http::HttpConfig;
    /// use http::StatusCode;
    ///
    /// let config = HttpConfig::new("payments").store_when(|status| {
    ///     status == StatusCode::CONFLICT || HttpConfig::stores_by_default(status)
    /// });
    /// ```
    pub fn store_when(
        mut self,
        store: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.store = Arc::new(store);
        self
    }

    /// The default rule of [`HttpConfig::store_when`], to build on: whether
    /// a response with `status` is stored for replay.
    pub fn stores_by_default(status: StatusCode) -> bool {
        store_by_default(status)
    }

    /// The response headers stored and replayed (default: content-type,
    /// content-encoding, content-language, location, etag, last-modified,
    /// cache-control). Values are stored as UTF-8; others are left out.
    /// The body is stored as the handler sent it: a compression layer inside
    /// this one stores compressed bodies (replayed with their
    /// content-encoding, whatever the retry accepts), so put it outside.
    pub fn replay_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.replay_headers = headers.into_iter().collect();
        self
    }

    /// Fail closed (`503`, default) or open (run unprotected) when the service is unreachable.
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

    /// The start of the `type` URI of the layer's own problem responses
    /// (`application/problem+json`); each problem's name is appended, e.g.
    /// `https://docs.example.com/problems/` gives
    /// `https://docs.example.com/problems/request-in-progress`. Default
    /// `urn:idempotency:problem:`: a URN, stable, and no claim on a web
    /// address nobody serves. Responses your handler makes are not touched.
    pub fn problem_type_base(mut self, base: impl Into<String>) -> Self {
        self.problems.type_base = base.into();
        self
    }

    /// Adds `Link: <url>; rel="describedby"` to the layer's own problem
    /// responses, pointing clients at your documentation of them (default: none).
    ///
    /// # Panics
    ///
    /// When `url` cannot be a header value (e.g. it holds a line break): a
    /// configuration mistake, caught at start-up.
    pub fn problem_docs(mut self, url: impl AsRef<str>) -> Self {
        let link = format!("<{}>; rel=\"describedby\"", url.as_ref());
        let link = HeaderValue::try_from(link)
            .unwrap_or_else(|_| panic!("{:?} cannot be a Link header", url.as_ref()));
        self.problems.described_by = Some(link);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_default_answers_are_stored_and_try_again_statuses_release_the_key() {
        let stored = [200, 201, 204, 400, 401, 402, 403, 404, 410, 413, 422, 451];
        let released = [408, 409, 425, 429, 500, 502, 503, 504];
        for code in stored {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(HttpConfig::stores_by_default(status), "{code} is stored");
        }
        for code in released {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(
                !HttpConfig::stores_by_default(status),
                "{code} releases the key"
            );
        }
        let config = HttpConfig::new("payments");
        assert!(
            !(config.store)(StatusCode::TOO_MANY_REQUESTS),
            "the default rule"
        );
    }

    #[test]
    fn json_pointers_are_checked_when_configured() {
        let config = HttpConfig::new("payments")
            .exclude_json_pointer("/meta/trace_id")
            .exclude_json_pointer("");
        assert_eq!(config.excluded_pointers, ["/meta/trace_id", ""]);
        let refused = std::panic::catch_unwind(|| {
            HttpConfig::new("payments").exclude_json_pointer("meta/trace_id")
        });
        assert!(
            refused.is_err(),
            "a pointer without a leading '/' is refused"
        );
    }

    #[test]
    fn a_documentation_link_that_cannot_be_a_header_is_refused_when_configured() {
        let config = HttpConfig::new("payments").problem_docs("https://docs.example.com/x");
        assert_eq!(
            config.problems.described_by.unwrap(),
            r#"<https://docs.example.com/x>; rel="describedby""#
        );
        let refused = std::panic::catch_unwind(|| {
            HttpConfig::new("payments").problem_docs("https://docs.example.com/\n")
        });
        assert!(refused.is_err());
    }
}
