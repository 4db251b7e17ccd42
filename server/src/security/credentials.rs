//! Who is calling: a bearer token (a JWT verified against a JWKS file, or a
//! static token known by its SHA-256) or a verified client certificate.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use jsonwebtoken::{Algorithm, DecodingKey, Validation, errors::ErrorKind, jwk::JwkSet};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use toml::Spanned;

use super::{
    tls::PeerIdentity,
    watch::{FileError, Watched, line_of, parse_text, toml_error},
};

/// Why a call carries no usable credential. Each is `UNAUTHENTICATED`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// Neither a bearer token nor a client certificate.
    NoCredential,
    /// An `authorization` value that is not `Bearer <token>`.
    MalformedAuthorization,
    /// A token that is neither a known static token nor a JWT.
    UnknownToken,
    /// A JWT past its `exp`.
    TokenExpired,
    /// A JWT that fails verification, and why.
    InvalidToken(String),
    /// A client certificate that is not accepted, and why.
    Certificate(String),
}

impl Rejection {
    /// The `reason` label of `idempotency_auth_denied_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Rejection::NoCredential => "no_credential",
            Rejection::MalformedAuthorization => "malformed_authorization",
            Rejection::UnknownToken => "unknown_token",
            Rejection::TokenExpired => "token_expired",
            Rejection::InvalidToken(_) => "invalid_token",
            Rejection::Certificate(_) => "untrusted_certificate",
        }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::NoCredential => f.write_str(
                "no credential: send a client certificate or `authorization: Bearer <token>`",
            ),
            Rejection::MalformedAuthorization => {
                f.write_str("the authorization header is not `Bearer <token>`")
            }
            Rejection::UnknownToken => f.write_str("unknown bearer token"),
            Rejection::TokenExpired => f.write_str("the bearer token has expired"),
            Rejection::InvalidToken(why) => write!(f, "invalid bearer token: {why}"),
            Rejection::Certificate(why) => f.write_str(why),
        }
    }
}

/// Where JWTs are checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtSettings {
    pub jwks: PathBuf,
    pub issuer: String,
    pub audience: String,
}

/// Seconds a JWT's `exp` and `nbf` may be off, for clocks that drift.
const JWT_LEEWAY_SECONDS: u64 = 30;

/// Verified tokens remembered, so a caller's token is checked once per
/// version of the JWKS rather than at every call (an RSA verification
/// costs more than the rest of a call).
const VERIFIED_TOKENS_CACHED: usize = 4096;

/// The keys of one version of the JWKS file.
pub struct Jwks {
    by_kid: HashMap<String, (DecodingKey, Algorithm)>,
    /// Keys without a `kid`: usable by tokens without one when alone.
    unnamed: Vec<(DecodingKey, Algorithm)>,
    version: u64,
}

impl std::fmt::Debug for Jwks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jwks")
            .field("kids", &self.by_kid.keys().collect::<Vec<_>>())
            .field("unnamed", &self.unnamed.len())
            .finish()
    }
}

/// RS256 for RSA keys and ES256 for P-256 keys: what Kubernetes and most
/// identity providers sign with.
fn algorithm_of(jwk: &jsonwebtoken::jwk::Jwk) -> Result<Algorithm, String> {
    use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, KeyAlgorithm};
    let by_type = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(ec) if ec.curve == EllipticCurve::P256 => {
            Algorithm::ES256
        }
        _ => return Err("only RSA (RS256) and P-256 (ES256) keys are accepted".into()),
    };
    match jwk.common.key_algorithm {
        None => Ok(by_type),
        Some(KeyAlgorithm::RS256) if by_type == Algorithm::RS256 => Ok(by_type),
        Some(KeyAlgorithm::ES256) if by_type == Algorithm::ES256 => Ok(by_type),
        Some(other) => Err(format!("alg {other:?} is not accepted (RS256, ES256)")),
    }
}

/// Parses a JWKS file: every signing key must be usable.
pub fn parse_jwks(contents: &[Vec<u8>], paths: &[PathBuf]) -> Result<Jwks, FileError> {
    static VERSION: AtomicU64 = AtomicU64::new(0);
    let path = &paths[0];
    let set: JwkSet = serde_json::from_slice(&contents[0])
        .map_err(|error| FileError::new(path, format!("not a JWKS: {error}")))?;
    let mut jwks = Jwks {
        by_kid: HashMap::new(),
        unnamed: Vec::new(),
        version: VERSION.fetch_add(1, Ordering::Relaxed),
    };
    for jwk in &set.keys {
        if jwk.common.public_key_use == Some(jsonwebtoken::jwk::PublicKeyUse::Encryption) {
            continue;
        }
        let name = jwk.common.key_id.clone().unwrap_or_default();
        let algorithm = algorithm_of(jwk)
            .map_err(|why| FileError::new(path, format!("key {name:?}: {why}")))?;
        let key = DecodingKey::from_jwk(jwk)
            .map_err(|error| FileError::new(path, format!("key {name:?}: {error}")))?;
        match &jwk.common.key_id {
            Some(kid) => {
                if jwks.by_kid.insert(kid.clone(), (key, algorithm)).is_some() {
                    return Err(FileError::new(
                        path,
                        format!("key id {kid:?} appears twice"),
                    ));
                }
            }
            None => jwks.unnamed.push((key, algorithm)),
        }
    }
    if jwks.by_kid.is_empty() && jwks.unnamed.is_empty() {
        return Err(FileError::new(path, "holds no signing key"));
    }
    Ok(jwks)
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
    exp: u64,
}

/// Verifies JWTs against the JWKS in force.
#[derive(Debug)]
pub struct JwtVerifier {
    jwks: Watched<Jwks>,
    issuer: String,
    audience: String,
    /// token -> (principal, exp, JWKS version it was verified with)
    verified: quick_cache::sync::Cache<Arc<str>, (Arc<str>, u64, u64)>,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

impl JwtVerifier {
    pub fn load(settings: &JwtSettings) -> Result<Self, FileError> {
        Ok(Self {
            jwks: Watched::load("jwks", vec![settings.jwks.clone()], parse_jwks)?,
            issuer: settings.issuer.clone(),
            audience: settings.audience.clone(),
            verified: quick_cache::sync::Cache::new(VERIFIED_TOKENS_CACHED),
        })
    }

    pub fn watched(&self) -> &Watched<Jwks> {
        &self.jwks
    }

    /// The token's `sub`, once its signature, issuer, audience and times check out.
    pub fn verify(&self, token: &str) -> Result<Arc<str>, Rejection> {
        let jwks = self.jwks.current();
        if let Some((principal, exp, version)) = self.verified.get(token)
            && version == jwks.version
            && unix_now() < exp
        {
            return Ok(principal);
        }
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| Rejection::InvalidToken("not a JWT".into()))?;
        let (key, algorithm) = match &header.kid {
            Some(kid) => jwks
                .by_kid
                .get(kid)
                .ok_or_else(|| Rejection::InvalidToken(format!("unknown key id {kid:?}")))?,
            None if jwks.unnamed.len() + jwks.by_kid.len() == 1 => jwks
                .unnamed
                .first()
                .or_else(|| jwks.by_kid.values().next())
                .expect("one key"),
            None => return Err(Rejection::InvalidToken("no key id (kid)".into())),
        };
        if header.alg != *algorithm {
            return Err(Rejection::InvalidToken(format!(
                "signed with {:?}, but its key is for {algorithm:?}",
                header.alg
            )));
        }
        let mut validation = Validation::new(*algorithm);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.leeway = JWT_LEEWAY_SECONDS;
        validation.validate_nbf = true;
        let claims = jsonwebtoken::decode::<Claims>(token, key, &validation)
            .map_err(|error| match error.kind() {
                ErrorKind::ExpiredSignature => Rejection::TokenExpired,
                ErrorKind::InvalidSignature => Rejection::InvalidToken("bad signature".into()),
                ErrorKind::InvalidAudience => Rejection::InvalidToken("wrong audience".into()),
                ErrorKind::InvalidIssuer => Rejection::InvalidToken("wrong issuer".into()),
                ErrorKind::ImmatureSignature => {
                    Rejection::InvalidToken("not valid yet (nbf)".into())
                }
                ErrorKind::MissingRequiredClaim(claim) => {
                    Rejection::InvalidToken(format!("no {claim} claim"))
                }
                other => Rejection::InvalidToken(format!("{other:?}")),
            })?
            .claims;
        if claims.sub.is_empty() {
            return Err(Rejection::InvalidToken("empty sub".into()));
        }
        let principal: Arc<str> = claims.sub.into();
        self.verified
            .insert(token.into(), (principal.clone(), claims.exp, jwks.version));
        Ok(principal)
    }
}

/// Static tokens, known only by their SHA-256.
#[derive(Debug, Default)]
pub struct StaticTokens {
    by_hash: HashMap<[u8; 32], Arc<str>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    token: Vec<Spanned<TokenEntry>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    principal: String,
    sha256: Spanned<String>,
}

impl StaticTokens {
    /// Parses the TOML file; errors name the line.
    pub fn parse_text(text: &str) -> Result<Self, String> {
        let file: TokensFile = toml::from_str(text).map_err(|error| toml_error(text, &error))?;
        let mut by_hash = HashMap::new();
        for entry in file.token {
            let line = line_of(text, entry.span().start);
            let entry = entry.into_inner();
            let hash_line = line_of(text, entry.sha256.span().start);
            if entry.principal.trim().is_empty() {
                return Err(format!("line {line}: empty principal"));
            }
            let mut hash = [0u8; 32];
            hex::decode_to_slice(entry.sha256.get_ref().trim(), &mut hash).map_err(|_| {
                format!(
                    "line {hash_line}: sha256 must be 64 hex digits (`printf %s TOKEN | sha256sum`)"
                )
            })?;
            if by_hash.insert(hash, Arc::from(entry.principal)).is_some() {
                return Err(format!("line {hash_line}: this sha256 appears twice"));
            }
        }
        Ok(Self { by_hash })
    }

    pub fn principal(&self, token: &str) -> Option<Arc<str>> {
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_hash.get(&hash).cloned()
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

pub fn parse_static_tokens(
    contents: &[Vec<u8>],
    paths: &[PathBuf],
) -> Result<StaticTokens, FileError> {
    parse_text(contents, paths, StaticTokens::parse_text)
}

/// Every way a caller may prove who it is, as configured.
#[derive(Debug)]
pub struct Credentials {
    pub jwt: Option<JwtVerifier>,
    pub static_tokens: Option<Watched<StaticTokens>>,
}

impl Credentials {
    fn token_methods(&self) -> bool {
        self.jwt.is_some() || self.static_tokens.is_some()
    }

    /// The caller's principal. A bearer token, when the server takes tokens,
    /// decides alone: a bad one is refused even beside a good certificate.
    pub fn authenticate(
        &self,
        authorization: Option<&[u8]>,
        peer: Option<&PeerIdentity>,
    ) -> Result<Arc<str>, Rejection> {
        if let Some(value) = authorization.filter(|_| self.token_methods()) {
            return self.token(bearer_token(value)?);
        }
        match peer {
            Some(PeerIdentity::Verified(principal)) => Ok(principal.clone()),
            Some(PeerIdentity::Rejected(why)) => Err(Rejection::Certificate(why.clone())),
            None => Err(Rejection::NoCredential),
        }
    }

    fn token(&self, token: &str) -> Result<Arc<str>, Rejection> {
        if let Some(tokens) = &self.static_tokens
            && let Some(principal) = tokens.current().principal(token)
        {
            return Ok(principal);
        }
        match &self.jwt {
            // A JWT has three dot-separated parts.
            Some(jwt) if token.split('.').count() == 3 => jwt.verify(token),
            _ => Err(Rejection::UnknownToken),
        }
    }
}

/// The token of an `authorization: Bearer <token>` value.
fn bearer_token(value: &[u8]) -> Result<&str, Rejection> {
    let value = std::str::from_utf8(value).map_err(|_| Rejection::MalformedAuthorization)?;
    let (scheme, token) = value
        .split_once(' ')
        .ok_or(Rejection::MalformedAuthorization)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(Rejection::MalformedAuthorization);
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(token: &str) -> String {
        hex::encode(Sha256::digest(token.as_bytes()))
    }

    #[test]
    fn static_tokens_are_found_by_their_hash_only() {
        let text = format!(
            "[[token]]\nprincipal = \"importer\"\nsha256 = \"{}\"\n\n[[token]]\nprincipal = \"cron\"\nsha256 = \"{}\"\n",
            sha("s3cret-token"),
            sha("other")
        );
        let tokens = StaticTokens::parse_text(&text).unwrap();
        assert_eq!(tokens.len(), 2);
        assert_eq!(
            tokens.principal("s3cret-token").as_deref(),
            Some("importer")
        );
        assert_eq!(tokens.principal("other").as_deref(), Some("cron"));
        assert_eq!(tokens.principal("s3cret-tokeN"), None);
        assert_eq!(
            tokens.principal(&sha("s3cret-token")),
            None,
            "the hash is no token"
        );
    }

    #[test]
    fn static_token_errors_name_the_line() {
        let bad_hex = "[[token]]\nprincipal = \"a\"\nsha256 = \"xyz\"\n";
        assert!(
            StaticTokens::parse_text(bad_hex)
                .unwrap_err()
                .contains("line 3")
        );
        let twice = format!(
            "[[token]]\nprincipal = \"a\"\nsha256 = \"{0}\"\n[[token]]\nprincipal = \"b\"\nsha256 = \"{0}\"\n",
            sha("t")
        );
        assert!(
            StaticTokens::parse_text(&twice)
                .unwrap_err()
                .contains("line 6")
        );
        let unknown = "[[token]]\nname = \"a\"\n";
        assert!(
            StaticTokens::parse_text(unknown)
                .unwrap_err()
                .contains("line 2")
        );
    }

    #[test]
    fn a_bearer_value_needs_its_scheme_and_a_token() {
        assert_eq!(bearer_token(b"Bearer abc"), Ok("abc"));
        assert_eq!(bearer_token(b"bearer  abc "), Ok("abc"));
        for bad in [&b"abc"[..], b"Basic abc", b"Bearer ", b"Bearer", b"\xff"] {
            assert_eq!(bearer_token(bad), Err(Rejection::MalformedAuthorization));
        }
    }

    #[test]
    fn certificates_count_only_without_a_token() {
        let credentials = Credentials {
            jwt: None,
            static_tokens: None,
        };
        let verified = PeerIdentity::Verified("spiffe://a/b".into());
        let rejected = PeerIdentity::Rejected("unknown CA".into());
        assert_eq!(
            credentials.authenticate(None, Some(&verified)).as_deref(),
            Ok("spiffe://a/b")
        );
        // A server that takes no tokens ignores an authorization header.
        assert_eq!(
            credentials
                .authenticate(Some(b"Bearer x"), Some(&verified))
                .as_deref(),
            Ok("spiffe://a/b")
        );
        assert_eq!(
            credentials.authenticate(None, Some(&rejected)),
            Err(Rejection::Certificate("unknown CA".into()))
        );
        assert_eq!(
            credentials.authenticate(None, None),
            Err(Rejection::NoCredential)
        );
    }
}
