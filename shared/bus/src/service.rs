//! What every service does first, written once: connect to the job's broker under the service's client name,
//! find the job's topology (or, for the trainer, declare it), send malformed messages to the job's dead letters,
//! and, for a service whose liveness is a plain heartbeat, start beating and serve `/metrics` until the shutdown.

use jetrl_config::JobConfig;
use jetrl_telemetry::{Shutdown, TelemetryError};

use crate::heartbeat::Heartbeats;
use crate::{consume, Bus, BusError};

/// Whether a service declares the job's topology or waits for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// Waits for the topology (up to `nats.connect_timeout_s`), then fails naming what is missing: every service
    /// but the trainer.
    Expect,
    /// Declares it (creates what is missing, updates what differs): the trainer.
    Declare,
}

/// Connects as `client` (the name the broker shows for this connection), sees to the topology and routes this
/// process's dead letters to the job.
pub async fn connect(cfg: &JobConfig, client: &str, topology: Topology) -> Result<Bus, BusError> {
    let bus = Bus::connect_job(cfg, client).await?;
    match topology {
        Topology::Expect => bus.expect_topology().await?,
        Topology::Declare => {
            bus.declare_topology().await?;
        }
    }
    consume::route_dead_letters(&bus);
    Ok(bus)
}

/// A service's start: [`connect`] with [`Topology::Expect`], its heartbeat, its metrics endpoint.
pub struct Start<'a> {
    /// the connection's client name
    pub client: &'a str,
    /// the kind the heartbeat names (`jetrl_wire::ServiceKind::as_str`)
    pub service: &'static str,
    /// the instance id the heartbeat names (None: host and process id)
    pub instance: Option<&'a str>,
    /// where `/metrics` is served
    pub metrics_addr: &'a str,
}

/// A started service: its connection and its heartbeat (stop it with [`Heartbeats::stop`] when the service ends,
/// so the last beat says it stopped).
pub struct Started {
    pub bus: Bus,
    pub heartbeat: Heartbeats,
}

/// Connects, waits for the topology, routes dead letters, starts the heartbeat and serves `/metrics` until
/// `shutdown`.
/// `E` is the service's own error, which names both kinds of failure.
pub async fn start<E: From<BusError> + From<TelemetryError>>(
    cfg: &JobConfig,
    start: Start<'_>,
    shutdown: &Shutdown,
) -> Result<Started, E> {
    let bus = connect(cfg, start.client, Topology::Expect).await?;
    let heartbeat = crate::heartbeat::start(&bus, cfg, start.service, start.instance, shutdown.clone());
    jetrl_telemetry::serve_metrics(start.metrics_addr, shutdown.waiter()).await?;
    Ok(Started { bus, heartbeat })
}
