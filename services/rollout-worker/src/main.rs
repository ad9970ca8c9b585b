fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main(
        "jetrl rollout worker: generates trajectories for prompt groups",
        jetrl_rollout_worker::run,
    )
}
