use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use idempotency_server::{
    admin, db,
    maintenance::{self},
    settings::{Cli, Command, DatabaseArgs},
    shutdown,
    startup::{Application, ServerConfig},
    telemetry,
};

/// A pool held to index lookups (serving, reaping), or not: migrations (a
/// backfill reads every row) and the admin CLI's `stats` read whole tables.
fn connect(database: &DatabaseArgs, index_lookups_only: bool) -> anyhow::Result<sqlx::PgPool> {
    let settings = db::PoolSettings {
        index_lookups_only,
        ..database.pool_settings()
    };
    pool_with(database, &settings)
}

/// Migrations run without the serving pool's statement timeout (5 s by
/// default), which would cut a long migration or the wait for another
/// pod's run short.
async fn migrate(database: &DatabaseArgs) -> anyhow::Result<()> {
    let settings = db::PoolSettings {
        index_lookups_only: false,
        statement_timeout: database
            .statement_timeout
            .max(db::MIGRATION_STATEMENT_TIMEOUT),
        ..database.pool_settings()
    };
    let pool = pool_with(database, &settings)?;
    db::migrate(&pool).await.context("applying migrations")?;
    pool.close().await;
    Ok(())
}

fn pool_with(database: &DatabaseArgs, settings: &db::PoolSettings) -> anyhow::Result<sqlx::PgPool> {
    Ok(db::pool(
        database.connect_options().context("parsing DATABASE_URL")?,
        settings,
    ))
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
            tracing::info!(database = %args.database.database_url.redacted(), "starting");
            let pool = connect(&args.database, true)?;
            if args.migrate {
                migrate(&args.database).await?;
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
            migrate(&args.database).await?;
            tracing::info!(database = %args.database.database_url.redacted(), "migrations applied");
        }
        Command::Reap(args) => {
            telemetry::init_logs(&args.log);
            let pool = connect(&args.database, true)?;
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
            let pool = connect(&args.database, false)?;
            let mut out = std::io::stdout().lock();
            if let Err(error) = admin::run(&pool, args.command, args.json, &mut out).await {
                eprintln!("idempotencyd admin: {error}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
