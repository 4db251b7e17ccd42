use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use idempotency_server::{
    admin, db,
    maintenance::{self},
    settings::{Cli, Command, DatabaseArgs, DatabaseUrl},
    shutdown,
    startup::{Application, ServerConfig},
    telemetry,
};
use sqlx::postgres::PgConnectOptions;

/// A pool held to index lookups (serving, reaping), or not: migrations (a
/// backfill reads every row) and the admin CLI's `stats` read whole tables.
fn connect(
    database: &DatabaseArgs,
    options: PgConnectOptions,
    index_lookups_only: bool,
) -> sqlx::PgPool {
    let settings = db::PoolSettings {
        index_lookups_only,
        ..database.pool_settings()
    };
    db::pool(options, &settings)
}

/// Migrations run without the serving pool's statement timeout (5 s by
/// default), which would cut a long migration or the wait for another
/// pod's run short.
async fn migrate(database: &DatabaseArgs, options: PgConnectOptions) -> anyhow::Result<()> {
    let settings = db::PoolSettings {
        index_lookups_only: false,
        statement_timeout: database
            .statement_timeout
            .max(db::MIGRATION_STATEMENT_TIMEOUT),
        ..database.pool_settings()
    };
    let pool = db::pool(options, &settings);
    db::migrate(&pool).await.context("applying migrations")?;
    pool.close().await;
    Ok(())
}

/// The database URL (read from its file once, at start) and its connect
/// options. No error quotes the URL or the file's content.
fn database_url(database: &DatabaseArgs) -> anyhow::Result<(DatabaseUrl, PgConnectOptions)> {
    let url = database.url()?;
    let options = url.connect_options()?;
    Ok((url, options))
}

fn main() -> anyhow::Result<ExitCode> {
    let command = Cli::parse().into_command();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Command::Serve(args) = &command
        && let Some(threads) = args.worker_threads
    {
        runtime.worker_threads(threads.get());
    }
    runtime
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(run(command))
}

async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Serve(args) => {
            telemetry::init_logs(&args.log);
            let (url, options) = database_url(&args.database)?;
            tracing::info!(database = %url.redacted(), "starting");
            let pool = connect(&args.database, options.clone(), true);
            if args.migrate {
                migrate(&args.database, options).await?;
                tracing::info!("migrations applied");
            }
            telemetry::metrics_handle();
            Application::build(ServerConfig::from_args(&args), pool)
                .await?
                .run_until_stopped(shutdown::signal())
                .await?;
        }
        Command::Migrate(args) => {
            telemetry::init_logs(&args.log);
            let (url, options) = database_url(&args.database)?;
            migrate(&args.database, options).await?;
            tracing::info!(database = %url.redacted(), "migrations applied");
        }
        Command::Reap(args) => {
            telemetry::init_logs(&args.log);
            let (_, options) = database_url(&args.database)?;
            let pool = connect(&args.database, options, true);
            let settings = args.reaper.settings();
            if !args.once {
                tokio::select! {
                    () = maintenance::run_reaper(pool, settings) => {}
                    () = shutdown::signal() => {}
                }
                return Ok(ExitCode::SUCCESS);
            }
            // The run's outcome is logged by `reap`; the exit status tells the CronJob.
            if maintenance::reap(&pool, &settings.limits).await.is_err() {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Admin(args) => {
            // stdout is the command's answer; logs and audit lines go to stderr.
            telemetry::init_logs_to(&args.log, std::io::stderr);
            let (_, options) = database_url(&args.database)?;
            let pool = connect(&args.database, options, false);
            let mut out = std::io::stdout().lock();
            let answered = admin::run(
                &pool,
                args.command,
                args.json,
                &mut out,
                &mut admin::Terminal,
            )
            .await;
            if let Err(error) = answered {
                eprintln!("idempotencyd admin: {error}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
