fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main(
        "jetrl replay buffer: the group state machine and the sampling policy",
        |cfg| cfg.buffer.tokio_threads,
        jetrl_replay_buffer::run,
    )
}
