use clap::Parser;

/// jetrl trainer: owns the policy, the optimizer and the step counter.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// job configuration (YAML)
    #[arg(long, short)]
    config: Option<std::path::PathBuf>,
    /// overrides, `section.key=value`
    overrides: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    jetrl_trainer::keep_freed_memory_in_heap();
    let args = Args::parse();
    let cfg = jetrl_config::JobConfig::load(args.config.as_deref(), &args.overrides)?;
    jetrl_telemetry::init_tracing(&cfg.log.level, &cfg.log.format);
    jetrl_trainer::run(cfg, jetrl_telemetry::shutdown_signal()).await?;
    Ok(())
}
