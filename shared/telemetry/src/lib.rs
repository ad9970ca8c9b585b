//! Logs and metrics for every jetrl service.
//!
//! - [`init_tracing`]: structured `tracing` logs, text or JSON, filtered by `RUST_LOG` or the configured level.
//! - [`serve_metrics`]: a Prometheus `/metrics` endpoint (plus `/healthz`) on a configurable address; port 0
//!   picks a free port, and the bound address is returned and logged so a scraper or a test can find it
//!   ([`endpoint`]); every process also reports its allocator's figures there ([`heap`]).
//! - [`service_main`]: the whole `main` of a service, with its shutdown signal, runtime and thread counts
//!   ([`service`]).
//! - [`http`]: a minimal plain-HTTP/1.1 client (remote reward models, MLflow's REST API).
//! - [`Delays`]: backoff that doubles up to a cap, for every loop that asks again.
//!
//! The recorder is process-global (the `metrics` facade), so several services started in one test process
//! share it; their names never collide because each carries the `jetrl_<service>_` prefix.

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("metrics endpoint: cannot bind {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
}

impl TelemetryError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Bind { .. } => "bind",
        }
    }
}

pub mod crash;
pub mod delays;
pub mod endpoint;
pub mod heap;
pub mod http;
pub mod service;

pub use delays::Delays;
pub use endpoint::{prometheus, scrape, serve_metrics};
pub use service::{
    available_cores, runtime, service_main, shutdown_signal, ServiceError, Shutdown, TorchThreads, EXIT_PERMANENT,
};

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
