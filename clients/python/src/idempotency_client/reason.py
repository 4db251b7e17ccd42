"""``google.rpc.ErrorInfo`` reasons of the service (domain :data:`ERROR_DOMAIN`),
mirrored from ``proto/src/reason.rs``: every error status carries one, so that
callers branch on code and reason, never on message text. A test keeps this
list equal to the Rust one."""

ERROR_DOMAIN = "idempotency"

#: A field is malformed or out of range; nothing was written.
INVALID_ARGUMENT = "INVALID_ARGUMENT"
#: No live record has this id (never created, or expired).
RECORD_NOT_FOUND = "RECORD_NOT_FOUND"
#: The fencing token is not the record's current one: another attempt acquired the key since.
STALE_FENCING_TOKEN = "STALE_FENCING_TOKEN"
#: The record is already completed or failed with another response.
RESPONSE_CONFLICT = "RESPONSE_CONFLICT"
#: The record is not in progress (finished, or released).
NOT_IN_PROGRESS = "NOT_IN_PROGRESS"
#: The database is unreachable or overloaded.
DATABASE_UNAVAILABLE = "DATABASE_UNAVAILABLE"
#: The record changed under every attempt to settle the call.
CONTENTION = "CONTENTION"
#: Unexpected; the cause is in the server's log.
INTERNAL = "INTERNAL"
#: Batch items only: the answer did not fit in the batch's reply.
BATCH_REPLY_FULL = "BATCH_REPLY_FULL"
#: With auth on: no credential, or one that does not check out.
UNAUTHENTICATED = "UNAUTHENTICATED"
#: With auth on: the caller may not touch the namespace of this id.
NAMESPACE_FORBIDDEN = "NAMESPACE_FORBIDDEN"
#: With auth on: reflection for a caller the policy grants nothing.
NOT_GRANTED = "NOT_GRANTED"
#: The request message is longer than its method can validly be.
MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
#: Shed before anything was read: the server had its most calls in flight.
OVERLOADED = "OVERLOADED"
#: No answer within the call's deadline: the database is slow or unreachable.
REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
#: BatchStream only: the connection or principal has its most streams open.
TOO_MANY_STREAMS = "TOO_MANY_STREAMS"
#: BatchStream only: the caller left answers unread too long.
SLOW_READER = "SLOW_READER"
#: BatchStream only: the server stopped before answering every message it read.
DRAINING = "DRAINING"
