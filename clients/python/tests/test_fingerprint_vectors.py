"""The fingerprint test vectors shared with the Rust client
(``tests/vectors/fingerprints.json``, also checked by
``client/tests/fingerprint_vectors.rs``): both languages must give every case
the same canonical form and digest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from idempotency_client import fingerprint

VECTORS = Path(__file__).resolve().parents[3] / "tests" / "vectors" / "fingerprints.json"


def _cases() -> List[Dict[str, Any]]:
    cases = json.loads(VECTORS.read_text(encoding="utf-8"))
    assert len(cases) >= 30, f"only {len(cases)} cases in {VECTORS}"
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda case: case["name"])
def test_every_vector_canonicalizes_and_hashes_as_recorded(case: Dict[str, Any]) -> None:
    text, exclude = case["input"], case["exclude"]
    if case.get("error"):
        with pytest.raises(fingerprint.FingerprintError):
            fingerprint.json_bytes(text.encode("utf-8", "surrogatepass"), exclude)
        return

    canonical = fingerprint.canonical_json_bytes(text, exclude)
    from_bytes = fingerprint.json_bytes(text.encode("utf-8"), exclude).hex()
    # The same document handed over as Python values (json.loads' own ints
    # and floats) hashes alike.
    from_value = fingerprint.json(json.loads(text), exclude).hex()

    assert canonical == case["canonical"]
    assert from_bytes == case["sha256"]
    assert from_value == case["sha256"]
    assert hashlib.sha256(canonical.encode("utf-8")).hexdigest() == case["sha256"]
