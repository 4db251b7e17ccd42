//! The fingerprint test vectors shared with the Python client
//! (`tests/vectors/fingerprints.json`, also read by
//! `clients/python/tests/test_fingerprint_vectors.py`), so that the two
//! languages can never hash the same request differently.
//!
//! Each case gives a JSON text (`input`, a string so that big integers and
//! exact float spellings survive) and the JSON Pointers left out
//! (`exclude`), then either the canonical form (`canonical`) and the hex
//! SHA-256 of it (`sha256`), or `"error": true` when the input or a pointer
//! is refused. The expected values came from this implementation, the
//! reference: to add a case, write its `name`, `input` and `exclude`, run
//! this test, and copy the canonical form and digest it reports as missing.

use std::path::Path;

use idempotency_client::fingerprint;
use serde_json::Value;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn vectors() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/vectors/fingerprints.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
    serde_json::from_str(&text).expect("the vectors file is a JSON list of cases")
}

fn text<'a>(case: &'a Value, field: &str) -> &'a str {
    case[field]
        .as_str()
        .unwrap_or_else(|| panic!("case {case}: no string {field:?}"))
}

#[test]
fn every_vector_canonicalizes_and_hashes_as_recorded() {
    let cases = vectors();
    assert!(cases.len() >= 30, "only {} cases", cases.len());
    for case in &cases {
        let name = text(case, "name");
        let input = text(case, "input");
        let exclude: Vec<&str> = case["exclude"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no exclude list"))
            .iter()
            .map(|pointer| pointer.as_str().expect("pointers are strings"))
            .collect();
        let digest = fingerprint::json_bytes(input.as_bytes(), &exclude);
        if case["error"] == Value::Bool(true) {
            assert!(digest.is_err(), "{name}: expected an error, got {digest:?}");
            continue;
        }
        let value: Value = serde_json::from_str(input).unwrap_or_else(|e| panic!("{name}: {e}"));
        let canonical = fingerprint::canonical_json(&value, &exclude)
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        let digest = hex(&digest.unwrap_or_else(|error| panic!("{name}: {error}")));
        let (Some(expected), Some(_)) = (case["canonical"].as_str(), case["sha256"].as_str())
        else {
            panic!("{name}: a new case; add \"canonical\": {canonical:?}, \"sha256\": {digest:?}")
        };
        assert_eq!(canonical, expected, "{name}: canonical form");
        assert_eq!(digest, text(case, "sha256"), "{name}: digest of json_bytes");
        assert_eq!(
            hex(&fingerprint::json(&value, &exclude).unwrap()),
            digest,
            "{name}: digest of json"
        );
        assert_eq!(
            hex(&fingerprint::bytes(canonical.as_bytes())),
            digest,
            "{name}: the digest is the SHA-256 of the canonical form"
        );
    }
}
