//! One file: one small protocol client, from the connection to the parsed response.
//!
//! A minimal HTTP/1.1 client (reward-model servers, MLflow's REST API): one connection per request
//! (`Connection: close`), any method and extra headers, response bodies sized by `Content-Length`, chunked
//! encoding or end of stream. `http://` and `https://` (TLS 1.2/1.3 by rustls; the server's certificate is checked
//! against the system's trusted roots, or the bundle `SSL_CERT_FILE` / the folder `SSL_CERT_DIR` names, as
//! OpenSSL-based clients such as MLflow's Python client read them).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_rustls::rustls;

const MAX_HEAD_BYTES: usize = 64 << 10;
const MAX_BODY_BYTES: usize = 64 << 20;

/// Why an HTTP exchange failed before a status code was known.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("url {0:?} is not of the form http[s]://host[:port][/path]")]
    InvalidUrl(String),
    #[error("connect to {address}: {source}")]
    Connect { address: String, source: std::io::Error },
    /// no trusted root certificate could be loaded (from the system, `SSL_CERT_FILE` or `SSL_CERT_DIR`)
    #[error("TLS: no trusted root certificates ({0})")]
    NoRoots(String),
    /// the TLS handshake failed (an untrusted or mismatched certificate, no common protocol)
    #[error("TLS handshake with {address}: {source}")]
    Tls { address: String, source: std::io::Error },
    #[error("send: {0}")]
    Send(std::io::Error),
    #[error("receive: {0}")]
    Receive(std::io::Error),
    #[error("malformed response: {0}")]
    MalformedResponse(String),
    #[error("no complete response within {0:?}")]
    Timeout(Duration),
}

impl HttpError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidUrl(..) => "invalid_url",
            Self::Connect { .. } => "connect",
            Self::NoRoots(..) => "no_roots",
            Self::Tls { .. } => "tls",
            Self::Send(..) => "send",
            Self::Receive(..) => "receive",
            Self::MalformedResponse(..) => "malformed_response",
            Self::Timeout(..) => "timeout",
        }
    }
}

/// Where requests go: `http://host:port/prefix` or `https://host:port/prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpEndpoint {
    tls: bool,
    host: String,
    port: u16,
    /// path prefix without a trailing `/` (empty for the root)
    base_path: String,
}

impl HttpEndpoint {
    pub fn parse(url: &str) -> Result<Self, HttpError> {
        let invalid = || HttpError::InvalidUrl(url.to_string());
        let (tls, rest) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
            (Some(rest), _) => (false, rest),
            (_, Some(rest)) => (true, rest),
            _ => return Err(invalid()),
        };
        let default_port = if tls { 443 } else { 80 };
        let (authority, path) = match rest.find('/') {
            Some(slash) => rest.split_at(slash),
            None => (rest, ""),
        };
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            // IPv6 literal: [::1]:8000
            let (host, after) = bracketed.split_once(']').ok_or_else(invalid)?;
            let port = match after.strip_prefix(':') {
                Some(port) => port.parse().map_err(|_| invalid())?,
                None if after.is_empty() => default_port,
                None => return Err(invalid()),
            };
            (host.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host.to_string(), port.parse().map_err(|_| invalid())?),
                None => (authority.to_string(), default_port),
            }
        };
        if host.is_empty() {
            return Err(invalid());
        }
        Ok(Self { tls, host, port, base_path: path.trim_end_matches('/').to_string() })
    }

    /// Whether requests go over TLS (`https://`).
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    fn host_header(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// A response: status code and the whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    pub status: u16,
    pub body: Vec<u8>,
}

/// One request: `method {base}{path}` (the path may carry a query string) with `headers` and `body` (sent with
/// `Content-Type: content_type` when it is set).
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub content_type: Option<&'a str>,
    pub body: &'a [u8],
}

/// `POST {base}{path}` with a JSON body; the whole exchange (connect to last byte) is bounded by `timeout`.
pub async fn post_json(
    endpoint: &HttpEndpoint,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    let request = Request { method: "POST", path, headers: &[], content_type: Some("application/json"), body };
    send(endpoint, &request, timeout).await
}

/// Sends `request`; the whole exchange (connect to last byte) is bounded by `timeout`.
pub async fn send(
    endpoint: &HttpEndpoint,
    request: &Request<'_>,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    tokio::time::timeout(timeout, exchange(endpoint, request)).await.map_err(|_| HttpError::Timeout(timeout))?
}

/// The request head: request line, `Host`, the content headers when there is a body or a content type, the
/// caller's headers.
fn request_head(endpoint: &HttpEndpoint, request: &Request<'_>) -> String {
    let mut head = format!(
        "{} {}{} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\nConnection: close\r\nUser-Agent: jetrl\r\n",
        request.method,
        endpoint.base_path,
        request.path,
        endpoint.host_header()
    );
    if let Some(content_type) = request.content_type {
        head += &format!("Content-Type: {content_type}\r\n");
    }
    if request.content_type.is_some() || !request.body.is_empty() || request.method != "GET" {
        head += &format!("Content-Length: {}\r\n", request.body.len());
    }
    for (name, value) in request.headers {
        head += &format!("{name}: {value}\r\n");
    }
    head += "\r\n";
    head
}

async fn exchange(endpoint: &HttpEndpoint, request: &Request<'_>) -> Result<HttpResponse, HttpError> {
    let address = (endpoint.host.as_str(), endpoint.port);
    let stream = TcpStream::connect(address)
        .await
        .map_err(|source| HttpError::Connect { address: endpoint.host_header(), source })?;
    if !endpoint.tls {
        return exchange_on(stream, endpoint, request).await;
    }
    let name = rustls::pki_types::ServerName::try_from(endpoint.host.clone())
        .map_err(|_| HttpError::InvalidUrl(format!("https://{}", endpoint.host_header())))?;
    let stream = tokio_rustls::TlsConnector::from(tls_config()?)
        .connect(name, stream)
        .await
        .map_err(|source| HttpError::Tls { address: endpoint.host_header(), source })?;
    exchange_on(stream, endpoint, request).await
}

/// The TLS client settings, built once: the trusted roots (the system's, or `SSL_CERT_FILE` / `SSL_CERT_DIR`).
fn tls_config() -> Result<Arc<rustls::ClientConfig>, HttpError> {
    static CONFIG: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut roots = rustls::RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
                return Err(if errors.is_empty() { "none found".into() } else { errors.join("; ") });
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots)
                .with_no_client_auth();
            Ok(Arc::new(config))
        })
        .clone()
        .map_err(HttpError::NoRoots)
}

async fn exchange_on<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    endpoint: &HttpEndpoint,
    request: &Request<'_>,
) -> Result<HttpResponse, HttpError> {
    stream.write_all(request_head(endpoint, request).as_bytes()).await.map_err(HttpError::Send)?;
    stream.write_all(request.body).await.map_err(HttpError::Send)?;
    stream.flush().await.map_err(HttpError::Send)?;
    read_response(BufReader::new(stream)).await
}

async fn read_response<R: tokio::io::AsyncBufRead + Unpin>(mut reader: R) -> Result<HttpResponse, HttpError> {
    let status_line = read_head_line(&mut reader).await?;
    let status = parse_status_line(&status_line)?;
    let mut content_length = None;
    let mut chunked = false;
    let mut head_bytes = status_line.len();
    loop {
        let line = read_head_line(&mut reader).await?;
        head_bytes += line.len();
        if head_bytes > MAX_HEAD_BYTES {
            return Err(HttpError::MalformedResponse("response head too large".into()));
        }
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let length: usize =
                value.parse().map_err(|_| HttpError::MalformedResponse(format!("Content-Length {value:?}")))?;
            content_length = Some(length);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        }
    }
    let body = if chunked {
        read_chunked_body(&mut reader).await?
    } else if let Some(length) = content_length {
        if length > MAX_BODY_BYTES {
            return Err(HttpError::MalformedResponse(format!("body of {length} bytes is too large")));
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).await.map_err(HttpError::Receive)?;
        body
    } else {
        let mut body = Vec::new();
        (&mut reader).take(MAX_BODY_BYTES as u64 + 1).read_to_end(&mut body).await.map_err(HttpError::Receive)?;
        if body.len() > MAX_BODY_BYTES {
            return Err(HttpError::MalformedResponse("body too large".into()));
        }
        body
    };
    Ok(HttpResponse { status, body })
}

/// One CRLF-terminated line of the response head, without its terminator.
async fn read_head_line<R: tokio::io::AsyncBufRead + Unpin>(reader: &mut R) -> Result<String, HttpError> {
    let mut line = Vec::new();
    let read =
        (&mut *reader).take(MAX_HEAD_BYTES as u64).read_until(b'\n', &mut line).await.map_err(HttpError::Receive)?;
    if read == 0 || line.last() != Some(&b'\n') {
        return Err(HttpError::MalformedResponse("connection closed inside the response head".into()));
    }
    while matches!(line.last(), Some(b'\n' | b'\r')) {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| HttpError::MalformedResponse("response head is not UTF-8".into()))
}

fn parse_status_line(line: &str) -> Result<u16, HttpError> {
    let mut parts = line.split_whitespace();
    let version = parts.next().unwrap_or_default();
    let code = parts.next().and_then(|code| code.parse::<u16>().ok());
    match code {
        Some(code) if version.starts_with("HTTP/1.") => Ok(code),
        _ => Err(HttpError::MalformedResponse(format!("status line {line:?}"))),
    }
}

async fn read_chunked_body<R: tokio::io::AsyncBufRead + Unpin>(reader: &mut R) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    loop {
        let size_line = read_head_line(reader).await?;
        let size_text = size_line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| HttpError::MalformedResponse(format!("chunk size {size_text:?}")))?;
        if size == 0 {
            // Trailers, then the empty line that ends the message.
            while !read_head_line(reader).await?.is_empty() {}
            return Ok(body);
        }
        if body.len() + size > MAX_BODY_BYTES {
            return Err(HttpError::MalformedResponse("body too large".into()));
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..]).await.map_err(HttpError::Receive)?;
        let mut crlf = [0u8; 2];
        reader.read_exact(&mut crlf).await.map_err(HttpError::Receive)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_host_port_and_prefix() {
        let endpoint = HttpEndpoint::parse("http://rm.local:8000/api/").unwrap();
        assert_eq!((endpoint.host.as_str(), endpoint.port, endpoint.base_path.as_str()), ("rm.local", 8000, "/api"));
        assert_eq!(HttpEndpoint::parse("http://rm.local").unwrap().port, 80);
        let v6 = HttpEndpoint::parse("http://[::1]:9000").unwrap();
        assert_eq!((v6.host.as_str(), v6.port, v6.host_header()), ("::1", 9000, "[::1]:9000".to_string()));
    }

    #[test]
    fn https_urls_default_to_port_443_and_malformed_urls_are_rejected() {
        let tls = HttpEndpoint::parse("https://mlflow.example.com/prefix").unwrap();
        assert!(tls.is_tls() && !HttpEndpoint::parse("http://rm.local").unwrap().is_tls());
        assert_eq!((tls.port, tls.base_path.as_str()), (443, "/prefix"));
        assert!(HttpEndpoint::parse("ftp://rm.local").is_err());
        assert!(HttpEndpoint::parse("http://:80").is_err());
        assert!(HttpEndpoint::parse("http://rm.local:port").is_err());
    }

    #[test]
    fn the_head_carries_method_path_content_and_extra_headers() {
        let endpoint = HttpEndpoint::parse("http://mlflow:5000/base").unwrap();
        let auth = [("Authorization", "Bearer t")];
        let put = Request {
            method: "PUT",
            path: "/a/b.svg",
            headers: &auth,
            content_type: Some("image/svg+xml"),
            body: b"<svg/>",
        };
        let head = request_head(&endpoint, &put);
        assert!(head.starts_with("PUT /base/a/b.svg HTTP/1.1\r\nHost: mlflow:5000\r\n"), "{head}");
        assert!(head.contains("Content-Type: image/svg+xml\r\n") && head.contains("Content-Length: 6\r\n"), "{head}");
        assert!(head.contains("Authorization: Bearer t\r\n") && head.ends_with("\r\n\r\n"), "{head}");
        let get = Request { method: "GET", path: "/x?y=1", headers: &[], content_type: None, body: b"" };
        let head = request_head(&endpoint, &get);
        assert!(head.starts_with("GET /base/x?y=1 HTTP/1.1") && !head.contains("Content-"), "{head}");
    }

    #[tokio::test]
    async fn chunked_body_is_reassembled() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3;x=y\r\n:1}\r\n0\r\n\r\n";
        let response = read_response(&raw[..]).await.unwrap();
        assert_eq!((response.status, response.body.as_slice()), (200, &b"{\"a\":1}"[..]));
    }

    #[tokio::test]
    async fn body_without_length_runs_to_end_of_stream() {
        let raw = b"HTTP/1.0 503 Busy\r\nX: y\r\n\r\nlater";
        let response = read_response(&raw[..]).await.unwrap();
        assert_eq!((response.status, response.body.as_slice()), (503, &b"later"[..]));
    }

    #[tokio::test]
    async fn truncated_head_is_malformed() {
        assert!(matches!(
            read_response(&b"HTTP/1.1 200 OK\r\nContent-"[..]).await,
            Err(HttpError::MalformedResponse(_))
        ));
    }
}
