fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main("jetrl reward service: scores trajectories", jetrl_reward_service::run)
}
