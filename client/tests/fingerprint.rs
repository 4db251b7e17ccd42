//! Fingerprint test vectors: RFC 8785 (JCS) examples and the properties a
//! caller relies on (same request → same fingerprint, any change → another).

use idempotency_client::fingerprint::{self, FingerprintError};
use serde_json::{Value, json};

fn canonical(text: &str) -> String {
    let value: Value = serde_json::from_str(text).unwrap();
    fingerprint::canonical_json(&value, &[]).unwrap()
}

fn fp(text: &str, excluded: &[&str]) -> Vec<u8> {
    fingerprint::json_bytes(text.as_bytes(), excluded).unwrap()
}

#[test]
fn rfc8785_main_example() {
    let input = r#"{
        "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
        "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
        "literals": [null, true, false]
    }"#;
    assert_eq!(
        canonical(input),
        r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
    );
}

#[test]
fn rfc8785_keys_sort_by_utf16_code_units() {
    let input = r#"{
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\ud83d\ude00": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis"
    }"#;
    let value: Value = serde_json::from_str(&canonical(input)).unwrap();
    // serde_json keeps insertion order only with preserve_order; read the order from the text.
    let text = canonical(input);
    let positions: Vec<usize> = [
        "Carriage Return",
        "One",
        "Control",
        "Latin Small Letter O With Diaeresis",
        "Euro Sign",
        "Emoji: Grinning Face",
        "Hebrew Letter Dalet With Dagesh",
    ]
    .iter()
    .map(|name| {
        text.find(name)
            .unwrap_or_else(|| panic!("{name} in {text}"))
    })
    .collect();
    assert!(positions.windows(2).all(|pair| pair[0] < pair[1]), "{text}");
    assert_eq!(value.as_object().unwrap().len(), 7);
}

#[test]
fn rfc8785_number_serialization() {
    // Appendix B: IEEE 754 bit patterns and their canonical text.
    let cases: &[(u64, &str)] = &[
        (0x0000000000000000, "0"),
        (0x8000000000000000, "0"),
        (0x0000000000000001, "5e-324"),
        (0x7fefffffffffffff, "1.7976931348623157e+308"),
        (0x4340000000000000, "9007199254740992"),
        (0xc340000000000000, "-9007199254740992"),
        (0x4430000000000000, "295147905179352830000"),
        (0x44b52d02c7e14af5, "9.999999999999997e+22"),
        (0x44b52d02c7e14af6, "1e+23"),
        (0x444b1ae4d6e2ef50, "1e+21"),
        (0x444b1ae4d6e2ef4f, "999999999999999900000"),
        (0x3eb0c6f7a0b5ed8d, "0.000001"),
        (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
        (0x41b3de4355555555, "333333333.3333333"),
    ];
    for &(bits, expected) in cases {
        let value = json!(f64::from_bits(bits));
        assert_eq!(
            fingerprint::canonical_json(&value, &[]).unwrap(),
            expected,
            "{bits:#018x}"
        );
    }
}

#[test]
fn key_order_and_whitespace_do_not_change_the_fingerprint() {
    let compact = r#"{"amount":1000,"currency":"EUR","card":{"last4":"4242","exp":"12/30"}}"#;
    let spread = "{\n  \"card\" : { \"exp\":\"12/30\", \"last4\": \"4242\" },\n\t\"currency\": \"EUR\", \"amount\": 1000\n}";
    assert_eq!(fp(compact, &[]), fp(spread, &[]));
    assert_eq!(fp(compact, &[]).len(), 32, "SHA-256");
}

#[test]
fn any_change_of_value_type_or_array_order_changes_the_fingerprint() {
    let base = fp(r#"{"amount":1000,"items":["a","b"]}"#, &[]);
    for changed in [
        r#"{"amount":1001,"items":["a","b"]}"#,
        r#"{"amount":"1000","items":["a","b"]}"#,
        r#"{"amount":1000,"items":["b","a"]}"#,
        r#"{"amount":1000,"items":["a","b"],"extra":null}"#,
        r#"{"amount":1000,"items":["a"]}"#,
    ] {
        assert_ne!(fp(changed, &[]), base, "{changed}");
    }
    assert_ne!(fp("1", &[]), fp(r#""1""#, &[]));
}

#[test]
fn equal_numbers_written_differently_agree() {
    assert_eq!(fp("[1.0, 1e2, 0.5E1]", &[]), fp("[1, 100, 5]", &[]));
}

#[test]
fn excluded_pointers_are_ignored_wherever_they_point() {
    let first = r#"{"amount":1000,"meta":{"trace_id":"t-1","sent_at":"10:00"},"a/b":1}"#;
    let retry = r#"{"amount":1000,"meta":{"trace_id":"t-2","sent_at":"10:05"},"a/b":2}"#;
    let excluded = ["/meta/trace_id", "/meta/sent_at", "/a~1b"];
    assert_eq!(fp(first, &excluded), fp(retry, &excluded));
    assert_ne!(fp(first, &excluded[..1]), fp(retry, &excluded[..1]));
    // A pointer to nothing is fine: optional fields may be absent.
    assert_eq!(
        fp(r#"{"amount":1000}"#, &["/meta/trace_id"]),
        fp(r#"{"amount":1000}"#, &[])
    );
    // Excluding does not excuse other differences.
    let other = r#"{"amount":2000,"meta":{"trace_id":"t-1"},"a/b":1}"#;
    assert_ne!(fp(first, &excluded), fp(other, &excluded));
}

#[test]
fn pointers_name_places_in_the_document_as_sent() {
    let value = json!({"a": [{"t": 1}, {"t": 2}, {"keep": 3}]});
    let expected = r#"{"a":[{"keep":3}]}"#;
    for excluded in [["/a/0", "/a/1"], ["/a/1", "/a/0"]] {
        assert_eq!(
            fingerprint::canonical_json(&value, &excluded).unwrap(),
            expected
        );
    }
    // A field inside an element, and an element before it.
    assert_eq!(
        fingerprint::canonical_json(&value, &["/a/0", "/a/2/keep"]).unwrap(),
        r#"{"a":[{"t":2},{}]}"#
    );
}

#[test]
fn bad_input_is_a_typed_error() {
    assert!(matches!(
        fingerprint::json_bytes(b"{not json", &[]),
        Err(FingerprintError::InvalidJson(_))
    ));
    assert!(matches!(
        fingerprint::json(&json!({}), &["meta"]),
        Err(FingerprintError::InvalidPointer(_))
    ));
}

#[test]
fn raw_bytes_are_hashed_as_they_are() {
    assert_eq!(fingerprint::bytes(b"abc"), fingerprint::bytes(b"abc"));
    assert_ne!(fingerprint::bytes(b"abc"), fingerprint::bytes(b"abd"));
    assert_eq!(fingerprint::bytes(b"").len(), 32);
}

#[test]
fn integers_beyond_a_double_keep_every_digit() {
    // JCS alone writes both ids as 1790000000000000000.
    let first = r#"{"to_account": 1790000000000000001, "amount": 100}"#;
    let second = r#"{"to_account": 1790000000000000002, "amount": 100}"#;
    assert_ne!(fp(first, &[]), fp(second, &[]));
    assert_ne!(
        fp(r#"[-9007199254740993]"#, &[]),
        fp(r#"[-9007199254740994]"#, &[])
    );
    // The same request written differently still matches.
    assert_eq!(
        fp(first, &[]),
        fp(r#"{ "amount":100,"to_account":1790000000000000001 }"#, &[])
    );
    assert_eq!(
        canonical(r#"{"b": [1790000000000000001, 1.50, "x"], "a": {"d": null, "c": true}}"#),
        r#"{"a":{"c":true,"d":null},"b":[1790000000000000001,1.5,"x"]}"#
    );
}

#[test]
fn documents_within_a_doubles_integers_keep_their_jcs_form() {
    // Fingerprints taken before big integers were kept exact stay the same.
    let text = r#"{"id": 9007199254740992, "n": [-9007199254740992, 2.5e-3], "s": "\u20ac"}"#;
    let value: Value = serde_json::from_str(text).unwrap();
    assert_eq!(
        canonical(text),
        serde_json_canonicalizer::to_string(&value).unwrap()
    );
}
