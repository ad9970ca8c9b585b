//! What every service's `main` shares: the shutdown signal, [`service_main`], the tokio runtime and the torch
//! thread counts.

use crate::init_tracing;

/// A cloneable shutdown signal fanned out from one future (SIGINT/SIGTERM in `main`, a test's trigger in
/// tests): every task of a service selects on [`Shutdown::wait`].
#[derive(Clone)]
pub struct Shutdown {
    rx: tokio::sync::watch::Receiver<bool>,
}

impl Shutdown {
    /// Fires when `trigger` resolves.
    pub fn new(trigger: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            trigger.await;
            let _ = tx.send(true);
        });
        Self { rx }
    }

    /// Resolves once shutdown has been requested (immediately if it already was).
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// [`Shutdown::wait`] as a future that owns its signal (for a task that outlives the borrow: a server).
    pub fn waiter(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let shutdown = self.clone();
        async move { shutdown.wait().await }
    }

    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The exit status of a service whose error no restart can cure (a bad configuration, a dataset that is not
/// there): sysexits' `EX_CONFIG`. `jetrl run` ends the job on it instead of restarting the service.
pub const EXIT_PERMANENT: i32 = 78;

/// A service's error, and whether it is permanent ([`EXIT_PERMANENT`]).
pub trait ServiceError: std::error::Error + Send + Sync + 'static {
    /// Whether starting the service again with the same job would fail the same way.
    fn is_permanent(&self) -> bool {
        false
    }
}

/// The whole `main` of a jetrl service: parse `--config FILE` and `section.key=value` overrides, load and
/// validate the job configuration (errors name the key), set up tracing, then run the service on a tokio
/// runtime with `tokio_threads(&cfg)` worker threads (null: one per core) until SIGINT/SIGTERM.
pub fn service_main<Fut, E>(
    about: &'static str,
    tokio_threads: fn(&jetrl_config::JobConfig) -> Option<u32>,
    run: impl FnOnce(jetrl_config::JobConfig, std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) -> Fut,
) -> anyhow::Result<()>
where
    Fut: std::future::Future<Output = Result<(), E>>,
    E: ServiceError,
{
    let name = std::env::args().next().and_then(|p| p.rsplit('/').next().map(str::to_string)).unwrap_or_default();
    let matches = clap::Command::new("jetrl-service")
        .bin_name(name)
        .about(about)
        .version(env!("CARGO_PKG_VERSION"))
        .arg(clap::Arg::new("config").long("config").short('c').value_name("FILE").help("job configuration (YAML)"))
        .arg(clap::Arg::new("overrides").num_args(0..).value_name("KEY=VALUE").help("overrides, `section.key=value`"))
        .get_matches();
    let config = matches.get_one::<String>("config").map(std::path::PathBuf::from);
    let overrides: Vec<String> =
        matches.get_many::<String>("overrides").map(|v| v.cloned().collect()).unwrap_or_default();
    let cfg = match jetrl_config::JobConfig::load(config.as_deref(), &overrides) {
        Ok(cfg) => cfg,
        Err(err) => {
            eprintln!("Error: {err}");
            std::process::exit(EXIT_PERMANENT);
        }
    };
    init_tracing(&cfg.log.level, cfg.log.format);
    let workers = tokio_threads(&cfg);
    let runtime = runtime(workers)?;
    tracing::info!(tokio_threads = workers.map_or_else(|| "one per core".to_string(), |n| n.to_string()), "runtime");
    match runtime.block_on(run(cfg, Box::pin(shutdown_signal()))) {
        Ok(()) => Ok(()),
        Err(err) if err.is_permanent() => {
            tracing::error!(error = %err, "stopping: a permanent error (exit status {EXIT_PERMANENT}: not to be restarted)");
            eprintln!("Error: {err}");
            drop(runtime);
            std::process::exit(EXIT_PERMANENT);
        }
        Err(err) => Err(err.into()),
    }
}

/// A multi-threaded tokio runtime with `worker_threads` workers (null: tokio's default, one per core).
pub fn runtime(worker_threads: Option<u32>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(n) = worker_threads {
        builder.worker_threads(n.max(1) as usize);
    }
    builder.build()
}

/// The cores this process may use (its CPU affinity and cgroup quota), at least 1.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// The torch thread counts a service applies before any tensor work (this crate does not link torch: the
/// trainer and the rollout worker call `tch::set_num_threads` / `tch::set_num_interop_threads` with these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TorchThreads {
    /// intra-op threads; None = leave torch to read `OMP_NUM_THREADS` itself
    pub intra_op: Option<usize>,
    /// inter-op threads; None = torch's default
    pub inter_op: Option<usize>,
}

impl TorchThreads {
    /// What the `<section>.torch_threads` / `torch_interop_threads` keys mean: an explicit value wins; a null
    /// intra-op count is `OMP_NUM_THREADS` when that is set (torch reads it), else every core this process may
    /// use (torch alone would count the host's cores, ignoring a container's quota); a null inter-op count is 1
    /// on the CPU, where jetrl runs no parallel graph for those threads to serve.
    pub fn resolve(
        intra_op: Option<u32>,
        inter_op: Option<u32>,
        on_cpu: bool,
        omp_num_threads_set: bool,
        cores: usize,
    ) -> Self {
        let intra_op = match intra_op {
            Some(n) => Some(n.max(1) as usize),
            None if omp_num_threads_set => None,
            None => Some(cores.max(1)),
        };
        let inter_op = inter_op.map(|n| n.max(1) as usize).or(on_cpu.then_some(1));
        Self { intra_op, inter_op }
    }

    /// [`TorchThreads::resolve`] with this process's environment and cores.
    pub fn for_this_process(intra_op: Option<u32>, inter_op: Option<u32>, on_cpu: bool) -> Self {
        let omp = std::env::var_os("OMP_NUM_THREADS").is_some_and(|v| !v.is_empty());
        Self::resolve(intra_op, inter_op, on_cpu, omp, available_cores())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_threads_explicit_values_win_and_nulls_follow_omp_then_the_cores() {
        let resolve = TorchThreads::resolve;
        assert_eq!(resolve(Some(3), Some(2), true, true, 16), TorchThreads { intra_op: Some(3), inter_op: Some(2) });
        assert_eq!(resolve(None, None, true, false, 16), TorchThreads { intra_op: Some(16), inter_op: Some(1) });
        assert_eq!(resolve(None, None, true, true, 16), TorchThreads { intra_op: None, inter_op: Some(1) });
        assert_eq!(resolve(None, None, false, false, 4), TorchThreads { intra_op: Some(4), inter_op: None });
    }

    #[test]
    fn runtime_has_the_configured_worker_threads() {
        let runtime = runtime(Some(3)).unwrap();
        assert_eq!(runtime.metrics().num_workers(), 3);
    }
}
