fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main(
        "jetrl checkpoint-sync: weight versions and weight distribution",
        jetrl_checkpoint_sync::run,
    )
}
