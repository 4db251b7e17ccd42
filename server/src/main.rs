use anyhow::Context;
use clap::Parser;
use idempotency_server::{
    db,
    settings::{Cli, Command},
    shutdown,
    startup::{Application, ServerConfig},
    telemetry,
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().into_command() {
        Command::Serve(args) => {
            telemetry::init_logs(&args.log);
            tracing::info!(database = %args.database.database_url.redacted(), "starting");
            let pool = db::pool(
                args.database
                    .connect_options()
                    .context("parsing DATABASE_URL")?,
                &args.database.pool_settings(),
            );
            if args.migrate {
                db::migrate(&pool).await.context("applying migrations")?;
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
            let pool = db::pool(
                args.database
                    .connect_options()
                    .context("parsing DATABASE_URL")?,
                &args.database.pool_settings(),
            );
            db::migrate(&pool).await.context("applying migrations")?;
            tracing::info!(database = %args.database.database_url.redacted(), "migrations applied");
        }
    }
    Ok(())
}
