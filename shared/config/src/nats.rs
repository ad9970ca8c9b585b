//! How to reach NATS: the servers, credentials, TLS and the job's namespace (`nats.*`).

use serde::{Deserialize, Serialize};

/// How to reach NATS. Its `Debug` shows no secret (see the impl below).
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// one server URL, or several (a cluster's nodes) separated by commas or given as a YAML list: the client
    /// connects to any of them and learns the rest of the cluster from the one it reaches
    #[serde(deserialize_with = "url_list")]
    pub url: String,
    /// a `.creds` file (JWT + nkey)
    pub creds_file: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    /// how long to keep retrying the first connection (with backoff) before giving up
    pub connect_timeout_s: f64,
    /// default timeout of request/reply calls
    pub request_timeout_s: f64,
    /// a file holding the password of `user` (its first line): how systemd's LoadCredential and compose secrets
    /// hand secrets over, so the password is in neither the environment nor a command line
    pub password_file: Option<String>,
    /// a file holding the token (its first line)
    pub token_file: Option<String>,
    /// a file holding an nkey seed (`SU...`): nkey authentication
    pub nkey_seed_file: Option<String>,
    /// PEM CA certificate(s) the server's certificate must chain to (instead of the system's roots)
    pub tls_ca_file: Option<String>,
    /// PEM client certificate and its private key, for a server that verifies clients (mutual TLS)
    pub tls_cert_file: Option<String>,
    pub tls_key_file: Option<String>,
    /// the name the server's certificate must carry, when it is not the URL's host (e.g. a URL with an IP)
    pub tls_server_name: Option<String>,
    /// refuse to talk to the server without TLS (implied by any `tls_*` file and by a `tls://` URL)
    pub tls_required: bool,
    /// the prefix of this client's reply subjects (default `_INBOX`): a server that lets each user subscribe only
    /// to its own replies (`_INBOX_<user>.>`, as deploy/nats/gen.sh writes) needs it
    pub inbox_prefix: Option<String>,
    /// the job's namespace: part of every stream, bucket and subject name, so jobs sharing a NATS server never
    /// see each other's records (default: `run.name`)
    pub namespace: Option<String>,
    /// copies of every stream, KV bucket and object store the job declares: 1 (one server) or 3 (a three-node
    /// JetStream cluster: a write is acknowledged once two nodes have it, and one node may die)
    pub replicas: u8,
}

/// `nats.url` as one string, comma-separated (what an environment variable or a `key=value` override can say),
/// or a YAML list of URLs (joined with commas).
fn url_list<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Urls {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Urls::deserialize(deserializer)? {
        Urls::One(url) => url,
        Urls::Many(urls) => urls.join(","),
    })
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            creds_file: None,
            user: None,
            password: None,
            token: None,
            connect_timeout_s: 30.0,
            request_timeout_s: 30.0,
            password_file: None,
            token_file: None,
            nkey_seed_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_server_name: None,
            tls_required: false,
            inbox_prefix: None,
            namespace: None,
            replicas: 1,
        }
    }
}

/// Secrets (password, token) print as `<redacted>`, so a logged or panicking config leaks none. The exhaustive
/// destructuring makes a new field a compile error here until someone decides whether it is a secret.
impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let NatsConfig {
            url,
            creds_file,
            user,
            password,
            token,
            connect_timeout_s,
            request_timeout_s,
            password_file,
            token_file,
            nkey_seed_file,
            tls_ca_file,
            tls_cert_file,
            tls_key_file,
            tls_server_name,
            tls_required,
            inbox_prefix,
            namespace,
            replicas,
        } = self;
        let redacted = |secret: &Option<String>| secret.as_ref().map(|_| "<redacted>");
        f.debug_struct("NatsConfig")
            .field("url", url)
            .field("creds_file", creds_file)
            .field("user", user)
            .field("password", &redacted(password))
            .field("token", &redacted(token))
            .field("connect_timeout_s", connect_timeout_s)
            .field("request_timeout_s", request_timeout_s)
            .field("password_file", password_file)
            .field("token_file", token_file)
            .field("nkey_seed_file", nkey_seed_file)
            .field("tls_ca_file", tls_ca_file)
            .field("tls_cert_file", tls_cert_file)
            .field("tls_key_file", tls_key_file)
            .field("tls_server_name", tls_server_name)
            .field("tls_required", tls_required)
            .field("inbox_prefix", inbox_prefix)
            .field("namespace", namespace)
            .field("replicas", replicas)
            .finish()
    }
}
