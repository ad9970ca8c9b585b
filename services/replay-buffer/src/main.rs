fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main(
        "jetrl replay buffer: the group state machine and the sampling policy",
        jetrl_replay_buffer::run,
    )
}
