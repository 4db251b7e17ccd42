//! The caller's bearer token, attached to every RPC the client sends.
//!
//! One interceptor ([`Credentials`]) sits in the stub type that every call
//! goes through (unary calls, the batch RPCs sent from the batcher's tasks,
//! lease renewals and releases), so no call can leave without the token.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tonic::{
    Request, Status,
    metadata::{AsciiMetadataValue, errors::InvalidMetadataValue},
    service::Interceptor,
};

/// How often [`TokenSource::file`] reads its file again.
pub const TOKEN_FILE_REFRESH: Duration = Duration::from_secs(5);

/// Where the bearer token sent as `authorization: Bearer <token>` comes from
/// (see [`ClientBuilder::bearer_token`](crate::ClientBuilder::bearer_token)).
/// Cheap to clone; clones share the token. Its `Debug` never shows the token.
///
/// A call for which no token can be had fails with
/// [`Error::Unauthenticated`](crate::Error::Unauthenticated), whose message
/// says why, without being sent: the client never sends a call without its
/// token.
#[derive(Clone)]
pub struct TokenSource {
    source: Arc<Source>,
}

enum Source {
    Fixed(Result<AsciiMetadataValue, String>),
    File(TokenFile),
    Function(Box<dyn Fn() -> String + Send + Sync>),
}

impl TokenSource {
    /// A token that never changes (a static token). Surrounding whitespace
    /// is trimmed; an empty token fails every call.
    pub fn fixed(token: impl Into<String>) -> Self {
        Self::new(Source::Fixed(header_value(&token.into())))
    }

    /// The token in a file, read again every [`TOKEN_FILE_REFRESH`] (5 s),
    /// e.g. a Kubernetes projected service-account token, which the kubelet
    /// replaces well before the old one expires (hourly by default).
    /// Surrounding whitespace (a trailing newline) is trimmed.
    ///
    /// The file is read at the first call, not when the client is built (a
    /// sidecar may write it after the process starts). While it has never
    /// been read, calls fail with [`Error::Unauthenticated`](crate::Error::Unauthenticated)
    /// naming the file and the cause, and each call tries to read it again.
    /// Once a token was read, a file that is then unreadable or empty (being
    /// rewritten in place, or removed) keeps the last token in use, with a
    /// warning at each failed read: the service rejects it once it expires.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        Self::file_refreshed_every(path, TOKEN_FILE_REFRESH)
    }

    /// [`TokenSource::file`], read again at most every `every` (zero: at
    /// every call).
    pub fn file_refreshed_every(path: impl Into<PathBuf>, every: Duration) -> Self {
        Self::new(Source::File(TokenFile {
            path: path.into(),
            every,
            state: Mutex::new(None),
        }))
    }

    /// A token from `token()`, called for every RPC (cache inside it if
    /// producing one is costly). Surrounding whitespace is trimmed; an empty
    /// token fails the call.
    pub fn from_fn(token: impl Fn() -> String + Send + Sync + 'static) -> Self {
        Self::new(Source::Function(Box::new(token)))
    }

    fn new(source: Source) -> Self {
        Self {
            source: Arc::new(source),
        }
    }

    /// The `authorization` metadata value for the next call, or the
    /// UNAUTHENTICATED status the call fails with.
    pub(crate) fn authorization(&self) -> Result<AsciiMetadataValue, Status> {
        let value = match &*self.source {
            Source::Fixed(value) => value.clone(),
            Source::File(file) => file.current(),
            Source::Function(token) => header_value(&token()),
        };
        value.map_err(|why| Status::unauthenticated(format!("no bearer token to send: {why}")))
    }
}

impl fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.source {
            Source::Fixed(_) => f.write_str("TokenSource::Fixed(..)"),
            Source::File(file) => f
                .debug_struct("TokenSource::File")
                .field("path", &file.path)
                .field("every", &file.every)
                .finish(),
            Source::Function(_) => f.write_str("TokenSource::Function(..)"),
        }
    }
}

/// Adds `TokenSource`'s token to a stub you build yourself from [`crate::pb`]:
/// `IdempotencyServiceClient::with_interceptor(channel, token_source)`.
impl Interceptor for TokenSource {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request
            .metadata_mut()
            .insert("authorization", self.authorization()?);
        Ok(request)
    }
}

/// A token file and what was last read from it.
struct TokenFile {
    path: PathBuf,
    every: Duration,
    /// The last token read, and when the file was last read.
    state: Mutex<Option<(AsciiMetadataValue, Instant)>>,
}

impl TokenFile {
    fn current(&self) -> Result<AsciiMetadataValue, String> {
        // Held while reading: concurrent calls wait for one read (a few
        // microseconds, every few seconds) instead of all reading.
        let mut state = self.state.lock().expect("token file lock");
        if let Some((value, read_at)) = &*state
            && read_at.elapsed() < self.every
        {
            return Ok(value.clone());
        }
        match read_token(&self.path) {
            Ok(value) => {
                *state = Some((value.clone(), Instant::now()));
                Ok(value)
            }
            Err(why) => match &mut *state {
                Some((last, read_at)) => {
                    tracing::warn!(path = %self.path.display(), error = %why,
                        "bearer token file unreadable: sending the last token read");
                    *read_at = Instant::now();
                    Ok(last.clone())
                }
                None => Err(why),
            },
        }
    }
}

fn read_token(path: &Path) -> Result<AsciiMetadataValue, String> {
    let token = std::fs::read_to_string(path)
        .map_err(|error| format!("reading the token file {}: {error}", path.display()))?;
    header_value(&token).map_err(|why| format!("the token file {}: {why}", path.display()))
}

/// `Bearer <token>`, marked sensitive so that HTTP/2 header compression
/// never indexes it. The reasons never quote the token.
fn header_value(token: &str) -> Result<AsciiMetadataValue, String> {
    let token = token.trim();
    if token.is_empty() {
        return Err("the bearer token is empty".into());
    }
    let mut value: AsciiMetadataValue =
        format!("Bearer {token}")
            .parse()
            .map_err(|_: InvalidMetadataValue| {
                "the bearer token has characters a header cannot carry".to_owned()
            })?;
    value.set_sensitive(true);
    Ok(value)
}

/// The interceptor in every stub of a [`Client`](crate::Client): adds the
/// bearer token when there is one.
#[derive(Debug, Clone, Default)]
pub(crate) struct Credentials {
    token: Option<TokenSource>,
}

impl Credentials {
    pub(crate) fn new(token: Option<TokenSource>) -> Self {
        Self { token }
    }

    /// The `authorization` value the next call carries, if any: a stream
    /// opened with another is not used for new messages.
    pub(crate) fn authorization(&self) -> Result<Option<AsciiMetadataValue>, Status> {
        self.token
            .as_ref()
            .map(TokenSource::authorization)
            .transpose()
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        match &mut self.token {
            Some(token) => token.call(request),
            None => Ok(request),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        AcquireRequest, Acquisition, Client, RecordId, StoredResponse,
        testing::{FakeService, TempDir},
    };

    fn sent(credentials: &mut Credentials) -> Result<Option<String>, Status> {
        let request = credentials.call(Request::new(()))?;
        Ok(request
            .metadata()
            .get("authorization")
            .map(|value| value.to_str().unwrap().to_owned()))
    }

    fn token_of(source: &TokenSource) -> String {
        source.authorization().unwrap().to_str().unwrap().to_owned()
    }

    #[test]
    fn every_call_carries_the_token_and_none_without_one() {
        let mut with = Credentials::new(Some(TokenSource::fixed(" static-token\n")));
        let mut without = Credentials::default();

        assert_eq!(
            sent(&mut with).unwrap().as_deref(),
            Some("Bearer static-token")
        );
        assert_eq!(sent(&mut without).unwrap(), None);
    }

    #[test]
    fn a_token_file_is_read_again_when_it_changes() {
        let dir = TempDir::new("token-rotates");
        let path = dir.replace("token", "first-token\n");
        let source = TokenSource::file_refreshed_every(&path, Duration::ZERO);
        let cached = TokenSource::file_refreshed_every(&path, Duration::from_secs(3600));
        assert_eq!(token_of(&source), "Bearer first-token");
        assert_eq!(token_of(&cached), "Bearer first-token");

        dir.replace("token", "second-token");

        assert_eq!(token_of(&source), "Bearer second-token");
        assert_eq!(
            token_of(&cached),
            "Bearer first-token",
            "read again only once `every` passed"
        );
    }

    #[test]
    fn an_unreadable_token_file_fails_the_call_until_a_token_was_read_then_keeps_it() {
        let dir = TempDir::new("token-missing");
        let path = dir.0.join("token");
        let mut credentials = Credentials::new(Some(TokenSource::file_refreshed_every(
            &path,
            Duration::ZERO,
        )));

        let missing = sent(&mut credentials).unwrap_err();
        std::fs::write(&path, "").unwrap();
        let empty = sent(&mut credentials).unwrap_err();
        std::fs::write(&path, "the-token").unwrap();
        let read = sent(&mut credentials).unwrap();
        std::fs::remove_file(&path).unwrap();
        let kept = sent(&mut credentials).unwrap();

        assert_eq!(missing.code(), tonic::Code::Unauthenticated);
        assert!(
            missing.message().contains(&path.display().to_string()),
            "{}",
            missing.message()
        );
        assert!(empty.message().contains("empty"), "{}", empty.message());
        assert_eq!(read.as_deref(), Some("Bearer the-token"));
        assert_eq!(kept.as_deref(), Some("Bearer the-token"));
    }

    #[test]
    fn a_closure_is_asked_at_every_call_and_a_bad_token_is_never_sent() {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        let source = TokenSource::from_fn(move || {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            format!("token-{n}")
        });
        assert_eq!(token_of(&source), "Bearer token-0");
        assert_eq!(token_of(&source), "Bearer token-1");

        for bad in [
            TokenSource::fixed("  "),
            TokenSource::fixed("line\nbreak"),
            TokenSource::from_fn(String::new),
        ] {
            let status = bad.authorization().unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
            assert!(!status.message().contains("line"), "{}", status.message());
        }
    }

    #[test]
    fn debug_never_shows_the_token() {
        let shown = format!("{:?}", TokenSource::fixed("s3cr3t"));
        assert!(!shown.contains("s3cr3t"), "{shown}");
    }

    #[tokio::test]
    async fn every_rpc_of_the_client_carries_the_token_unary_batched_and_from_leases() {
        let service = FakeService::plain().await;
        let client = Client::builder()
            .endpoint(format!("http://{}", service.addr))
            .bearer_token(TokenSource::fixed("the-token"))
            .connect_lazy()
            .unwrap();
        let request = |key: &str| {
            AcquireRequest::new(
                RecordId::new("shop", "POST /pay", format!("key-{key}")),
                b"f".to_vec(),
            )
        };

        // A lone Acquire goes as the unary RPC; a lease renews and completes.
        let Acquisition::Proceed(mut lease) = client.acquire(&request("alone")).await.unwrap()
        else {
            panic!("the fake service grants every Acquire");
        };
        lease.renew(Duration::from_secs(60)).await.unwrap();
        lease
            .complete(&StoredResponse::new(201, "done"))
            .await
            .unwrap();
        // Acquires made together travel as one BatchAcquire, sent from the
        // batcher's task; their leases, dropped, are released (Fail) from tasks.
        let mut together = tokio::task::JoinSet::new();
        for n in 0..8 {
            let (client, request) = (client.clone(), request(&format!("together-{n}")));
            together.spawn(async move { client.acquire(&request).await.map(drop) });
        }
        while let Some(result) = together.join_next().await {
            result.unwrap().unwrap();
        }
        assert_eq!(client.get(&request("get").id).await.unwrap(), None);
        service.wait_for("Fail").await;

        let seen = service.seen();
        for rpc in [
            "Acquire",
            "Renew",
            "Complete",
            "BatchAcquire",
            "Get",
            "Fail",
        ] {
            assert!(
                seen.iter().any(|call| call.rpc == rpc),
                "no {rpc} in {seen:?}"
            );
        }
        for call in &seen {
            assert_eq!(
                call.authorization.as_deref(),
                Some("Bearer the-token"),
                "{call:?}"
            );
        }
    }
}
