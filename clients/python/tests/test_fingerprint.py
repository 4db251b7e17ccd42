"""Fingerprints of Python values and bodies beyond the shared vectors: what a
Python caller can hand over that a JSON text cannot say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from idempotency_client import fingerprint, reason


def test_the_same_request_written_differently_has_one_fingerprint() -> None:
    body = b'{"currency": "EUR", "amount": 1000, "meta": {"trace_id": "abc"}}'
    same = {"amount": 1000.0, "currency": "EUR", "meta": {"trace_id": "xyz"}}

    assert fingerprint.json_bytes(body, ["/meta/trace_id"]) == fingerprint.json(same, ["/meta/trace_id"])
    assert fingerprint.json_bytes(body) != fingerprint.json(same)


def test_ids_beyond_2_53_that_differ_in_their_low_digits_differ() -> None:
    assert fingerprint.json({"id": 1839269315271468032}) != fingerprint.json({"id": 1839269315271468033})
    assert fingerprint.canonical_json({"id": 1839269315271468033}) == '{"id":1839269315271468033}'


def test_python_values_map_to_json_as_the_rust_client_reads_them() -> None:
    assert fingerprint.canonical_json((1, True, None, 2.0)) == "[1,true,null,2]"
    # Beyond 64 bits an integer is a double, as in a parsed body.
    assert fingerprint.canonical_json([2**64]) == fingerprint.canonical_json_bytes("[18446744073709551616]")
    assert fingerprint.canonical_json([2**64]) == "[18446744073709552000]"


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), {1: "a"}, {"a": object()}, b"bytes", "\ud800"],
    ids=["nan", "inf", "int key", "object", "bytes", "lone surrogate"],
)
def test_a_value_json_cannot_hold_is_refused(value: object) -> None:
    with pytest.raises(fingerprint.FingerprintError):
        fingerprint.json(value)


@pytest.mark.parametrize("body", [b"\xff", b"\xef\xbb\xbf{}", b"[1e999]", b"[-Infinity]", b"[" * 128 + b"]" * 128])
def test_a_body_the_rust_client_refuses_is_refused(body: bytes) -> None:
    with pytest.raises(fingerprint.FingerprintError):
        fingerprint.json_bytes(body)


def test_the_deepest_document_serde_json_reads_is_read() -> None:
    assert fingerprint.canonical_json_bytes(b"[" * 127 + b"]" * 127) == "[" * 127 + "]" * 127


def test_a_pointer_must_start_with_a_slash() -> None:
    with pytest.raises(fingerprint.FingerprintError, match="not a JSON Pointer"):
        fingerprint.json({"a": 1}, ["a"])
    with pytest.raises(TypeError):
        fingerprint.json({"a": 1}, "/a")


def test_excluding_leaves_the_callers_value_untouched() -> None:
    value = {"a": [1, 2], "b": {"c": 1}}
    fingerprint.json(value, ["/a/0", "/b/c"])
    assert value == {"a": [1, 2], "b": {"c": 1}}


def test_reasons_match_the_services_list() -> None:
    rust = Path(__file__).resolve().parents[3] / "proto" / "src" / "reason.rs"
    declared = dict(re.findall(r'pub const (\w+): &str = "([^"]*)";', rust.read_text()))
    mirrored = {name: getattr(reason, name) for name in dir(reason) if name.isupper()}

    assert declared and mirrored == declared
