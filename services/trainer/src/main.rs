use jetrl_telemetry::TorchThreads;

fn main() -> anyhow::Result<()> {
    jetrl_trainer::keep_freed_memory_in_heap();
    jetrl_telemetry::service_main(
        "jetrl trainer: owns the policy, the optimizer and the step counter",
        |cfg| cfg.trainer.tokio_threads,
        |cfg, shutdown| {
            // Before the actor thread does any tensor work: torch fixes a thread's pool size on its first use.
            let on_cpu = matches!(jetrl_model::resolve_device(cfg.model.device), Ok(tch::Device::Cpu));
            set_torch_threads(TorchThreads::for_this_process(
                cfg.trainer.torch_threads,
                cfg.trainer.torch_interop_threads,
                on_cpu,
            ));
            jetrl_trainer::run(cfg, shutdown)
        },
    )
}

fn set_torch_threads(threads: TorchThreads) {
    if let Some(n) = threads.intra_op {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    if let Some(n) = threads.inter_op {
        tch::set_num_interop_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    tracing::info!(
        torch_threads = tch::get_num_threads(),
        torch_interop_threads = tch::get_num_interop_threads(),
        "torch threads"
    );
}
