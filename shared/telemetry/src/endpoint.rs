//! The Prometheus recorder every service installs and the `/metrics` (and `/healthz`) endpoint that serves it.

use std::net::SocketAddr;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::TelemetryError;

/// How often the recorder drains its histograms' samples into their buckets when nobody scrapes `/metrics`.
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// The process-wide Prometheus recorder, installed on first use. A thread drains the histograms' recorded
/// samples every [`UPKEEP_EVERY`]: without it they pile up until the next scrape, so a service nobody scrapes
/// grows without bound (`just bench soak` measured the reward service at +296% RSS over nine minutes). The same
/// thread records the allocator's figures ([`crate::heap`]).
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    static UPKEEP: std::sync::Once = std::sync::Once::new();
    let handle = recorder(&HANDLE);
    UPKEEP.call_once(|| {
        crate::heap::describe();
        let spawned = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || loop {
            std::thread::sleep(UPKEEP_EVERY);
            crate::heap::record();
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

    #[tokio::test]
    async fn bind_error_names_the_address() {
        let err = serve_metrics("256.0.0.1:1", std::future::pending()).await.unwrap_err();
        assert!(err.to_string().contains("256.0.0.1:1"));
    }
}
