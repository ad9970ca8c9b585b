//! The reward service's integration tests that may share a process, as one test binary (the service and the NATS
//! client are compiled once for all of them). The metrics test has a binary of its own: the Prometheus recorder
//! is process-wide.

#[path = "../common/mod.rs"]
mod common;
mod redelivery;
mod reward_model;
mod scaling;
mod slow_scorer;
