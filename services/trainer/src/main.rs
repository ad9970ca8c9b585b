use jetrl_telemetry::TorchThreads;

fn main() -> anyhow::Result<()> {
    jetrl_trainer::keep_freed_memory_in_heap();
    jetrl_telemetry::service_main(
        "jetrl trainer: owns the policy, the optimizer and the step counter",
        |cfg| cfg.trainer.tokio_threads,
        |cfg, shutdown| {
            // Before the actor thread does any tensor work: torch fixes a thread's pool size on its first use.
            let on_cpu = matches!(jetrl_model::resolve_device(cfg.model.device), Ok(tch::Device::Cpu));
            let threads =
                TorchThreads::for_this_process(cfg.trainer.torch_threads, cfg.trainer.torch_interop_threads, on_cpu);
            jetrl_model::set_torch_threads(threads.intra_op, threads.inter_op);
            jetrl_trainer::run(cfg, shutdown)
        },
    )
}
