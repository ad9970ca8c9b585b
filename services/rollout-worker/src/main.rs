use jetrl_telemetry::TorchThreads;

fn main() -> anyhow::Result<()> {
    jetrl_telemetry::service_main(
        "jetrl rollout worker: generates trajectories for prompt groups",
        |cfg| cfg.rollout.tokio_threads,
        |cfg, shutdown| {
            // Before the engine thread does any tensor work: torch fixes a thread's pool size on its first use.
            let on_cpu = matches!(jetrl_model::resolve_device(cfg.model.device), Ok(tch::Device::Cpu));
            let threads =
                TorchThreads::for_this_process(cfg.rollout.torch_threads, cfg.rollout.torch_interop_threads, on_cpu);
            jetrl_model::set_torch_threads(threads.intra_op, threads.inter_op);
            jetrl_rollout_worker::run(cfg, shutdown)
        },
    )
}
