fn main() -> anyhow::Result<()> {
    jetrl_trainer::keep_freed_memory_in_heap();
    jetrl_telemetry::service_main(
        "jetrl trainer: owns the policy, the optimizer and the step counter",
        jetrl_trainer::run,
    )
}
