//! Logs (tracing) and metrics (Prometheus) set-up.
//!
//! JSON lines (`--log-format json`) carry the event's fields at the top
//! level, the current span's fields under `span` and every enclosing span's
//! under `spans`; a line logged while serving a call also starts with the
//! call's `trace_id` (see [`crate::grpc::trace`]), so that log collectors
//! find it in one place whatever span the line came from.

use std::{fmt as stdfmt, io::IsTerminal, sync::OnceLock};

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing::{Event, Subscriber, field::Visit, span};
use tracing_subscriber::{
    EnvFilter,
    field::RecordFields,
    fmt,
    fmt::{
        FmtContext, FormatEvent, FormatFields, FormattedFields, MakeWriter,
        format::{Json, JsonFields, Writer},
    },
    registry::LookupSpan,
    util::SubscriberInitExt,
};

use crate::settings::{LogArgs, LogFormat};

/// What must live as long as the process logs: with OpenTelemetry export
/// on, the exporter, which sends its last spans when dropped.
#[must_use = "dropping it stops the export of spans"]
pub struct Telemetry {
    #[cfg(feature = "otel")]
    _otel: Option<crate::otel::Exporter>,
}

/// The log target of audit lines (an operator's `admin purge`).
pub const AUDIT_TARGET: &str = "audit";

/// Installs the global log subscriber, writing to stdout. Call once, first
/// thing in `main`.
pub fn init_logs(args: &LogArgs) {
    let _ = init_with_export(args, Output::stdout(), None);
}

/// Installs the global log subscriber, writing to stderr: for the commands
/// whose stdout is their answer (`admin`).
pub fn init_logs_to_stderr(args: &LogArgs) {
    let _ = init_with_export(args, Output::stderr(), None);
}

/// The log subscriber of `serve`: [`init_logs`], and with `otlp_endpoint`
/// (the `otel` feature) each call's span exported there. Keep the returned
/// [`Telemetry`] until the process ends.
pub fn init_serve_logs(
    args: &LogArgs,
    otlp_endpoint: Option<&url::Url>,
) -> Result<Telemetry, TelemetryError> {
    init_with_export(args, Output::stdout(), otlp_endpoint)
}

/// Where log lines go, and whether text lines are coloured there.
struct Output<W> {
    writer: W,
    ansi: bool,
}

impl Output<fn() -> std::io::Stdout> {
    fn stdout() -> Self {
        Self::colour_if_terminal(std::io::stdout, std::io::stdout().is_terminal())
    }
}

impl Output<fn() -> std::io::Stderr> {
    fn stderr() -> Self {
        Self::colour_if_terminal(std::io::stderr, std::io::stderr().is_terminal())
    }
}

impl<W> Output<W> {
    /// Colours (ANSI escapes) only for a person at a terminal who has not
    /// set `NO_COLOR`: a file, a pipe or a container's log collector gets
    /// plain text, which is also cheaper to write (each call's span fields
    /// are formatted whether or not a line is logged).
    fn colour_if_terminal(writer: W, terminal: bool) -> Self {
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|value| !value.is_empty());
        Self {
            writer,
            ansi: terminal && !no_color,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(
        "--otlp-endpoint is set, but this idempotencyd was built without the `otel` feature; \
         unset it, or build with `cargo build --features otel`"
    )]
    OtelNotBuilt,
    #[cfg(feature = "otel")]
    #[error("starting the OTLP exporter")]
    Otel(#[from] opentelemetry_otlp::ExporterBuildError),
}

fn init_with_export<W>(
    args: &LogArgs,
    output: Output<W>,
    otlp_endpoint: Option<&url::Url>,
) -> Result<Telemetry, TelemetryError>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = fmt()
        .with_env_filter(filter(&args.log_level))
        .with_target(true)
        .with_ansi(output.ansi)
        .with_writer(output.writer);
    match args.log_format {
        LogFormat::Text => install(builder.finish(), otlp_endpoint),
        LogFormat::Json => install(json(builder).finish(), otlp_endpoint),
    }
}

/// `builder` writing JSON lines: the event's fields at the top level, the
/// call's trace id first (`TraceIdFirst`), span fields appended as recorded
/// (`AppendedJsonFields`).
fn json<F, W>(
    builder: fmt::SubscriberBuilder<fmt::format::DefaultFields, fmt::format::Format, F, W>,
) -> fmt::SubscriberBuilder<AppendedJsonFields, TraceIdFirst<fmt::format::Format<Json>>, F, W>
where
    W: for<'w> MakeWriter<'w> + 'static,
{
    builder
        .json()
        .flatten_event(true)
        .fmt_fields(AppendedJsonFields)
        .map_event_format(TraceIdFirst)
}

/// Installs `subscriber` as the global one, with the OpenTelemetry layer
/// when `otlp_endpoint` asks for it.
fn install<S>(subscriber: S, otlp_endpoint: Option<&url::Url>) -> Result<Telemetry, TelemetryError>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync + 'static,
{
    #[cfg(feature = "otel")]
    {
        use tracing_subscriber::layer::SubscriberExt;
        let (layer, exporter) = match otlp_endpoint {
            Some(endpoint) => {
                let (layer, exporter) = crate::otel::layer(endpoint)?;
                (Some(layer), Some(exporter))
            }
            None => (None, None),
        };
        subscriber.with(layer).init();
        Ok(Telemetry { _otel: exporter })
    }
    #[cfg(not(feature = "otel"))]
    {
        subscriber.init();
        match otlp_endpoint {
            Some(_) => Err(TelemetryError::OtelNotBuilt),
            None => Ok(Telemetry {}),
        }
    }
}

/// The JSON event format with the enclosing call's `trace_id` put first on
/// the line (`{"trace_id":"…","timestamp":…}`); lines outside a call as they were.
struct TraceIdFirst<F>(F);

impl<S, N, F> FormatEvent<S, N> for TraceIdFirst<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> stdfmt::Result {
        let trace_id = ctx.event_scope().and_then(|scope| {
            scope.into_iter().find_map(|span| {
                let extensions = span.extensions();
                let fields = extensions.get::<FormattedFields<N>>()?;
                trace_id_in(fields)
            })
        });
        let Some(trace_id) = trace_id else {
            return self.0.format_event(ctx, writer, event);
        };
        let mut line = String::with_capacity(512);
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        let Some(rest) = line.strip_prefix('{') else {
            return writer.write_str(&line);
        };
        let trace_id = std::str::from_utf8(&trace_id).map_err(|_| stdfmt::Error)?;
        write!(writer, "{{\"trace_id\":\"{trace_id}\",{rest}")
    }
}

/// A span's fields as JSON (`{"rpc":"Acquire","trace_id":"4bf9…"}`), as
/// tracing-subscriber's [`JsonFields`] writes them, but a field recorded
/// later is appended to the object. `JsonFields` parses the object and
/// writes it all again on every `record`, and each call's span records
/// three or four fields after it starts (the trace id, the caller's span
/// id, the namespace, the outcome), whether or not a line is ever logged
/// in it. A field recorded a second time still goes the parsing way, which
/// replaces its value: the object never holds a key twice (`TraceIdFirst`
/// reads the first `trace_id` in it).
struct AppendedJsonFields;

impl<'w> FormatFields<'w> for AppendedJsonFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> stdfmt::Result {
        JsonFields::new().format_fields(writer, fields)
    }

    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &span::Record<'_>,
    ) -> stdfmt::Result {
        let mut present = KeyPresent {
            object: &current.fields,
            found: false,
        };
        fields.record(&mut present);
        // (A new span's fields are at least `{}`: empty only defensively.)
        if current.fields.is_empty() || present.found {
            let mut parsed =
                FormattedFields::<JsonFields>::new(std::mem::take(&mut current.fields));
            let added = JsonFields::new().add_fields(&mut parsed, fields);
            current.fields = parsed.fields;
            return added;
        }
        let mut added = String::new();
        JsonFields::new().format_fields(Writer::new(&mut added), fields)?;
        // Both are objects: `{…}` and `{…}`, or `{}` when every field
        // recorded is empty.
        let new = added
            .strip_prefix('{')
            .and_then(|rest| rest.strip_suffix('}'))
            .ok_or(stdfmt::Error)?;
        if !current.fields.ends_with('}') {
            return Err(stdfmt::Error);
        }
        if new.is_empty() {
            return Ok(());
        }
        current.fields.pop();
        if !current.fields.ends_with('{') {
            current.fields.push(',');
        }
        current.fields.push_str(new);
        current.fields.push('}');
        Ok(())
    }
}

/// Whether a record names a field the JSON `object` may hold already: its
/// key, `"name":`, appears in it. (It errs on the parsing side: a key of a
/// nested object, or one holding an escaped quote, can match too.) A raw
/// identifier's key is written without its `r#`.
struct KeyPresent<'a> {
    object: &'a str,
    found: bool,
}

impl Visit for KeyPresent<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, _: &dyn stdfmt::Debug) {
        let name = field.name();
        let written = name.strip_prefix("r#").unwrap_or(name);
        self.found |= [name, written].iter().any(|key| {
            self.object.match_indices(key).any(|(at, _)| {
                self.object[..at].ends_with('"') && self.object[at + key.len()..].starts_with("\":")
            })
        });
    }
}

/// The `trace_id` among a span's fields, as the JSON field formatter wrote
/// them (`{"rpc":"Acquire","trace_id":"4bf9…"}`): 32 hex digits, copied.
fn trace_id_in(fields: &str) -> Option<[u8; 32]> {
    const KEY: &str = "\"trace_id\":\"";
    let start = fields.find(KEY)? + KEY.len();
    let id: [u8; 32] = fields.as_bytes().get(start..start + 32)?.try_into().ok()?;
    id.iter().all(u8::is_ascii_hexdigit).then_some(id)
}

/// The filter `--log-level` asks for, with audit lines kept whatever the
/// level unless it names the audit target itself.
fn filter(log_level: &str) -> EnvFilter {
    let filter = EnvFilter::try_new(log_level).unwrap_or_else(|error| {
        eprintln!("invalid log level {log_level:?} ({error}); using info");
        EnvFilter::new("info")
    });
    if log_level.contains(AUDIT_TARGET) {
        return filter;
    }
    filter.add_directive(
        format!("{AUDIT_TARGET}=info")
            .parse()
            .expect("a valid directive"),
    )
}

/// Request durations: from 100 µs to 10 s, roughly three buckets per decade.
const DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Calls per statement: powers of two up to the largest batch.
const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Proof that the process's metrics recorder is installed, and its handle
/// (to render `/metrics`).
///
/// A metric handle registered before the recorder is installed records
/// nowhere, for good, and a gauge set then is lost: whatever registers its
/// handles or sets its gauges once, when it is built (the replay cache's
/// counters, the memory budget's gauges, the security files' gauges), would
/// silently never count. Such a part takes a `&MetricsRecorder` in its
/// constructor, so it cannot be built first.
#[derive(Clone)]
pub struct MetricsRecorder(PrometheusHandle);

impl MetricsRecorder {
    /// Installs the recorder, or finds the one installed (see [`metrics_handle`]).
    pub fn install() -> Self {
        Self(metrics_handle())
    }

    pub fn handle(&self) -> &PrometheusHandle {
        &self.0
    }
}

/// The process-wide Prometheus recorder, installed on first use. A process
/// has one global recorder, so every server in it (tests start many) shares it.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(DURATION_BUCKETS)
                .expect("bucket list is not empty")
                .set_buckets_for_metric(
                    Matcher::Full(crate::metrics::DB_BATCH_SIZE.to_owned()),
                    BATCH_SIZE_BUCKETS,
                )
                .expect("bucket list is not empty")
                .set_buckets_for_metric(
                    Matcher::Full(crate::metrics::BATCH_ITEMS.to_owned()),
                    BATCH_SIZE_BUCKETS,
                )
                .expect("bucket list is not empty")
                .install_recorder()
                .expect("no other metrics recorder is installed");
            crate::metrics::describe();
            handle
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn json_lines_within_a_call_start_with_its_trace_id() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = json_subscriber(move || writer.clone());
        let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!("outside");
            tracing::error_span!("rpc", rpc = "Acquire", trace_id).in_scope(|| {
                tracing::info!(key = "k", "in the call");
                tracing::info_span!("statement").in_scope(|| tracing::warn!("deeper"));
            });
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        let outside: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert!(outside.get("trace_id").is_none(), "{outside}");
        for line in &lines[1..] {
            assert!(
                line.starts_with(&format!("{{\"trace_id\":\"{trace_id}\",")),
                "{line}"
            );
            let parsed: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(parsed["trace_id"], trace_id);
        }
        let inner: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(inner["key"], "k");
        assert_eq!(inner["span"]["rpc"], "Acquire");
    }

    /// The server's JSON subscriber, writing to `writer`.
    fn json_subscriber<W>(writer: W) -> impl Subscriber + Send + Sync
    where
        W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
    {
        json(fmt().with_writer(writer)).finish()
    }

    /// The span fields `AppendedJsonFields` stored for `span`, as written
    /// (before any line's parser could fold a repeated key).
    fn stored_fields(span: &tracing::Span) -> String {
        use tracing_subscriber::registry::Registry;
        let id = span.id().expect("an enabled span");
        tracing::dispatcher::get_default(|dispatch| {
            let registry = dispatch.downcast_ref::<Registry>().expect("the registry");
            let span = registry.span(&id).expect("the span");
            let extensions = span.extensions();
            let fields = extensions
                .get::<FormattedFields<AppendedJsonFields>>()
                .expect("formatted fields");
            fields.fields.clone()
        })
    }

    /// Each key in a JSON object as written, in order.
    fn keys(object: &str) -> Vec<String> {
        let parsed: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(object).unwrap_or_else(|_| panic!("a JSON object: {object}"));
        let mut keys: Vec<String> = parsed.keys().cloned().collect();
        keys.sort();
        let written = keys
            .iter()
            .map(|key| object.matches(&format!("\"{key}\":")).count())
            .sum::<usize>();
        assert_eq!(written, keys.len(), "a key written twice: {object}");
        keys
    }

    /// Fields recorded after the span started are stored once each, with
    /// their last value, whether appended or parsed and written again; a
    /// trace id recorded again is the one the line starts with.
    #[test]
    fn span_fields_recorded_later_are_stored_once_with_their_last_value() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = json_subscriber(move || writer.clone());
        let stored = tracing::subscriber::with_default(subscriber, || {
            let span = tracing::error_span!(
                "rpc",
                rpc = "Acquire",
                trace_id = tracing::field::Empty,
                namespace = tracing::field::Empty,
                outcome = tracing::field::Empty,
                r#type = tracing::field::Empty,
                note = tracing::field::Empty,
            );
            span.record("trace_id", "00000000000000000000000000000001");
            span.record("namespace", "payments");
            span.record("trace_id", "4bf92f3577b34da6a3ce929d0e0e4736");
            span.record("outcome", "first");
            span.record("outcome", "acquired");
            span.record("type", tracing::field::display("a"));
            span.record("type", tracing::field::display("b"));
            // Escaped on the appended path.
            span.record("note", "\"namespace\": a value, \\ \u{1}");
            span.in_scope(|| tracing::warn!("inside"));
            stored_fields(&span)
        });
        assert_eq!(
            keys(&stored),
            ["namespace", "note", "outcome", "rpc", "trace_id", "type"]
        );
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let line = text.lines().next().expect("a line");
        let parsed: serde_json::Value = serde_json::from_str(line).unwrap();
        let span = &parsed["span"];
        assert_eq!(span["rpc"], "Acquire", "{line}");
        assert_eq!(span["namespace"], "payments", "{line}");
        assert_eq!(span["outcome"], "acquired", "{line}");
        assert_eq!(span["type"], "b", "{line}");
        assert_eq!(span["note"], "\"namespace\": a value, \\ \u{1}", "{line}");
        assert!(
            line.starts_with(r#"{"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","#),
            "{line}"
        );
    }

    /// A span that starts with no fields (`{}`) takes its first by
    /// appending, without a comma; a record of empty fields adds nothing.
    #[test]
    fn a_span_without_fields_takes_its_first_and_ignores_empty_ones() {
        let subscriber = json_subscriber(std::io::sink);
        let stored = tracing::subscriber::with_default(subscriber, || {
            let span = tracing::error_span!(
                "bare",
                first = tracing::field::Empty,
                second = tracing::field::Empty
            );
            let before = stored_fields(&span);
            span.record("first", tracing::field::Empty);
            span.record("first", 1);
            span.record("second", "two");
            (before, stored_fields(&span))
        });
        assert_eq!(stored.0, "{}");
        assert_eq!(stored.1, r#"{"first":1,"second":"two"}"#);
    }

    #[test]
    fn a_trace_id_is_found_only_as_32_hex_digits() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let found = trace_id_in(&format!(r#"{{"rpc":"Get","trace_id":"{id}"}}"#));
        assert_eq!(found.as_ref().map(|id| &id[..]), Some(id.as_bytes()));
        assert_eq!(trace_id_in(r#"{"trace_id":"short"}"#), None);
        assert_eq!(trace_id_in(r#"{"rpc":"Get"}"#), None);
    }
}
