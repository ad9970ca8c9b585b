fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main(
        "jetrl reward service: scores trajectories",
        |cfg| cfg.reward.tokio_threads,
        jetrl_reward_service::run,
    )
}
