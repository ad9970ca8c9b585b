//! Connecting to NATS: credentials and TLS from [`NatsConfig`], retries with backoff, an error that names the
//! URL (and the user, when the server refuses the credentials: that is not retried), and the subjects the server
//! refused this connection ([`Refusals`]) so a refused publish or request fails at once instead of timing out.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use jetrl_config::{JobConfig, NatsConfig};
use jetrl_wire::subjects::Names;
use tokio::sync::watch;

use crate::refusals::{parse_violation, refused_reply, Refusals};
use crate::tls::tls_client_config;
use crate::{BusError, Cause, Delays};

/// How long a stopping service waits for a lost broker to come back before it leaves without the broker work of
/// its way out ([`Bus::wait_connected`]): what it skips is settled by the broker itself (a task not acked is
/// redelivered after its ack wait, a lease expires by its max age, a heartbeat by its bucket's) or can be read
/// later (`jetrl status --ledger`).
pub const SETTLE_RECONNECT: Duration = Duration::from_secs(5);

/// A NATS connection plus its JetStream context, for one job. Cheap to clone.
#[derive(Clone)]
pub struct Bus {
    client: async_nats::Client,
    js: jetstream::Context,
    /// default timeout for request/reply calls
    request_timeout: Duration,
    /// subjects the server refused this connection (empty for a client not made by [`Bus::connect`])
    refusals: Refusals,
    /// the job's stream, bucket and subject names: every name this connection uses comes from here
    names: Arc<Names>,
    /// copies of each stream, bucket and object store the job declares (`nats.replicas`)
    replicas: usize,
    /// how long a service waits for the job's topology to be declared (`nats.connect_timeout_s`)
    topology_wait: Duration,
    /// whether the connection is up, as the client's connect and disconnect events say (`None` for a client not
    /// made by [`Bus::connect`], whose state is read from the client when asked)
    connected: Option<watch::Receiver<bool>>,
}

impl Bus {
    /// Connects for the job `job` describes (its namespace: `nats.namespace`, else `run.name`).
    pub async fn connect_job(job: &JobConfig, client_name: &str) -> Result<Self, BusError> {
        let namespace = job.namespace().map_err(|e| BusError::Namespace(e.to_string()))?;
        let names = Names::new(namespace).map_err(|e| BusError::Namespace(e.to_string()))?;
        Self::connect(&job.nats, &names, client_name).await
    }

    /// Connects, retrying with exponential backoff (0.2 s doubling to 5 s) until `connect_timeout_s` has
    /// passed; each failed attempt is logged with the URL. Refused credentials and TLS failures are permanent
    /// and fail at once. Once connected the client reconnects forever, to any server of the list or of the
    /// cluster (the server it reaches tells it the others).
    pub async fn connect(cfg: &NatsConfig, names: &Names, client_name: &str) -> Result<Self, BusError> {
        // The connection's events are counted from the first one on: the metrics recorder must exist before the
        // service serves its metrics.
        jetrl_telemetry::prometheus();
        let servers = server_list(&cfg.url).map_err(|message| BusError::Connect {
            url: cfg.url.clone(),
            attempts: 0,
            waited_s: 0.0,
            message,
        })?;
        let started = Instant::now();
        let deadline = Duration::from_secs_f64(cfg.connect_timeout_s.max(0.0));
        let mut delays = Delays::new(Duration::from_millis(200), Duration::from_secs(5));
        let mut attempts = 0u32;
        let refusals = Refusals::default();
        let (up, connected) = watch::channel(false);
        let up = Arc::new(up);
        loop {
            attempts += 1;
            let options = Self::options(cfg, client_name, &refusals, &up).await?;
            match options.connect(servers.as_slice()).await {
                Ok(client) => {
                    // exported from the start (at zero), so a dashboard shows "none" rather than "no data"
                    metrics::counter!("jetrl_bus_connection_events_total", "event" => "disconnected").increment(0);
                    let server = client.server_info();
                    tracing::info!(url = %cfg.url, identity = %identity(cfg), server = %server.server_name, cluster = server.cluster.as_deref().unwrap_or("-"), namespace = names.namespace(), attempts, "connected to NATS");
                    let request_timeout = Duration::from_secs_f64(cfg.request_timeout_s);
                    let mut bus = Self::from_client(client, request_timeout, names.clone());
                    bus.refusals = refusals;
                    up.send_replace(bus.client.connection_state() == async_nats::connection::State::Connected);
                    bus.connected = Some(connected);
                    bus.replicas = usize::from(cfg.replicas.max(1));
                    bus.topology_wait = deadline;
                    return Ok(bus);
                }
                Err(err) => {
                    let waited = started.elapsed();
                    let permanent = permanent_connect_failure(&err);
                    if permanent.is_some() || waited + delays.peek() > deadline {
                        return Err(BusError::Connect {
                            url: cfg.url.clone(),
                            attempts,
                            waited_s: waited.as_secs_f64(),
                            message: match permanent {
                                Some(why) => format!("{err} ({why}, as {}; not retried)", identity(cfg)),
                                None => err.to_string(),
                            },
                        });
                    }
                    tracing::warn!(url = %cfg.url, attempt = attempts, retry_in_ms = delays.peek().as_millis() as u64, error = %err, "NATS not reachable yet");
                    delays.sleep().await;
                }
            }
        }
    }

    /// The connection's options: name, timeouts, reconnect forever, credentials and TLS from `cfg`, and an
    /// event callback that logs and counts what the server refuses (recorded in `refusals`). A setting that
    /// cannot work (a missing file, a key without its certificate) is an error naming the key, never retried.
    async fn options(
        cfg: &NatsConfig,
        client_name: &str,
        refusals: &Refusals,
        up: &Arc<watch::Sender<bool>>,
    ) -> Result<async_nats::ConnectOptions, BusError> {
        let invalid = |message: String| BusError::Connect { url: cfg.url.clone(), attempts: 0, waited_s: 0.0, message };
        let mut options = match &cfg.creds_file {
            Some(path) => async_nats::ConnectOptions::with_credentials_file(path.as_str())
                .await
                .map_err(|e| invalid(format!("nats.creds_file {path}: {e}")))?,
            None => async_nats::ConnectOptions::new(),
        };
        options = options
            .name(client_name)
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .event_callback(connection_events(cfg.url.clone(), identity(cfg), refusals.clone(), up.clone()));
        match (&cfg.user, &cfg.password, &cfg.password_file) {
            (Some(_), Some(_), Some(_)) => {
                return Err(invalid("set nats.password or nats.password_file, not both".into()));
            }
            (Some(user), Some(password), None) => options = options.user_and_password(user.clone(), password.clone()),
            (Some(user), None, Some(path)) => {
                let password = read_secret(path).map_err(|e| invalid(format!("nats.password_file {path}: {e}")))?;
                options = options.user_and_password(user.clone(), password);
            }
            (Some(user), None, None) => {
                return Err(invalid(format!(
                    "nats.user is {user:?} but neither nats.password nor nats.password_file is set"
                )));
            }
            (None, Some(_), _) | (None, _, Some(_)) => {
                return Err(invalid("nats.password / nats.password_file is set without nats.user".into()));
            }
            (None, None, None) => {}
        }
        match (&cfg.token, &cfg.token_file) {
            (Some(_), Some(_)) => return Err(invalid("set nats.token or nats.token_file, not both".into())),
            (Some(token), None) => options = options.token(token.clone()),
            (None, Some(path)) => {
                let token = read_secret(path).map_err(|e| invalid(format!("nats.token_file {path}: {e}")))?;
                options = options.token(token);
            }
            (None, None) => {}
        }
        if let Some(path) = &cfg.nkey_seed_file {
            let seed = read_secret(path).map_err(|e| invalid(format!("nats.nkey_seed_file {path}: {e}")))?;
            options = options.nkey(seed);
        }
        let tls_files = [&cfg.tls_ca_file, &cfg.tls_cert_file, &cfg.tls_key_file, &cfg.tls_server_name];
        if cfg.tls_required || tls_files.iter().any(|f| f.is_some()) {
            options = options.require_tls(true);
        }
        match (&cfg.tls_ca_file, &cfg.tls_cert_file, &cfg.tls_key_file) {
            (_, Some(_), None) | (_, None, Some(_)) => {
                return Err(invalid(
                    "nats.tls_cert_file and nats.tls_key_file go together: set both or neither".into(),
                ));
            }
            (Some(ca), cert, key) => {
                let client_auth = cert.as_deref().zip(key.as_deref());
                options = options.tls_client_config(
                    tls_client_config(ca, client_auth, cfg.tls_server_name.as_deref()).map_err(invalid)?,
                );
            }
            (None, cert, key) => {
                if cfg.tls_server_name.is_some() {
                    return Err(invalid(
                        "nats.tls_server_name needs nats.tls_ca_file (the CA that signed the server's certificate)"
                            .into(),
                    ));
                }
                if let (Some(cert), Some(key)) = (cert, key) {
                    for (key_name, path) in [("nats.tls_cert_file", cert), ("nats.tls_key_file", key)] {
                        if !Path::new(path).is_file() {
                            return Err(invalid(format!("{key_name} {path}: not a readable file")));
                        }
                    }
                    options = options.add_client_certificate(cert.into(), key.into());
                }
            }
        }
        if let Some(prefix) = &cfg.inbox_prefix {
            options = options.custom_inbox_prefix(prefix);
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
        Self {
            client,
            js,
            request_timeout,
            refusals: Refusals::default(),
            names: Arc::new(names),
            replicas: 1,
            topology_wait: Duration::from_secs(30),
            connected: None,
        }
    }

    /// The same connection declaring `replicas` copies of each stream, bucket and object store.
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Copies of each stream, bucket and object store the job declares (`nats.replicas`).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// How long [`Bus::expect_topology`] waits for the job's topology (`nats.connect_timeout_s`).
    pub fn topology_wait(&self) -> Duration {
        self.topology_wait
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

    /// Whether the connection is up now, or comes back within `within` (told by the client's events). A service
    /// that is stopping asks this before the broker work it would do on the way out (nak, final heartbeat, ledger,
    /// lease release): with the broker gone, each of those would wait out its own patience, and a stop would take
    /// longer than a supervisor's grace ([`SETTLE_RECONNECT`]).
    pub async fn wait_connected(&self, within: Duration) -> bool {
        tokio::time::timeout(within, self.state_becomes(true)).await.is_ok() || self.is_connected()
    }

    /// Resolves once the connection has been down for `within` without a break: raced against the broker work of
    /// a service's way out (batches settling, groups draining), which cannot finish without the broker.
    pub async fn unreachable_for(&self, within: Duration) {
        loop {
            self.state_becomes(false).await;
            if tokio::time::timeout(within, self.state_becomes(true)).await.is_err() {
                return;
            }
        }
    }

    fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Resolves when the connection is up (`true`) or down (`false`): at once when it is, else at the event that
    /// makes it so. The client's own state decides (its events are told a moment after it changes); a client not
    /// made by [`Bus::connect`] is read every 100 ms.
    async fn state_becomes(&self, up: bool) {
        let mut events = self.connected.clone();
        loop {
            if self.is_connected() == up {
                return;
            }
            match events.as_mut() {
                Some(events) => {
                    // a closed channel (the client is gone) leaves only the client's state to read
                    if events.changed().await.is_err() {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
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
        let since = Instant::now();
        let reply = tokio::select! {
            reply = self.client.send_request(subject.to_string(), req) => reply.map_err(Cause::of),
            refused = self.refusals.refused(subject, since) => Err(Cause::permanent(refused)),
        }
        .map_err(|cause| BusError::Request { subject: subject.to_string(), cause })?;
        Resp::decode(reply.payload.as_ref())
            .map_err(|source| BusError::Decode { what: format!("reply on {subject}"), source })
    }

    /// The permissions violations the server reports on this connection (cheap to clone).
    pub(crate) fn refusals(&self) -> Refusals {
        self.refusals.clone()
    }
}

/// Who the configuration connects as, for errors and logs: the user name, or which kind of credential, never a
/// secret.
fn identity(cfg: &NatsConfig) -> String {
    if let Some(user) = &cfg.user {
        format!("user {user:?}")
    } else if let Some(path) = &cfg.creds_file {
        format!("the credentials in {path}")
    } else if let Some(path) = &cfg.nkey_seed_file {
        format!("the nkey in {path}")
    } else if cfg.token.is_some() || cfg.token_file.is_some() {
        "a token".into()
    } else {
        "no credentials".into()
    }
}

/// `nats.url` split into its servers (`tls://a:4222,tls://b:4222`); an empty entry is an error naming the list.
fn server_list(url: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    url.split(',')
        .map(str::trim)
        .map(|one| {
            if one.is_empty() {
                return Err(format!("nats.url {url:?}: an empty entry in the list of servers"));
            }
            one.parse::<async_nats::ServerAddr>().map_err(|e| format!("nats.url {one:?}: {e}"))
        })
        .collect()
}

/// Why a failed connection attempt can never succeed by retrying (`None`: it may, e.g. the server is not up yet).
fn permanent_connect_failure(err: &async_nats::ConnectError) -> Option<&'static str> {
    use async_nats::ConnectErrorKind as Kind;
    match err.kind() {
        Kind::AuthorizationViolation => Some("the server refused these credentials"),
        Kind::Authentication => Some("the credentials could not be used"),
        Kind::Tls | Kind::ServerParse => Some("TLS or address misconfigured"),
        // rustls reports a certificate the client cannot trust (or the server's refusal of ours) as an I/O
        // error; no retry fixes either
        Kind::Io if err.to_string().to_lowercase().contains("certificate") => Some("TLS certificate rejected"),
        _ => None,
    }
}

/// The first line of a secret file, without surrounding whitespace.
fn read_secret(path: &str) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let secret = text.lines().next().unwrap_or_default().trim().to_string();
    if secret.is_empty() {
        return Err("empty".into());
    }
    Ok(secret)
}

/// The connection's event callback: logs disconnects and reconnects, counts them
/// (`jetrl_bus_connection_events_total{event}`), and logs, counts (`jetrl_bus_permission_violations_total
/// {operation}`) and records every permissions violation the server reports.
fn connection_events(
    url: String,
    identity: String,
    refusals: Refusals,
    up: Arc<watch::Sender<bool>>,
) -> impl Fn(async_nats::Event) -> futures::future::Ready<()> + Send + Sync + 'static {
    move |event| {
        match &event {
            async_nats::Event::Disconnected => {
                up.send_replace(false);
                metrics::counter!("jetrl_bus_connection_events_total", "event" => "disconnected").increment(1);
                tracing::warn!(%url, "disconnected from NATS; reconnecting");
            }
            async_nats::Event::Connected => {
                up.send_replace(true);
                metrics::counter!("jetrl_bus_connection_events_total", "event" => "connected").increment(1);
                tracing::info!(%url, "NATS connection (re)established");
            }
            async_nats::Event::ServerError(async_nats::ServerError::AuthorizationViolation) => {
                metrics::counter!("jetrl_bus_connection_events_total", "event" => "authorization_violation")
                    .increment(1);
                tracing::error!(%url, as_ = %identity, "the NATS server refused these credentials (rotated?): restart with the current ones");
            }
            async_nats::Event::ServerError(async_nats::ServerError::Other(text)) => match parse_violation(text) {
                Some((operation, subject)) => {
                    metrics::counter!("jetrl_bus_permission_violations_total", "operation" => operation).increment(1);
                    if refused_reply(operation, subject) {
                        tracing::warn!(
                            %url, as_ = %identity, subject,
                            "the NATS server refused a reply: a server lets a connection answer only requests it \
                             delivered on that connection, so an answer to a request received before a reconnect to \
                             another node is refused, and the requester asks again. Seen without a reconnect, the \
                             identity lacks allow_responses (deploy/nats/gen.sh)"
                        );
                    } else {
                        tracing::error!(%url, as_ = %identity, operation, subject, "the NATS server refused: permissions violation");
                    }
                    refusals.record(operation, subject);
                }
                None => tracing::warn!(%url, error = %text, "NATS server error"),
            },
            other => tracing::debug!(%url, event = %other, "NATS connection event"),
        }
        futures::future::ready(())
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

    #[tokio::test]
    async fn settings_that_cannot_work_fail_before_connecting_naming_the_key() {
        let base = NatsConfig { url: "nats://127.0.0.1:1".into(), connect_timeout_s: 30.0, ..NatsConfig::default() };
        let names = Names::new("jetrl").unwrap();
        let user = || Some("svc".to_string());
        let cases = [
            (NatsConfig { user: user(), ..base.clone() }, "nats.password_file is set"),
            (
                NatsConfig {
                    user: user(),
                    password: Some("p".into()),
                    password_file: Some("/p".into()),
                    ..base.clone()
                },
                "not both",
            ),
            (NatsConfig { password: Some("p".into()), ..base.clone() }, "without nats.user"),
            (
                NatsConfig { user: user(), password_file: Some("/nonexistent/jetrl-password".into()), ..base.clone() },
                "nats.password_file /nonexistent/jetrl-password",
            ),
            (NatsConfig { token_file: Some("/nonexistent/token".into()), ..base.clone() }, "nats.token_file"),
            (NatsConfig { nkey_seed_file: Some("/nonexistent/seed".into()), ..base.clone() }, "nats.nkey_seed_file"),
            (NatsConfig { tls_cert_file: Some("/c.pem".into()), ..base.clone() }, "go together"),
            (NatsConfig { tls_server_name: Some("nats".into()), ..base.clone() }, "needs nats.tls_ca_file"),
            (NatsConfig { tls_ca_file: Some("/nonexistent/ca.pem".into()), ..base.clone() }, "nats.tls_ca_file"),
            (NatsConfig { creds_file: Some("/nonexistent/x.creds".into()), ..base.clone() }, "nats.creds_file"),
        ];
        for (cfg, expected) in cases {
            let started = Instant::now();
            let text = Bus::connect(&cfg, &names, "test").await.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(text.contains(expected) && text.contains("nats://127.0.0.1:1"), "{cfg:?}: {text}");
            assert!(started.elapsed() < Duration::from_secs(1), "{cfg:?} was retried");
        }
    }

    #[test]
    fn a_url_list_names_every_server() {
        let servers = server_list("tls://h1:4222, tls://h2:4223,nats://10.0.0.7:4222").expect("three servers");
        let hosts: Vec<(String, u16)> = servers.iter().map(|s| (s.host().to_string(), s.port())).collect();
        assert_eq!(hosts, [("h1".into(), 4222), ("h2".into(), 4223), ("10.0.0.7".into(), 4222)]);
        assert!(servers.iter().take(2).all(|s| s.tls_required()));
        let err = server_list("tls://h1:4222,,tls://h2:4222").expect_err("an empty entry");
        assert!(err.contains("nats.url") && err.contains("empty entry"), "{err}");
    }

    #[test]
    fn a_secret_file_gives_its_first_line_trimmed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secret");
        std::fs::write(&path, "  s3cret \nsecond line\n").expect("write");
        assert_eq!(read_secret(&path.display().to_string()), Ok("s3cret".to_string()));
        std::fs::write(&path, "\n").expect("write");
        assert_eq!(read_secret(&path.display().to_string()), Err("empty".to_string()));
    }
}
