//! `jetrl status`: a snapshot of a running job.

use std::path::Path;

use futures::StreamExt;
use jetrl_bus::Bus;
use jetrl_config::{JobConfig, NatsConfig};
use jetrl_wire::v1::{Heartbeat, LedgerRequest, LedgerResponse};
use jetrl_wire::{subjects, Message};

/// NATS settings from the `nats` section of `file` (a job file, or one with only `nats:`; the file is typed as a
/// job file, so a misspelt key is an error, but not validated as one), `JETRL__NATS__*` and `nats.key=value`
/// overrides. A status gives up on an unreachable server after 5 s, and on an unanswered request after 10 s, unless
/// the configuration says otherwise.
pub fn nats_config(file: Option<&Path>, overrides: &[String]) -> anyhow::Result<NatsConfig> {
    let mut overrides = overrides.to_vec();
    let given = jetrl_config::load_value(file, &overrides)?;
    for (key, seconds) in [("connect_timeout_s", 5), ("request_timeout_s", 10)] {
        if given.pointer(&format!("/nats/{key}")).is_none() {
            overrides.push(format!("nats.{key}={seconds}"));
        }
    }
    let job: JobConfig = jetrl_config::load(file, &overrides)?;
    Ok(job.nats)
}

pub async fn status(cfg: &NatsConfig, ledger: bool, uids: Vec<String>) -> anyhow::Result<()> {
    let bus = Bus::connect(cfg, "jetrl-status").await?;
    match bus.latest_manifest().await? {
        Some(m) => println!(
            "weights: version {} (step {}, {} tensors, {} bytes at {})",
            m.version,
            m.step,
            m.tensors.len(),
            m.total_bytes,
            m.location
        ),
        None => println!("weights: no version announced yet"),
    }
    let kv = bus.key_value(subjects::WORKERS_BUCKET).await?;
    let mut keys = kv.keys().await?;
    println!("workers:");
    let now = jetrl_wire::now_unix_ms();
    while let Some(Ok(key)) = keys.next().await {
        if let Ok(Some(value)) = kv.get(&key).await {
            if let Ok(beat) = Heartbeat::decode(value.as_ref()) {
                println!(
                    "  {:<10} {:<28} v{:<6} {:<8} inflight {:<4} seen {:.1}s ago",
                    beat.service,
                    beat.instance_id,
                    beat.policy_version,
                    beat.state().label(),
                    beat.inflight,
                    (now - beat.unix_ms) as f64 / 1000.0
                );
            }
        }
    }
    let request = LedgerRequest { partition: String::new(), uids, limit: if ledger { 100_000 } else { 1 } };
    let response: LedgerResponse = bus.request(subjects::BUFFER_LEDGER, &request, bus.request_timeout()).await?;
    if !response.error.is_empty() {
        anyhow::bail!("replay buffer: {}", response.error);
    }
    println!("groups: {:?}", response.counts);
    if ledger {
        println!("{:<38} {:<6} {:<9} {:>6} {:>8} {:>5}  reason", "uid", "part", "state", "submit", "trained", "trajs");
        for e in response.entries {
            let state = jetrl_wire::v1::GroupState::try_from(e.state).map(|s| s.label()).unwrap_or("?");
            let trained = if e.sampled_step > 0 { e.sampled_step.to_string() } else { "-".into() };
            println!(
                "{:<38} {:<6} {:<9} {:>6} {:>8} {:>5}  {}",
                e.uid, e.partition, state, e.submit_step, trained, e.trajectories, e.evicted_reason
            );
        }
    }
    Ok(())
}
