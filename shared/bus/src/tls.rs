//! TLS for the NATS connection: a client configuration that trusts only the configured CA, with an optional
//! client certificate, and a verifier that checks the server's certificate against a configured name
//! (`nats.tls_server_name`) instead of the URL's host.

use std::sync::Arc;

use async_nats::rustls;

/// A TLS client configuration that trusts only the CA in `ca_file`, presents `client_auth` (certificate, key)
/// if given, and checks the server's certificate against `server_name` instead of the URL's host if given.
pub(crate) fn tls_client_config(
    ca_file: &str,
    client_auth: Option<(&str, &str)>,
    server_name: Option<&str>,
) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

    let certificates = |key: &str, path: &str| -> Result<Vec<CertificateDer<'static>>, String> {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("{key} {path}: {e}"))?;
        if certs.is_empty() {
            return Err(format!("{key} {path}: no PEM certificate in it"));
        }
        Ok(certs)
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates("nats.tls_ca_file", ca_file)? {
        roots.add(cert).map_err(|e| format!("nats.tls_ca_file {ca_file}: {e}"))?;
    }
    let roots = Arc::new(roots);
    let builder = match server_name {
        None => rustls::ClientConfig::builder().with_root_certificates(roots),
        Some(name) => {
            let name =
                ServerName::try_from(name.to_string()).map_err(|e| format!("nats.tls_server_name {name:?}: {e}"))?;
            let inner = rustls::client::WebPkiServerVerifier::builder(roots)
                .build()
                .map_err(|e| format!("nats.tls_ca_file {ca_file}: {e}"))?;
            rustls::ClientConfig::builder()
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ExpectServerName { inner, name }))
        }
    };
    match client_auth {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let chain = certificates("nats.tls_cert_file", cert)?;
            let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("nats.tls_key_file {key}: {e}"))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| format!("nats.tls_cert_file {cert} with nats.tls_key_file {key}: {e}"))
        }
    }
}

/// The standard WebPKI verification of the server's chain, against a configured name instead of the URL's host
/// (`nats.tls_server_name`: a URL by IP address, or a name the certificate was not issued for).
#[derive(Debug)]
struct ExpectServerName {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    name: rustls::pki_types::ServerName<'static>,
}

impl rustls::client::danger::ServerCertVerifier for ExpectServerName {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _url_host: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.inner.verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
