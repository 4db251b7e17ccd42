"""W3C trace context for each RPC: the ``traceparent`` (and ``tracestate``)
of OpenTelemetry's current span when the ``opentelemetry`` API is installed
and a span is active, else a fresh random trace per call (not sampled: this
client records no span of its own), so that the server's log line for the
call can be found by its trace id."""

from __future__ import annotations

import secrets
from typing import Dict, List, Tuple

Metadata = List[Tuple[str, str]]

try:  # optional: the OpenTelemetry API
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace

    _OPENTELEMETRY = True
except ImportError:  # pragma: no cover - depends on the environment
    _OPENTELEMETRY = False


class CallTrace:
    """The trace one logical call (all its attempts) belongs to."""

    def __init__(self) -> None:
        self.injected: Metadata = []
        if _OPENTELEMETRY:
            context = _trace.get_current_span().get_span_context()
            if context.is_valid:
                carrier: Dict[str, str] = {}
                _propagate.inject(carrier)
                self.injected = [(key.lower(), value) for key, value in carrier.items()]
                if any(key == "traceparent" for key, _ in self.injected):
                    self.trace_id = format(context.trace_id, "032x")
                    return
                self.injected = []
        self.trace_id = secrets.token_hex(16)

    def metadata(self) -> Metadata:
        """The headers of one attempt: the active span's, or a new span id
        (parent id) under this call's trace id."""
        if self.injected:
            return list(self.injected)
        return [("traceparent", f"00-{self.trace_id}-{secrets.token_hex(8)}-00")]
