//! `nats.request_timeout_s` is the deadline of the request/reply calls that have none of their own (the callers
//! pass `Bus::request_timeout`), against a real nats-server.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::time::{Duration, Instant};

use jetrl_bus::{Bus, BusError, NatsServer};
use jetrl_config::NatsConfig;
use jetrl_wire::v1::{LedgerRequest, LedgerResponse};

#[tokio::test]
async fn a_request_nobody_answers_fails_after_nats_request_timeout_s() {
    let server = NatsServer::start().unwrap();
    let cfg = NatsConfig { url: server.url(), request_timeout_s: 0.5, ..NatsConfig::default() };
    let names = jetrl_wire::subjects::Names::new("test").unwrap();
    let bus = Bus::connect(&cfg, &names, "request-timeout-test").await.unwrap();
    assert_eq!(bus.request_timeout(), Duration::from_millis(500));
    // a subscriber that never answers: without one the server would say "no responders" at once
    let _silent = bus.client().subscribe("jetrl.test.silent").await.unwrap();
    let started = Instant::now();
    let err = bus
        .request::<_, LedgerResponse>("jetrl.test.silent", &LedgerRequest::default(), bus.request_timeout())
        .await
        .unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, BusError::Request { .. }), "{err}");
    assert!(waited >= Duration::from_millis(450) && waited < Duration::from_secs(5), "gave up after {waited:?}");
}
