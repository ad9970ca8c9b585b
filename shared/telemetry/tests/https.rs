//! The HTTP client over TLS against a real TLS server (Python's `http.server` behind `ssl`, with a certificate
//! made by `openssl` for 127.0.0.1 and signed by a test CA): a request to `https://127.0.0.1` is answered when the
//! CA is trusted (`SSL_CERT_FILE`, as for MLflow's own client), and a name the certificate does not carry fails
//! the handshake with an error that says so. MLflow's tracker and the remote reward model use this client.
//!
//! Its own test binary: it sets `SSL_CERT_FILE` for the process, which nothing else here reads.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use jetrl_telemetry::http::{post_json, HttpEndpoint, HttpError};

/// Answers every POST with `{"echo": <its body>}` over TLS on a free port, printed on its first line.
const SERVER: &str = r#"
import http.server, json, ssl, sys
class Echo(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        out = json.dumps({"echo": json.loads(body), "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Echo)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().unwrap();
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A test CA (`ca.pem`) and a server certificate for IP 127.0.0.1 signed by it (`server.pem`, `server.key`).
fn certificates(dir: &Path) {
    let key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    let ca = ["req", "-x509", "-subj", "/CN=jetrl test CA", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2"];
    openssl(dir, &[&ca[..], &key].concat());
    let request = ["req", "-new", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr"];
    openssl(dir, &[&request[..], &key].concat());
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
}

#[tokio::test]
async fn https_requests_are_answered_by_a_server_the_trusted_ca_signed_and_a_wrong_name_is_refused() {
    if Command::new("openssl").arg("version").output().is_err() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "openssl is not installed (the test makes its certificates with it)"
        );
        eprintln!("SKIPPED https test: openssl is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    certificates(dir.path());
    // the roots are read once, at the first TLS request: the test CA is the only one trusted
    std::env::set_var("SSL_CERT_FILE", dir.path().join("ca.pem"));
    std::env::remove_var("SSL_CERT_DIR");
    let mut server = Command::new("python3")
        .args(["-c", SERVER])
        .arg(dir.path().join("server.pem"))
        .arg(dir.path().join("server.key"))
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut port = String::new();
    BufReader::new(server.stdout.take().unwrap()).read_line(&mut port).unwrap();
    let port: u16 = port.trim().parse().unwrap_or_else(|_| panic!("the server printed no port: {port:?}"));

    let endpoint = HttpEndpoint::parse(&format!("https://127.0.0.1:{port}/api")).unwrap();
    let response = post_json(&endpoint, "/echo", br#"{"x": 1}"#, Duration::from_secs(20)).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
    assert_eq!((response.status, body), (200, serde_json::json!({"echo": {"x": 1}, "path": "/api/echo"})));

    // the certificate names 127.0.0.1, not localhost: the handshake fails, and says it was the handshake
    let wrong = HttpEndpoint::parse(&format!("https://localhost:{port}")).unwrap();
    let refused = post_json(&wrong, "/echo", b"{}", Duration::from_secs(20)).await;
    let reaches_the_server = std::net::ToSocketAddrs::to_socket_addrs(&("localhost", port))
        .is_ok_and(|mut addrs| addrs.any(|a| a.ip() == std::net::Ipv4Addr::LOCALHOST));
    match refused {
        Err(HttpError::Tls { address, source }) => {
            assert_eq!(address, format!("localhost:{port}"));
            assert!(source.to_string().contains("certificate"), "{source}");
        }
        // a host whose localhost is not 127.0.0.1 cannot reach the server at all
        Err(HttpError::Connect { .. }) if !reaches_the_server => {}
        other => panic!("a certificate for another name was accepted: {other:?}"),
    }
    let _ = server.kill();
    let _ = server.wait();
}
