use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use idempotency_server::{
    admin, maintenance,
    settings::{AdminArgs, Cli, Command, MigrateArgs, ReapArgs, Settings},
    shutdown,
    startup::{self, Application},
    telemetry,
};

fn main() -> anyhow::Result<ExitCode> {
    let command = Cli::parse().into_command();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Command::Serve(settings) = &command
        && let Some(threads) = settings.worker_threads
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
        Command::Serve(settings) => serve(*settings).await,
        Command::Migrate(args) => migrate(args).await,
        Command::Reap(args) => reap(args).await,
        Command::Admin(args) => admin(args).await,
    }
}

async fn serve(settings: Settings) -> anyhow::Result<ExitCode> {
    let _telemetry = telemetry::init_serve_logs(&settings.log, settings.otlp_endpoint.as_ref())?;
    Application::build(settings)
        .await?
        .run_until_stopped(shutdown::signal())
        .await?;
    Ok(ExitCode::SUCCESS)
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<ExitCode> {
    telemetry::init_logs(&args.log);
    let (url, options) = startup::database_url(&args.database)?;
    startup::migrate(&args.database, options).await?;
    tracing::info!(database = %url.redacted(), "migrations applied");
    Ok(ExitCode::SUCCESS)
}

async fn reap(args: ReapArgs) -> anyhow::Result<ExitCode> {
    telemetry::init_logs(&args.log);
    let (_, options) = startup::database_url(&args.database)?;
    let pool = startup::pool(&args.database, options, true);
    let settings = args.reaper.settings();
    if !args.once {
        tokio::select! {
            () = maintenance::run_reaper(pool, settings) => {}
            () = shutdown::signal() => {}
        }
        return Ok(ExitCode::SUCCESS);
    }
    // The run's outcome is logged by `reap`; the exit status tells the CronJob.
    match maintenance::reap(&pool, &settings.limits).await {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(_) => Ok(ExitCode::FAILURE),
    }
}

async fn admin(args: AdminArgs) -> anyhow::Result<ExitCode> {
    // stdout is the command's answer; logs and audit lines go to stderr.
    telemetry::init_logs_to_stderr(&args.log);
    let (_, options) = startup::database_url(&args.database)?;
    let pool = startup::pool(&args.database, options, false);
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
    Ok(ExitCode::SUCCESS)
}
