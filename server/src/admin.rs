//! `idempotencyd admin`: operator commands straight on the database (the gRPC
//! API has no purge on purpose: only operators with database access may free
//! a key). Text for people, `--json` for scripts.

use std::io::Write;

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::{
    domain::{RecordId, Timestamp},
    settings::{AdminCommand, RecordIdArgs},
    store::{StoreError, admin, stats},
};

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(transparent)]
    InvalidId(#[from] crate::domain::InvalidField),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("no record has this id")]
    NotFound,
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

/// Runs one admin command and writes its answer to `out`.
pub async fn run(
    pool: &PgPool,
    command: AdminCommand,
    as_json: bool,
    out: &mut impl Write,
) -> Result<(), AdminError> {
    let answer = match command {
        AdminCommand::Get(args) => {
            let id = record_id(args)?;
            let (row, response_bytes) = admin::get(pool, &id).await?.ok_or(AdminError::NotFound)?;
            json!({
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
            })
        }
        AdminCommand::Purge(args) => {
            let id = record_id(args)?;
            if !admin::purge(pool, &id).await? {
                return Err(AdminError::NotFound);
            }
            json!({ "purged": true, "namespace": id.namespace(), "operation": id.operation(),
                    "subject": id.subject(), "key": id.key() })
        }
        AdminCommand::Stuck { older_than, limit } => {
            let records = admin::stuck(pool, older_than, limit).await?;
            Value::Array(
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
            )
        }
        AdminCommand::Stats => {
            let counts = admin::counts(pool).await?;
            let table = stats::table_stats(pool).await?;
            json!({
                "table_bytes": table.total_bytes,
                "reaper_backlog_seconds": table.reaper_backlog_seconds,
                "records": counts.into_iter().map(|c| json!({
                    "namespace": c.namespace, "state": c.state, "live": c.live, "expired": c.expired,
                })).collect::<Vec<_>>(),
            })
        }
    };
    if as_json {
        writeln!(out, "{answer}")?;
    } else {
        write_text(&answer, out)?;
    }
    Ok(())
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
