use jetrl_telemetry::TorchThreads;

fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main(
        "jetrl rollout worker: generates trajectories for prompt groups",
        |cfg| cfg.rollout.tokio_threads,
        |cfg, shutdown| {
            // Before the engine thread does any tensor work: torch fixes a thread's pool size on its first use.
            let on_cpu = matches!(jetrl_model::resolve_device(cfg.model.device), Ok(tch::Device::Cpu));
            set_torch_threads(TorchThreads::for_this_process(
                cfg.rollout.torch_threads,
                cfg.rollout.torch_interop_threads,
                on_cpu,
            ));
            jetrl_rollout_worker::run(cfg, shutdown)
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
