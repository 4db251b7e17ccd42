//! Who may do what: TLS on the gRPC port ([`tls`]), the caller's identity
//! ([`credentials`]), the namespace policy ([`policy`]), and the files behind
//! them, re-read when they change ([`watch`]). `grpc::auth` applies them to
//! calls. docs/security.md is the operator's view.

pub mod credentials;
pub mod policy;
pub mod tls;
pub mod watch;

use std::{path::PathBuf, sync::Arc, time::Duration};

use credentials::{Credentials, JwtSettings, JwtVerifier, StaticTokens, parse_static_tokens};
use policy::Policy;
use tls::{TlsFiles, TlsState};
use watch::{FileError, Watched};

use crate::telemetry::MetricsRecorder;

/// The security settings of `serve`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecurityConfig {
    pub tls: Option<TlsFiles>,
    pub jwt: Option<JwtSettings>,
    pub static_tokens: Option<PathBuf>,
    pub policy: Option<PathBuf>,
    /// How often the files are checked for changes.
    pub reload_interval: Duration,
    /// Longest a client connection lives (its identity is proven again on
    /// the next one).
    pub max_connection_age: Duration,
}

impl Default for SecurityConfig {
    /// No TLS, no auth: the README's `make run`.
    fn default() -> Self {
        Self {
            tls: None,
            jwt: None,
            static_tokens: None,
            policy: None,
            reload_interval: Duration::from_secs(10),
            max_connection_age: Duration::from_secs(3600),
        }
    }
}

/// How exposed the service is, for the log and `idempotency_auth_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No TLS, no auth: whoever reaches the port may do anything.
    None,
    /// TLS, but every caller may do anything.
    Tls,
    /// Callers authenticated, namespaces enforced.
    Auth,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Tls => "tls",
            Mode::Auth => "auth",
        }
    }
}

impl SecurityConfig {
    /// mTLS, JWTs or static tokens: any of them turns authentication on.
    pub fn authenticates(&self) -> bool {
        self.tls.as_ref().is_some_and(|tls| tls.client_ca.is_some())
            || self.jwt.is_some()
            || self.static_tokens.is_some()
    }

    pub fn mode(&self) -> Mode {
        match (self.authenticates(), self.tls.is_some()) {
            (true, _) => Mode::Auth,
            (false, true) => Mode::Tls,
            (false, false) => Mode::None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error(
        "a credential (--tls-client-ca, --jwt-jwks or --static-tokens) needs --auth-policy: \
         without one every call would be refused"
    )]
    NoPolicy,
    #[error(
        "--auth-policy needs a way to authenticate callers (--tls-client-ca, --jwt-jwks or \
         --static-tokens)"
    )]
    PolicyWithoutCredentials,
}

/// Authentication and the policy, when auth is on.
#[derive(Debug)]
pub struct Auth {
    pub credentials: Credentials,
    pub policy: Watched<Policy>,
}

fn parse_policy(contents: &[Vec<u8>], paths: &[PathBuf]) -> Result<Policy, FileError> {
    watch::parse_text(contents, paths, Policy::parse)
}

/// The loaded security files.
#[derive(Debug, Clone)]
pub struct Security {
    pub mode: Mode,
    pub tls: Option<Arc<Watched<TlsState>>>,
    pub auth: Option<Arc<Auth>>,
}

impl Security {
    /// Reads every file; a missing or broken one is an error naming it.
    /// Built after the metrics recorder is installed (hence the proof): it
    /// sets the mode's and the certificate's gauges here, once.
    pub fn load(
        config: &SecurityConfig,
        _installed: &MetricsRecorder,
    ) -> Result<Self, SecurityError> {
        match (config.authenticates(), config.policy.is_some()) {
            (true, false) => return Err(SecurityError::NoPolicy),
            (false, true) => return Err(SecurityError::PolicyWithoutCredentials),
            _ => {}
        }
        let tls = match &config.tls {
            Some(files) => {
                let watched = Watched::load("tls", files.paths(), tls::parse)?;
                publish_expiry(&watched.current());
                Some(Arc::new(watched))
            }
            None => None,
        };
        let auth = match &config.policy {
            Some(policy) => {
                let credentials = Credentials {
                    jwt: config.jwt.as_ref().map(JwtVerifier::load).transpose()?,
                    static_tokens: config
                        .static_tokens
                        .as_ref()
                        .map(|path| {
                            Watched::<StaticTokens>::load(
                                "static_tokens",
                                vec![path.clone()],
                                parse_static_tokens,
                            )
                        })
                        .transpose()?,
                };
                let policy = Watched::load("policy", vec![policy.clone()], parse_policy)?;
                if policy.current().is_empty() {
                    tracing::warn!("the auth policy grants nothing: every call will be refused");
                }
                Some(Arc::new(Auth {
                    credentials,
                    policy,
                }))
            }
            None => None,
        };
        let mode = config.mode();
        for known in ["none", "tls", "auth"] {
            let value = if known == mode.as_str() { 1.0 } else { 0.0 };
            metrics::gauge!(crate::metrics::AUTH_MODE, "mode" => known).set(value);
        }
        Ok(Self { mode, tls, auth })
    }

    /// Checks the files every `interval`, swapping in what changed, until dropped.
    pub async fn watch(self, interval: Duration) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            // Reading files blocks: keep it off the threads serving calls.
            let security = self.clone();
            let _ = tokio::task::spawn_blocking(move || security.refresh()).await;
        }
    }

    fn refresh(&self) {
        if let Some(tls) = &self.tls
            && tls.refresh()
        {
            publish_expiry(&tls.current());
        }
        if let Some(auth) = &self.auth {
            auth.policy.refresh();
            if let Some(jwt) = &auth.credentials.jwt {
                jwt.watched().refresh();
            }
            if let Some(tokens) = &auth.credentials.static_tokens {
                tokens.refresh();
            }
        }
    }
}

fn publish_expiry(state: &TlsState) {
    metrics::gauge!(crate::metrics::TLS_CERTIFICATE_EXPIRY_SECONDS).set(state.not_after as f64);
}
