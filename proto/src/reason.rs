//! `google.rpc.ErrorInfo` reasons: every error status of the service carries
//! one (domain [`ERROR_DOMAIN`]), so callers branch on code and reason, never
//! on message text. The proto's header lists each with its gRPC code.

/// The `ErrorInfo.domain` of every error the service sends.
pub const ERROR_DOMAIN: &str = "idempotency";

/// A field is malformed or out of range; nothing was written.
pub const INVALID_ARGUMENT: &str = "INVALID_ARGUMENT";
/// No live record has this id (never created, or expired).
pub const RECORD_NOT_FOUND: &str = "RECORD_NOT_FOUND";
/// The fencing token is not the record's current one: another attempt
/// acquired the key since.
pub const STALE_FENCING_TOKEN: &str = "STALE_FENCING_TOKEN";
/// The record is already completed or failed with another response.
pub const RESPONSE_CONFLICT: &str = "RESPONSE_CONFLICT";
/// The record is not in progress (finished, or released).
pub const NOT_IN_PROGRESS: &str = "NOT_IN_PROGRESS";
/// The database is unreachable or overloaded.
pub const DATABASE_UNAVAILABLE: &str = "DATABASE_UNAVAILABLE";
/// The record changed under every attempt to settle the call.
pub const CONTENTION: &str = "CONTENTION";
/// Unexpected; the cause is in the server's log.
pub const INTERNAL: &str = "INTERNAL";
/// Batch items only: the answer did not fit in the batch's reply.
pub const BATCH_REPLY_FULL: &str = "BATCH_REPLY_FULL";
/// With auth on: no credential, or one that does not check out.
pub const UNAUTHENTICATED: &str = "UNAUTHENTICATED";
/// With auth on: the caller may not touch the namespace of this id.
pub const NAMESPACE_FORBIDDEN: &str = "NAMESPACE_FORBIDDEN";
/// With auth on: reflection for a caller the policy grants nothing.
pub const NOT_GRANTED: &str = "NOT_GRANTED";
/// The request message is longer than its method can validly be.
pub const MESSAGE_TOO_LARGE: &str = "MESSAGE_TOO_LARGE";
/// Shed before anything was read: `--max-concurrent-calls` calls were
/// in flight, or they held the memory budget (`--max-in-flight-bytes`).
pub const OVERLOADED: &str = "OVERLOADED";
/// No answer within the call's deadline (the caller's, or the server's
/// --request-timeout): the database is slow or unreachable.
pub const REQUEST_TIMEOUT: &str = "REQUEST_TIMEOUT";
/// BatchStream only: the connection or principal has its most streams open.
pub const TOO_MANY_STREAMS: &str = "TOO_MANY_STREAMS";
/// BatchStream only: the caller left answers unread too long.
pub const SLOW_READER: &str = "SLOW_READER";
/// BatchStream only: the server stopped before answering every message it read.
pub const DRAINING: &str = "DRAINING";
