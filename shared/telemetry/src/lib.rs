//! Logs and metrics for every jetrl service.
//!
//! - [`init_tracing`]: structured `tracing` logs, text or JSON, filtered by `RUST_LOG` or the configured level.
//! - [`serve_metrics`]: a Prometheus `/metrics` endpoint (plus `/healthz`) on a configurable address; port 0
//!   picks a free port, and the bound address is returned and logged so a scraper or a test can find it.
//!
//! The recorder is process-global (the `metrics` facade), so several services started in one test process
//! share it; their names never collide because each carries the `jetrl_<service>_` prefix.

use std::net::SocketAddr;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("metrics endpoint: cannot bind {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
}

pub mod crash;

/// Installs the global tracing subscriber once; later calls are no-ops (tests start many services).
pub fn init_tracing(level: &str, format: jetrl_config::LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if format == jetrl_config::LogFormat::Json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.compact().try_init()
    };
}

/// This machine's host name (`HOSTNAME`, else `/etc/hostname`, else `host`), read once per process.
pub fn host_name() -> &'static str {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.trim().is_empty())
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_string()))
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "host".into())
    })
}

/// How often the recorder drains its histograms' samples into their buckets when nobody scrapes `/metrics`.
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// The process-wide Prometheus recorder, installed on first use. A thread drains the histograms' recorded
/// samples every [`UPKEEP_EVERY`]: without it they pile up until the next scrape, so a service nobody scrapes
/// grows without bound (`just bench soak` measured the reward service at +296% RSS over nine minutes).
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    static UPKEEP: std::sync::Once = std::sync::Once::new();
    let handle = recorder(&HANDLE);
    UPKEEP.call_once(|| {
        let spawned = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || loop {
            std::thread::sleep(UPKEEP_EVERY);
            handle.run_upkeep();
        });
        if let Err(err) = spawned {
            tracing::warn!(error = %err, "metrics upkeep thread not started: histograms drain only on a scrape");
        }
    });
    handle
}

fn recorder(cell: &'static OnceLock<PrometheusHandle>) -> &'static PrometheusHandle {
    cell.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets(&[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ])
            .expect("static bucket list is non-empty");
        match builder.install_recorder() {
            Ok(handle) => handle,
            // Another recorder is already installed (only possible if a host program set one): keep a private
            // one so /metrics still answers.
            Err(_) => PrometheusBuilder::new().build_recorder().handle(),
        }
    })
}

/// Binds `addr` and serves `/metrics` until `shutdown` resolves. Returns the bound address.
pub async fn serve_metrics(
    addr: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<SocketAddr, TelemetryError> {
    let handle = prometheus();
    let listener =
        TcpListener::bind(addr).await.map_err(|source| TelemetryError::Bind { addr: addr.to_string(), source })?;
    let bound = listener.local_addr().map_err(|source| TelemetryError::Bind { addr: addr.to_string(), source })?;
    tracing::info!(%bound, "metrics endpoint listening on http://{bound}/metrics");
    tokio::spawn(async move {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    tokio::spawn(answer(stream, handle));
                }
            }
        }
    });
    Ok(bound)
}

async fn answer(mut stream: tokio::net::TcpStream, handle: &'static PrometheusHandle) {
    let mut buf = vec![0u8; 4096];
    let mut filled = 0;
    // Read the request head (we only need the request line); give up on anything odd.
    while filled < buf.len() {
        match tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut buf[filled..])).await {
            Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                filled += n;
                if buf[..filled].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
        }
    }
    let head = String::from_utf8_lossy(&buf[..filled]);
    let path = head.split_whitespace().nth(1).unwrap_or("/");
    let (status, content_type, body) = match path {
        "/metrics" => {
            handle.run_upkeep();
            ("200 OK", "text/plain; version=0.0.4", handle.render())
        }
        "/healthz" => ("200 OK", "text/plain", "ok\n".to_string()),
        _ => ("404 Not Found", "text/plain", "not found; try /metrics\n".to_string()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Fetches `http://{addr}/metrics` (for tests and `jetrl status`).
pub async fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").await?;
    let mut out = String::new();
    stream.read_to_string(&mut out).await?;
    Ok(out.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn metrics_endpoint_serves_recorded_counters() {
        let addr = serve_metrics("127.0.0.1:0", std::future::pending()).await.unwrap();
        metrics::counter!("jetrl_test_things_total", "kind" => "a").increment(3);
        let body = scrape(addr).await.unwrap();
        assert!(body.contains("jetrl_test_things_total{kind=\"a\"} 3"), "{body}");
    }

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

    #[tokio::test]
    async fn bind_error_names_the_address() {
        let err = serve_metrics("256.0.0.1:1", std::future::pending()).await.unwrap_err();
        assert!(err.to_string().contains("256.0.0.1:1"));
    }
}

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
    E: std::error::Error + Send + Sync + 'static,
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
    let cfg = jetrl_config::JobConfig::load(config.as_deref(), &overrides)?;
    init_tracing(&cfg.log.level, cfg.log.format);
    let workers = tokio_threads(&cfg);
    let runtime = runtime(workers)?;
    tracing::info!(tokio_threads = workers.map_or_else(|| "one per core".to_string(), |n| n.to_string()), "runtime");
    runtime.block_on(run(cfg, Box::pin(shutdown_signal())))?;
    Ok(())
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
