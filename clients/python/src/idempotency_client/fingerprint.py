"""Request fingerprints: SHA-256 of the canonical request, byte for byte the
digests of the Rust client's ``fingerprint`` module, so that a key reused with
a different request is caught (``FingerprintMismatch``) while the same request
written differently is not, whichever language computed it.

JSON is canonicalized per RFC 8785 (JCS): object keys sorted by UTF-16 code
units, no insignificant whitespace, strings with only ``"``, ``\\`` and control
characters escaped, numbers in their shortest ECMAScript form. One departure,
the Rust client's: JCS writes every number as a double, so two integers beyond
2^53 that differ only in their low digits (account or snowflake ids) would
share a fingerprint. A document holding an integer beyond 2^53 (within 64
bits) is written with its integers exact instead. Integers beyond 64 bits and
decimals finer than a double are read as doubles: send such values as strings.

Volatile fields (trace ids, client timestamps) are left out by JSON Pointer
(RFC 6901), e.g. ``/meta/trace_id``; ``~1`` stands for ``/`` and ``~0`` for
``~`` in a key, and a number selects an array element. A pointer to nothing
removes nothing (the field is optional); the empty pointer names the whole
document. The shared test vectors in ``tests/vectors/fingerprints.json`` are
checked against both implementations.
"""

from __future__ import annotations

import hashlib
import json as _json
import math
import re
from typing import Any, Iterable, List, Optional, Sequence, Union

__all__ = [
    "FingerprintError",
    "bytes_",
    "canonical_json",
    "canonical_json_bytes",
    "json",
    "json_bytes",
]

# Largest integer a double holds exactly, with every integer below it.
_EXACT_IN_A_DOUBLE = 1 << 53
_U64_MAX = (1 << 64) - 1
_I64_MIN = -(1 << 63)
# serde_json's default nesting limit, which the Rust client parses with: 127
# arrays or objects, one inside the other, and no more.
_MAX_NESTING = 127
_USIZE = re.compile(r"\+?[0-9]+")


class FingerprintError(ValueError):
    """Why a value or body could not be fingerprinted: not JSON, a value JSON
    cannot hold (NaN, infinity, a non-string key), or an excluded path that is
    not a JSON Pointer."""


def bytes_(body: bytes) -> bytes:
    """SHA-256 of raw bytes, for bodies that are not JSON."""
    return hashlib.sha256(body).digest()


def json(value: Any, exclude: Sequence[str] = ()) -> bytes:
    """SHA-256 of the canonical form of ``value`` (dicts, lists, strings,
    numbers, booleans, None) without the ``exclude`` pointers."""
    return bytes_(canonical_json(value, exclude).encode("utf-8"))


def json_bytes(body: Union[bytes, str], exclude: Sequence[str] = ()) -> bytes:
    """Parses ``body`` (UTF-8 JSON) as the Rust client does, then as :func:`json`."""
    return bytes_(canonical_json_bytes(body, exclude).encode("utf-8"))


def canonical_json(value: Any, exclude: Sequence[str] = ()) -> str:
    """The RFC 8785 form of ``value`` without the ``exclude`` pointers."""
    return _canonical_pruned(_normalize(value, 0), exclude)


def canonical_json_bytes(body: Union[bytes, str], exclude: Sequence[str] = ()) -> str:
    """The RFC 8785 form of the JSON document ``body`` without ``exclude``."""
    return _canonical_pruned(_parse(body), exclude)


# --- parsing ----------------------------------------------------------------


def _parse(body: Union[bytes, str]) -> Any:
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as error:
            raise FingerprintError(f"the body is not valid JSON: {error}") from error
    else:
        text = body
    try:
        value = _json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_refuse_constant,
        )
    except FingerprintError:
        raise
    except (ValueError, RecursionError) as error:
        raise FingerprintError(f"the body is not valid JSON: {error}") from error
    _check_parsed(value, 0)
    return value


def _parse_int(text: str) -> Union[int, float]:
    # serde_json keeps an integer literal as an integer only within i64 or
    # u64; beyond, and for "-0", it reads a double.
    number = int(text)
    if number == 0 and text.startswith("-"):
        return -0.0
    if _I64_MIN <= number <= _U64_MAX:
        return number
    return _parse_float(text)


def _parse_float(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise FingerprintError(f"the body is not valid JSON: number out of range: {text}")
    return number


def _refuse_constant(text: str) -> Any:
    raise FingerprintError(f"the body is not valid JSON: {text} is not a JSON value")


def _check_parsed(value: Any, depth: int) -> None:
    """What serde_json refuses and Python's json accepts: nesting deeper than
    127, and strings holding a lone surrogate (from a ``\\ud800`` escape)."""
    if isinstance(value, str):
        _check_string(value)
    elif isinstance(value, list):
        if depth >= _MAX_NESTING:
            raise FingerprintError("the body is not valid JSON: recursion limit exceeded")
        for item in value:
            _check_parsed(item, depth + 1)
    elif isinstance(value, dict):
        if depth >= _MAX_NESTING:
            raise FingerprintError("the body is not valid JSON: recursion limit exceeded")
        for key, item in value.items():
            _check_string(key)
            _check_parsed(item, depth + 1)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise FingerprintError(
            f"the body is not valid JSON: lone surrogate in a string: {error}"
        ) from error


def _normalize(value: Any, depth: int) -> Any:
    """A Python value as the Rust client's ``serde_json::Value`` would hold it."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if _I64_MIN <= value <= _U64_MAX:
            return int(value)
        return float(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FingerprintError(
                "the value cannot be canonicalized: NaN and +/-Infinity are not permitted in JSON"
            )
        return value
    if isinstance(value, str):
        _check_string(value)
        return value
    if depth > 10_000:
        raise FingerprintError("the value cannot be canonicalized: nested too deeply")
    if isinstance(value, (list, tuple)):
        return [_normalize(item, depth + 1) for item in value]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise FingerprintError(
                    f"the value cannot be canonicalized: object key {key!r} is not a string"
                )
            _check_string(key)
            out[key] = _normalize(item, depth + 1)
        return out
    raise FingerprintError(
        f"the value cannot be canonicalized: {type(value).__name__} is not a JSON type"
    )


# --- excluded pointers -----------------------------------------------------


def _canonical_pruned(value: Any, exclude: Iterable[str]) -> str:
    pointers: List[str] = list(exclude)
    if isinstance(exclude, str):
        raise TypeError("exclude is a sequence of JSON Pointers, not one string")
    # Every pointer names a place in the document as sent, but removing an
    # array element shifts the ones after it. So the deepest go first, and of
    # one array's elements the last first: `/a/0` and `/a/1` remove the first
    # two elements, not the first and the third. (The Rust client's order,
    # a stable sort, ties kept in the given order.)
    pointers.sort(key=_removal_order)
    if pointers:
        value = _copy(value)
    holder = [value]
    for pointer in pointers:
        _remove_pointer(holder, pointer)
    return _canonical(holder[0])


def _removal_order(pointer: str) -> tuple:
    index = _last_index(pointer)
    return (-pointer.count("/"), 0 if index is not None else 1, -(index or 0))


def _parse_usize(token: str) -> Optional[int]:
    """Rust's ``str::parse::<usize>``: ASCII digits with an optional ``+``."""
    if not _USIZE.fullmatch(token):
        return None
    number = int(token)
    return number if number <= _U64_MAX else None


def _last_index(pointer: str) -> Optional[int]:
    return _parse_usize(pointer.rsplit("/", 1)[-1])


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _array_index(token: str) -> Optional[int]:
    """serde_json's index while walking a pointer: no ``+``, no leading zero."""
    if token.startswith("+") or (token.startswith("0") and len(token) != 1):
        return None
    return _parse_usize(token)


def _resolve(value: Any, pointer: str) -> Any:
    """serde_json's ``Value::pointer_mut``; ``_MISSING`` for nothing."""
    if pointer == "":
        return value
    if not pointer.startswith("/"):
        return _MISSING
    for raw in pointer.split("/")[1:]:
        token = _unescape(raw)
        if isinstance(value, dict):
            if token not in value:
                return _MISSING
            value = value[token]
        elif isinstance(value, list):
            index = _array_index(token)
            if index is None or index >= len(value):
                return _MISSING
            value = value[index]
        else:
            return _MISSING
    return value


_MISSING = object()


def _remove_pointer(holder: List[Any], pointer: str) -> None:
    if pointer == "":
        holder[0] = None
        return
    if not pointer.startswith("/"):
        raise FingerprintError(
            f"{pointer!r} is not a JSON Pointer (it must be empty or start with '/')"
        )
    parent_path, last = pointer.rsplit("/", 1)
    token = _unescape(last)
    parent = _resolve(holder[0], parent_path)
    if isinstance(parent, dict):
        parent.pop(token, None)
    elif isinstance(parent, list):
        index = _parse_usize(token)
        if index is not None and index < len(parent):
            del parent[index]


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value


# --- writing -----------------------------------------------------------------


def _canonical(value: Any) -> str:
    out: List[str] = []
    _write(value, _holds_inexact_integer(value), out)
    return "".join(out)


def _holds_inexact_integer(value: Any) -> bool:
    """Whether ``value`` holds an integer that JCS, writing it as a double,
    could confuse with another."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return False
    if isinstance(value, int):
        return abs(value) > _EXACT_IN_A_DOUBLE
    if isinstance(value, list):
        return any(_holds_inexact_integer(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_inexact_integer(item) for item in value.values())
    return False


def _write(value: Any, exact: bool, out: List[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(value) if exact else number(float(value)))
    elif isinstance(value, float):
        out.append(number(value))
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, exact, out)
        out.append("]")
    else:
        out.append("{")
        keys = sorted(value, key=lambda key: key.encode("utf-16-be", "surrogatepass"))
        for i, key in enumerate(keys):
            if i:
                out.append(",")
            out.append(_string(key))
            out.append(":")
            _write(value[key], exact, out)
        out.append("}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_TO_ESCAPE = re.compile(r'["\\\x00-\x1f]')


def _escape(match: "re.Match[str]") -> str:
    char = match.group(0)
    return _ESCAPES.get(char) or "\\u%04x" % ord(char)


def _string(text: str) -> str:
    return '"' + _TO_ESCAPE.sub(_escape, text) + '"'


def number(value: float) -> str:
    """A double in its shortest ECMAScript form (``Number.prototype.toString``),
    as RFC 8785 writes numbers: ``1e+21``, ``1e-7``, ``0.000001``, ``-0`` as ``0``."""
    if not math.isfinite(value):
        raise FingerprintError(
            "the value cannot be canonicalized: NaN and +/-Infinity are not permitted in JSON"
        )
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    # repr gives the shortest digits that read back as the same double (the
    # closest of them when several are as short), as ECMAScript asks.
    mantissa, _, exp_text = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    exponent = (int(exp_text) if exp_text else 0) - len(fraction)
    stripped = digits.rstrip("0")
    exponent += len(digits) - len(stripped)
    digits = stripped
    k = len(digits)
    n = k + exponent  # the value is 0.<digits> x 10^n
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        mark = "+" if e >= 0 else "-"
        head = digits if k == 1 else digits[0] + "." + digits[1:]
        text = f"{head}e{mark}{abs(e)}"
    return sign + text
