//! Connecting to NATS: retries with backoff and an error that names the URL.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use jetrl_config::{JobConfig, NatsConfig};
use jetrl_wire::subjects::Names;

use crate::BusError;

/// A NATS connection plus its JetStream context, for one job. Cheap to clone.
#[derive(Clone)]
pub struct Bus {
    client: async_nats::Client,
    js: jetstream::Context,
    /// default timeout for request/reply calls
    request_timeout: Duration,
    /// the job's stream, bucket and subject names: every name this connection uses comes from here
    names: Arc<Names>,
}

impl Bus {
    /// Connects for the job `job` describes (its namespace: `nats.namespace`, else `run.name`).
    pub async fn connect_job(job: &JobConfig, client_name: &str) -> Result<Self, BusError> {
        let namespace = job.namespace().map_err(|e| BusError::Namespace(e.to_string()))?;
        let names = Names::new(namespace).map_err(|e| BusError::Namespace(e.to_string()))?;
        Self::connect(&job.nats, &names, client_name).await
    }

    /// Connects, retrying with exponential backoff (0.2 s doubling to 5 s) until `connect_timeout_s` has
    /// passed; each failed attempt is logged with the URL. Once connected the client reconnects forever.
    pub async fn connect(cfg: &NatsConfig, names: &Names, client_name: &str) -> Result<Self, BusError> {
        let started = Instant::now();
        let deadline = Duration::from_secs_f64(cfg.connect_timeout_s.max(0.0));
        let mut delay = Duration::from_millis(200);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let options = Self::options(cfg, client_name).await?;
            match options.connect(cfg.url.as_str()).await {
                Ok(client) => {
                    tracing::info!(url = %cfg.url, namespace = names.namespace(), attempts, "connected to NATS");
                    let request_timeout = Duration::from_secs_f64(cfg.request_timeout_s);
                    return Ok(Self::from_client(client, request_timeout, names.clone()));
                }
                Err(err) => {
                    let waited = started.elapsed();
                    if waited + delay > deadline {
                        return Err(BusError::Connect {
                            url: cfg.url.clone(),
                            attempts,
                            waited_s: waited.as_secs_f64(),
                            message: err.to_string(),
                        });
                    }
                    tracing::warn!(url = %cfg.url, attempt = attempts, retry_in_ms = delay.as_millis() as u64, error = %err, "NATS not reachable yet");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn options(cfg: &NatsConfig, client_name: &str) -> Result<async_nats::ConnectOptions, BusError> {
        let mut options = async_nats::ConnectOptions::new()
            .name(client_name)
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None);
        if let Some(path) = &cfg.creds_file {
            options = async_nats::ConnectOptions::with_credentials_file(path.as_str())
                .await
                .map_err(|e| BusError::Connect {
                    url: cfg.url.clone(),
                    attempts: 0,
                    waited_s: 0.0,
                    message: format!("credentials file {path}: {e}"),
                })?
                .name(client_name)
                .connection_timeout(Duration::from_secs(5))
                .max_reconnects(None);
        }
        if let (Some(user), Some(password)) = (&cfg.user, &cfg.password) {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &cfg.token {
            options = options.token(token.clone());
        }
        Ok(options)
    }

    /// Wraps an existing client, for the job named by `names`.
    pub fn from_client(client: async_nats::Client, request_timeout: Duration, names: Names) -> Self {
        let js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(10))
            // stay below the client's own 5000-future cap; Publisher bounds its in-flight acks further
            .max_ack_inflight(4096)
            .backpressure_on_inflight(true)
            .build(client.clone());
        Self { client, js, request_timeout, names: Arc::new(names) }
    }

    /// The job's stream, bucket and subject names.
    pub fn names(&self) -> &Names {
        &self.names
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// The server's max_payload (bytes), as announced on connect.
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    /// Core request/reply with a protobuf body and an explicit timeout.
    pub async fn request<Req: prost::Message, Resp: prost::Message + Default>(
        &self,
        subject: &str,
        request: &Req,
        timeout: Duration,
    ) -> Result<Resp, BusError> {
        let payload = bytes::Bytes::from(request.encode_to_vec());
        let req = async_nats::Request::new().payload(payload).timeout(Some(timeout));
        let reply = self
            .client
            .send_request(subject.to_string(), req)
            .await
            .map_err(|e| BusError::Request { subject: subject.to_string(), message: e.to_string() })?;
        Resp::decode(reply.payload.as_ref())
            .map_err(|e| BusError::Decode { what: format!("reply on {subject}"), message: e.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unreachable_url_fails_with_an_error_naming_it_after_retrying() {
        let cfg = NatsConfig { url: "nats://127.0.0.1:1".into(), connect_timeout_s: 0.9, ..NatsConfig::default() };
        let started = Instant::now();
        let names = Names::new("test").unwrap();
        let err = Bus::connect(&cfg, &names, "test").await.err().expect("port 1 has no NATS server");
        let text = err.to_string();
        assert!(text.contains("nats://127.0.0.1:1"), "{text}");
        match err {
            BusError::Connect { attempts, .. } => assert!(attempts >= 2, "should have retried, got {attempts}"),
            other => panic!("unexpected error {other}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
