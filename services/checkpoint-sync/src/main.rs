fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main(
        "jetrl checkpoint-sync: weight versions and weight distribution",
        |cfg| cfg.checkpoint.tokio_threads,
        jetrl_checkpoint_sync::run,
    )
}
