//! `idempotencyd admin`: operator commands straight on the database (the gRPC
//! API has no purge on purpose: only operators with database access may free
//! a key). Text for people, `--json` for scripts.
//!
//! Every purge leaves an audit line (log target [`AUDIT_TARGET`], event
//! `admin_purge`): who ran it, what it matched and deleted, on which
//! database, or why it deleted nothing. A purge of more than one record is
//! confirmed first ([`Confirm`]).

use std::{
    io::{BufRead, IsTerminal, Write},
    time::Duration,
};

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::{
    domain::{RecordFilter, RecordId, Timestamp},
    settings::{AdminCommand, PurgeArgs, RecordIdArgs},
    store::{
        StoreError,
        admin::{self, PurgeLimits},
        stats,
    },
    telemetry::AUDIT_TARGET,
};

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(transparent)]
    InvalidId(#[from] crate::domain::InvalidField),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("no record has this id")]
    NotFound,
    #[error("no record matches")]
    NoMatch,
    #[error("not purging {matched} records: {reason}")]
    NotConfirmed { matched: u64, reason: &'static str },
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
}

fn record_id(args: RecordIdArgs) -> Result<RecordId, AdminError> {
    Ok(RecordId::parse(
        "record",
        args.namespace,
        args.operation,
        args.subject,
        args.key,
    )?)
}

fn time(at: Option<Timestamp>) -> Value {
    at.map_or(Value::Null, |at| json!(at.to_rfc3339()))
}

/// The operator's answer to "delete these records?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Yes,
    No,
    /// Nobody can be asked (stdin is not a terminal).
    NoTerminal,
}

/// Asks the operator before a purge of more than one record.
pub trait Confirm {
    fn ask(&mut self, question: &str) -> Answer;
}

impl<F: FnMut(&str) -> Answer> Confirm for F {
    fn ask(&mut self, question: &str) -> Answer {
        self(question)
    }
}

/// Asks on the terminal: the question on stderr, the answer from stdin,
/// where only `yes` confirms. Without a terminal on stdin nobody is asked.
pub struct Terminal;

impl Confirm for Terminal {
    fn ask(&mut self, question: &str) -> Answer {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Answer::NoTerminal;
        }
        eprint!("{question} ");
        let _ = std::io::stderr().flush();
        let mut line = String::new();
        match stdin.lock().read_line(&mut line) {
            Ok(_) if line.trim() == "yes" => Answer::Yes,
            _ => Answer::No,
        }
    }
}

/// Runs one admin command and writes its answer to `out`; `confirm` is
/// asked before a purge of more than one record without `--yes`.
pub async fn run(
    pool: &PgPool,
    command: AdminCommand,
    as_json: bool,
    out: &mut impl Write,
    confirm: &mut impl Confirm,
) -> Result<(), AdminError> {
    let answer = match command {
        AdminCommand::Get(args) => get(pool, record_id(args)?).await?,
        AdminCommand::Purge(args) => purge(pool, args, confirm).await?,
        AdminCommand::Stuck { older_than, limit } => stuck(pool, older_than, limit).await?,
        AdminCommand::Stats => stats(pool).await?,
    };
    if as_json {
        writeln!(out, "{answer}")?;
    } else {
        write_text(&answer, out)?;
    }
    Ok(())
}

/// `admin get`: one record's state, times, token and response size.
async fn get(pool: &PgPool, id: RecordId) -> Result<Value, AdminError> {
    let (row, response_bytes) = admin::get(pool, &id).await?.ok_or(AdminError::NotFound)?;
    Ok(json!({
        "namespace": id.namespace(),
        "operation": id.operation(),
        "subject": id.subject(),
        "key": id.key(),
        "state": row.state,
        "expired": row.is_expired(),
        "fencing_token": row.fencing_token,
        "created_at": time(Some(row.created_at)),
        "expires_at": time(Some(row.expires_at)),
        "lease_expires_at": time(row.lease_expires_at),
        "completed_at": time(row.completed_at),
        "response_status": row.response_status,
        "response_bytes": response_bytes,
    }))
}

/// `admin stuck`: in-progress records whose lease passed `older_than` ago.
async fn stuck(pool: &PgPool, older_than: Duration, limit: i64) -> Result<Value, AdminError> {
    let records = admin::stuck(pool, older_than, limit).await?;
    Ok(Value::Array(
        records
            .into_iter()
            .map(|r| {
                json!({
                    "namespace": r.namespace, "operation": r.operation, "subject": r.subject,
                    "key": r.key, "fencing_token": r.fencing_token,
                    "lease_expires_at": time(Some(r.lease_expires_at)),
                    "created_at": time(Some(r.created_at)),
                    "expires_at": time(Some(r.expires_at)),
                })
            })
            .collect(),
    ))
}

/// `admin stats`: records by namespace and state, and the table's size.
async fn stats(pool: &PgPool) -> Result<Value, AdminError> {
    let counts = admin::counts(pool).await?;
    let table = stats::table_stats(pool).await?;
    Ok(json!({
        "table_bytes": table.total_bytes,
        "reaper_backlog_seconds": table.reaper_backlog_seconds,
        "records": counts.into_iter().map(|c| json!({
            "namespace": c.namespace, "state": c.state, "live": c.live, "expired": c.expired,
        })).collect::<Vec<_>>(),
    }))
}

/// `admin purge`: one record by its full id, or the records a filter
/// matches, counted and confirmed first when more than one.
async fn purge(
    pool: &PgPool,
    args: PurgeArgs,
    confirm: &mut impl Confirm,
) -> Result<Value, AdminError> {
    let operator = args
        .operator
        .clone()
        .unwrap_or_else(|| operator_from(|name| std::env::var(name).ok(), process_uid()));
    let who = Operator {
        name: &operator,
        database: &database_of(pool),
    };
    match (&args.operation, &args.key) {
        (Some(operation), Some(key)) => {
            let id = RecordId::parse(
                "record",
                args.namespace.clone(),
                operation.clone(),
                args.subject.clone().unwrap_or_default(),
                key.clone(),
            )?;
            purge_one(pool, &id, who).await
        }
        _ => {
            let filter = RecordFilter::parse(
                "filter",
                args.namespace,
                args.operation,
                args.subject,
                args.key,
            )?;
            purge_matching(pool, &filter, args.yes, who, confirm).await
        }
    }
}

/// Purges the record `id`, audited.
async fn purge_one(pool: &PgPool, id: &RecordId, who: Operator<'_>) -> Result<Value, AdminError> {
    let audit = who.audit(
        id.namespace(),
        Some(id.operation()),
        Some(id.subject()),
        Some(id.key()),
    );
    let purged = admin::purge(pool, id).await;
    match &purged {
        Ok(purged) => audit.purged(None, u64::from(*purged)),
        Err(error) => audit.failed(0, error),
    }
    if !purged? {
        return Err(AdminError::NotFound);
    }
    Ok(json!({
        "purged": true, "deleted": 1,
        "namespace": id.namespace(), "operation": id.operation(),
        "subject": id.subject(), "key": id.key(),
    }))
}

/// Purges the records `filter` matches, audited: counted first, and more
/// than one only when `yes` or the operator confirms.
async fn purge_matching(
    pool: &PgPool,
    filter: &RecordFilter,
    yes: bool,
    who: Operator<'_>,
    confirm: &mut impl Confirm,
) -> Result<Value, AdminError> {
    let audit = who.audit(
        filter.namespace(),
        filter.operation(),
        filter.subject(),
        filter.key(),
    );
    let (matched, counted_at) = admin::count_matching(pool, filter)
        .await
        .inspect_err(|error| audit.failed(0, error))?;
    if matched == 0 {
        audit.purged(Some(0), 0);
        return Err(AdminError::NoMatch);
    }
    if matched > 1 && !yes {
        let refused = match confirm.ask(&question(filter, matched)) {
            Answer::Yes => None,
            Answer::No => Some("the answer was not yes"),
            Answer::NoTerminal => {
                Some("stdin is not a terminal to ask on (pass --yes to purge without asking)")
            }
        };
        if let Some(reason) = refused {
            audit.refused(matched, reason);
            return Err(AdminError::NotConfirmed { matched, reason });
        }
    }
    let mut deleted = 0;
    let limits = PurgeLimits::default();
    let result = admin::purge_matching(pool, filter, counted_at, &limits, &mut deleted).await;
    match &result {
        Ok(()) => audit.purged(Some(matched), deleted),
        Err(error) => audit.failed(deleted, error),
    }
    result?;
    Ok(json!({
        "purged": deleted > 0, "deleted": deleted, "matched": matched,
        "namespace": filter.namespace(), "operation": filter.operation(),
        "subject": filter.subject(), "key": filter.key(),
    }))
}

/// "delete 1234 records of namespace payments, operation "POST /x"? type yes:"
fn question(filter: &RecordFilter, matched: u64) -> String {
    let mut question = format!(
        "delete {matched} records of namespace {}",
        filter.namespace()
    );
    for (name, value) in [
        ("operation", filter.operation()),
        ("subject", filter.subject()),
        ("key", filter.key()),
    ] {
        if let Some(value) = value {
            question.push_str(&format!(", {name} {value:?}"));
        }
    }
    question.push_str("? type yes:");
    question
}

/// Who runs the command: $USER or $LOGNAME, else `uid:<n>`.
fn operator_from(env: impl Fn(&str) -> Option<String>, uid: Option<u32>) -> String {
    ["USER", "LOGNAME"]
        .into_iter()
        .filter_map(env)
        .find(|name| !name.is_empty())
        .unwrap_or_else(|| uid.map_or_else(|| "unknown".to_owned(), |uid| format!("uid:{uid}")))
}

/// The real uid of this process, from `/proc/self/status` (Linux).
fn process_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    uid_in(&status)
}

fn uid_in(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `host:port/database` of the pool (never the password).
fn database_of(pool: &PgPool) -> String {
    let options = pool.connect_options();
    let host = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    let database = options
        .get_database()
        .unwrap_or_else(|| options.get_username());
    format!("{host}/{database}")
}

/// Who purges, on which database: what every audit line names.
#[derive(Clone, Copy)]
struct Operator<'a> {
    name: &'a str,
    database: &'a str,
}

impl<'a> Operator<'a> {
    fn audit(
        self,
        namespace: &str,
        operation: Option<&str>,
        subject: Option<&str>,
        key: Option<&str>,
    ) -> Audit<'a> {
        Audit {
            operator: self.name,
            database: self.database,
            namespace: namespace.to_owned(),
            operation: operation.map(str::to_owned),
            subject: subject.map(str::to_owned),
            key: key.map(str::to_owned),
        }
    }
}

/// The audit line of one purge: who, where, which records.
struct Audit<'a> {
    operator: &'a str,
    database: &'a str,
    namespace: String,
    operation: Option<String>,
    subject: Option<String>,
    key: Option<String>,
}

impl Audit<'_> {
    fn purged(&self, matched: Option<u64>, deleted: u64) {
        self.write("purged", matched, deleted, None);
    }

    fn refused(&self, matched: u64, reason: &str) {
        self.write("refused", Some(matched), 0, Some(reason));
    }

    fn failed(&self, deleted: u64, error: &StoreError) {
        self.write("failed", None, deleted, Some(&error.to_string()));
    }

    fn write(&self, outcome: &str, matched: Option<u64>, deleted: u64, reason: Option<&str>) {
        tracing::info!(
            target: AUDIT_TARGET,
            event = "admin_purge",
            outcome,
            operator = self.operator,
            database = self.database,
            namespace = self.namespace,
            operation = self.operation.as_deref(),
            subject = self.subject.as_deref(),
            key = self.key.as_deref(),
            matched,
            deleted,
            reason,
            "admin purge"
        );
    }
}

/// One `name  value` line per field; a list as one block per item.
fn write_text(answer: &Value, out: &mut impl Write) -> std::io::Result<()> {
    match answer {
        Value::Array(items) if items.is_empty() => writeln!(out, "(none)"),
        Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    writeln!(out)?;
                }
                write_text(item, out)?;
            }
            Ok(())
        }
        Value::Object(fields) => {
            let width = fields.keys().map(String::len).max().unwrap_or(0);
            for (name, value) in fields {
                match value {
                    Value::Array(items) => {
                        writeln!(out, "{name}:")?;
                        for item in items {
                            let line: Vec<String> = item
                                .as_object()
                                .map(|o| {
                                    o.iter().map(|(k, v)| format!("{k}={}", plain(v))).collect()
                                })
                                .unwrap_or_default();
                            writeln!(out, "  {}", line.join("  "))?;
                        }
                    }
                    _ => writeln!(out, "{name:width$}  {}", plain(value))?,
                }
            }
            Ok(())
        }
        other => writeln!(out, "{}", plain(other)),
    }
}

fn plain(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operator_is_the_user_else_the_login_name_else_the_uid() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(var, _)| *var == name)
                    .map(|(_, value)| (*value).to_owned())
            }
        };
        assert_eq!(
            operator_from(env(&[("USER", "ana"), ("LOGNAME", "bo")]), Some(7)),
            "ana"
        );
        assert_eq!(
            operator_from(env(&[("USER", ""), ("LOGNAME", "bo")]), Some(7)),
            "bo"
        );
        assert_eq!(operator_from(env(&[]), Some(1000)), "uid:1000");
        assert_eq!(operator_from(env(&[]), None), "unknown");
        let status = "Name:\tidempotencyd\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\n";
        assert_eq!(uid_in(status), Some(1000));
        assert_eq!(uid_in("Name: x\n"), None);
    }

    #[test]
    fn the_question_names_the_count_and_the_filter() {
        let filter = RecordFilter::parse(
            "filter",
            "payments".into(),
            Some("POST /x".into()),
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            question(&filter, 1234),
            "delete 1234 records of namespace payments, operation \"POST /x\"? type yes:"
        );
    }
}
