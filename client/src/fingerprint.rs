//! Request fingerprints: SHA-256 of the canonical request, so that a key
//! reused with a different request is caught (FINGERPRINT_MISMATCH, HTTP 422)
//! while the same request written differently is not.
//!
//! JSON is canonicalized per RFC 8785 (JCS): object keys sorted by UTF-16
//! code units, no insignificant whitespace, numbers in their shortest
//! ECMAScript form. Volatile fields (trace ids, client timestamps) are left
//! out by JSON Pointer (RFC 6901), e.g. `/meta/trace_id`.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Why a body could not be fingerprinted as JSON.
#[derive(Debug, thiserror::Error)]
pub enum FingerprintError {
    /// The body is not JSON.
    #[error("the body is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// An excluded path is not a JSON Pointer.
    #[error("{0:?} is not a JSON Pointer (it must be empty or start with '/')")]
    InvalidPointer(String),
    /// The value cannot be canonicalized (e.g. a number JCS cannot represent).
    #[error("the value cannot be canonicalized: {0}")]
    Canonicalization(String),
}

/// SHA-256 of raw bytes, for bodies that are not JSON.
pub fn bytes(body: &[u8]) -> Vec<u8> {
    Sha256::digest(body).to_vec()
}

/// SHA-256 of the canonical form of `value` without the `excluded` pointers.
pub fn json(value: &Value, excluded: &[&str]) -> Result<Vec<u8>, FingerprintError> {
    Ok(bytes(canonical_json(value, excluded)?.as_bytes()))
}

/// Parses `body` as JSON, then as [`json`].
pub fn json_bytes(body: &[u8], excluded: &[&str]) -> Result<Vec<u8>, FingerprintError> {
    let value: Value = serde_json::from_slice(body).map_err(FingerprintError::InvalidJson)?;
    json(&value, excluded)
}

/// The RFC 8785 form of `value` without the `excluded` pointers.
pub fn canonical_json(value: &Value, excluded: &[&str]) -> Result<String, FingerprintError> {
    let pruned;
    let value = if excluded.is_empty() {
        value
    } else {
        let mut copy = value.clone();
        for pointer in excluded {
            remove_pointer(&mut copy, pointer)?;
        }
        pruned = copy;
        &pruned
    };
    serde_json_canonicalizer::to_string(value)
        .map_err(|error| FingerprintError::Canonicalization(error.to_string()))
}

/// Removes what `pointer` names; a pointer to nothing removes nothing (the
/// field is optional). The empty pointer names the whole document: it is
/// replaced by `null`.
fn remove_pointer(value: &mut Value, pointer: &str) -> Result<(), FingerprintError> {
    if pointer.is_empty() {
        *value = Value::Null;
        return Ok(());
    }
    let Some(split) = pointer.rfind('/') else {
        return Err(FingerprintError::InvalidPointer(pointer.to_owned()));
    };
    if !pointer.starts_with('/') {
        return Err(FingerprintError::InvalidPointer(pointer.to_owned()));
    }
    let (parent, last) = (&pointer[..split], &pointer[split + 1..]);
    let token = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(Value::Object(object)) => {
            object.remove(&token);
        }
        Some(Value::Array(array)) => {
            if let Ok(index) = token.parse::<usize>()
                && index < array.len()
            {
                array.remove(index);
            }
        }
        _ => {}
    }
    Ok(())
}
