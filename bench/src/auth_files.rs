//! `--make-auth-files DIR`: what `make bench` needs to measure the service
//! with TLS and bearer tokens on, made in-process (no openssl, no Python
//! modules): a CA and a server certificate for 127.0.0.1 and localhost, a
//! JWKS with one RSA key and a JWT signed with it, a static token, the
//! static tokens file (its SHA-256 only) and a policy granting both callers
//! the bench's namespace.
//!
//! The JWT is shaped like a Kubernetes projected service-account token
//! (RS256 with a 2048-bit key, a `kid`, the `kubernetes.io` claims): its
//! size is what every RPC carries, and what the server hashes to find it in
//! its cache of verified tokens. The JWT's private key never leaves this
//! process.

use std::{
    fs,
    io::Write,
    os::unix::fs::OpenOptionsExt,
    path::Path,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context;
use jsonwebtoken::{Algorithm, EncodingKey, Header, jwk::Jwk};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use rsa::pkcs1::EncodeRsaPrivateKey;
use serde_json::json;
use sha2::{Digest, Sha256};

/// The JWT's principal: a service account `idempotency-bench` in the
/// Kubernetes namespace `bench`.
pub const JWT_PRINCIPAL: &str = "system:serviceaccount:bench:idempotency-bench";
/// The static token's principal.
pub const STATIC_PRINCIPAL: &str = "bench-static";
/// How long the JWT is valid: longer than any run (the kubelet's tokens
/// live an hour and are replaced; a run must not outlive its token).
const JWT_VALID_SECONDS: u64 = 12 * 3600;

/// What the files are for; the JSON line printed on success.
pub struct Settings<'a> {
    pub dir: &'a Path,
    pub namespace: &'a str,
    pub issuer: &'a str,
    pub audience: &'a str,
}

/// A file only its owner may read (keys and tokens).
fn write_secret(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    let _ = fs::remove_file(path);
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut file| file.write_all(contents))
        .with_context(|| format!("writing {}", path.display()))
}

fn write_public(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// The CA (`ca.crt`) and the server's key pair (`tls.crt`, `tls.key`).
fn tls(dir: &Path) -> anyhow::Result<()> {
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "idempotency-bench CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

    let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
    params
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    params
        .distinguished_name
        .push(DnType::CommonName, "idempotencyd (bench)");
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &ca)?;

    write_public(&dir.join("ca.crt"), ca.pem().as_bytes())?;
    write_public(&dir.join("tls.crt"), cert.pem().as_bytes())?;
    write_secret(&dir.join("tls.key"), key.serialize_pem().as_bytes())
}

/// `jwks.json` and `jwt.token`; returns the token's length.
fn jwt(settings: &Settings<'_>) -> anyhow::Result<usize> {
    let mut rng = getrandom::SysRng;
    let private = rsa::PrivateKey::new(&mut rng, 2048).context("generating an RSA key")?;
    let der = private.to_pkcs1_der().context("encoding the RSA key")?;
    let key = EncodingKey::from_rsa_der(der.as_bytes());
    let kid = "bench-1";
    let mut jwk = Jwk::from_encoding_key(&key, Algorithm::RS256)?;
    jwk.common.key_id = Some(kid.to_owned());
    jwk.common.public_key_use = Some(jsonwebtoken::jwk::PublicKeyUse::Signature);
    let jwks = json!({ "keys": [jwk] });

    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let uid = |seed: u64| {
        let n = fastrand::Rng::with_seed(now ^ seed).u128(..);
        let hex = format!("{n:032x}");
        format!(
            "{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..]
        )
    };
    let claims = json!({
        "aud": [settings.audience],
        "exp": now + JWT_VALID_SECONDS,
        "iat": now,
        "iss": settings.issuer,
        "jti": uid(1),
        "kubernetes.io": {
            "namespace": "bench",
            "node": { "name": "bench-node-1", "uid": uid(2) },
            "pod": { "name": "idempotency-bench-6d5f8c7b9-x2x7q", "uid": uid(3) },
            "serviceaccount": { "name": "idempotency-bench", "uid": uid(4) },
        },
        "nbf": now,
        "sub": JWT_PRINCIPAL,
    });
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(kid.to_owned());
    let token = jsonwebtoken::encode(&header, &claims, &key)?;

    write_public(
        &settings.dir.join("jwks.json"),
        serde_json::to_vec_pretty(&jwks)?.as_slice(),
    )?;
    write_secret(&settings.dir.join("jwt.token"), token.as_bytes())?;
    Ok(token.len())
}

/// `static.token` and `tokens.toml` (its hash); returns the token's length.
fn static_token(dir: &Path) -> anyhow::Result<usize> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|error| anyhow::anyhow!("random bytes: {error}"))?;
    let token = hex::encode(bytes);
    let file = format!(
        "[[token]]\nprincipal = \"{STATIC_PRINCIPAL}\"\nsha256 = \"{}\"\n",
        hex::encode(Sha256::digest(token.as_bytes()))
    );
    write_secret(&dir.join("static.token"), token.as_bytes())?;
    write_public(&dir.join("tokens.toml"), file.as_bytes())?;
    Ok(token.len())
}

/// Writes every file into `settings.dir` (made if missing) and prints one
/// JSON line describing them.
pub fn write(settings: &Settings<'_>) -> anyhow::Result<()> {
    fs::create_dir_all(settings.dir)
        .with_context(|| format!("creating {}", settings.dir.display()))?;
    tls(settings.dir)?;
    let jwt_bytes = jwt(settings)?;
    let static_bytes = static_token(settings.dir)?;
    let policy = format!(
        "[[grant]]\nprincipals = [\"{JWT_PRINCIPAL}\", \"{STATIC_PRINCIPAL}\"]\nnamespaces = [\"{}\"]\nrole = \"caller\"\n",
        settings.namespace
    );
    write_public(&settings.dir.join("policy.toml"), policy.as_bytes())?;
    println!(
        "{}",
        json!({
            "dir": settings.dir.display().to_string(),
            "tls": "rcgen CA; server certificate ECDSA P-256 for localhost and 127.0.0.1",
            "jwt": {
                "algorithm": "RS256", "rsa_bits": 2048, "bytes": jwt_bytes,
                "principal": JWT_PRINCIPAL, "issuer": settings.issuer,
                "audience": settings.audience, "valid_seconds": JWT_VALID_SECONDS,
            },
            "static_token": { "bytes": static_bytes, "principal": STATIC_PRINCIPAL },
            "namespace": settings.namespace,
        })
    );
    Ok(())
}
