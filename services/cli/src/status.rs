//! `jetrl status`: a snapshot of a running job.

use std::path::Path;

use futures::StreamExt;
use jetrl_bus::Bus;
use jetrl_config::{JobConfig, NatsConfig};
use jetrl_wire::subjects::{self, Names};
use jetrl_wire::v1::{Heartbeat, LedgerRequest, LedgerResponse};
use jetrl_wire::Message;

/// NATS settings and the job's namespace from `file` (a job file, or one with only `nats:`; the file is typed as
/// a job file, so a misspelt key is an error, but not validated as one), `JETRL__NATS__*` and `key=value`
/// overrides; `--namespace` wins over the file's `nats.namespace` / `run.name`. A status gives up on an
/// unreachable server after 5 s, and on an unanswered request after 10 s, unless the configuration says otherwise.
pub fn nats_config(
    file: Option<&Path>,
    overrides: &[String],
    namespace: Option<String>,
) -> anyhow::Result<(NatsConfig, String)> {
    let mut overrides = overrides.to_vec();
    let given = jetrl_config::load_value(file, &overrides)?;
    for (key, seconds) in [("connect_timeout_s", 5), ("request_timeout_s", 10)] {
        if given.pointer(&format!("/nats/{key}")).is_none() {
            overrides.push(format!("nats.{key}={seconds}"));
        }
    }
    let job: JobConfig = jetrl_config::load(file, &overrides)?;
    let namespace = match namespace {
        Some(ns) => ns,
        None => job.namespace()?.to_string(),
    };
    Ok((job.nats, namespace))
}

/// What `jetrl status` prints besides the summary.
pub struct Show {
    /// the row ledger (`--ledger`): a table, or only JSON lines with `json`
    pub ledger: bool,
    pub json: bool,
    /// these groups' buffer entries (`--uid`)
    pub uids: Vec<String>,
}

pub async fn status(cfg: &NatsConfig, namespace: &str, show: Show) -> anyhow::Result<()> {
    let Show { ledger, json, uids } = show;
    let names = Names::new(namespace).map_err(|e| anyhow::anyhow!("--namespace: {e}"))?;
    let bus = Bus::connect(cfg, &names, "jetrl-status").await?;
    // Looking a job up must not declare one: a mistyped namespace would leave empty buckets behind.
    if bus.jetstream().get_stream(names.prompts_stream()).await.is_err() {
        let mut jobs = Vec::new();
        let mut streams = bus.jetstream().stream_names();
        while let Some(Ok(stream)) = streams.next().await {
            jobs.extend(subjects::job_of_prompts_stream(&stream).map(str::to_string));
        }
        jobs.sort();
        anyhow::bail!(
            "no job {namespace:?} at {} (no stream {}); jobs there: {jobs:?}",
            cfg.url,
            names.prompts_stream()
        );
    }
    if ledger && json {
        return crate::ledger::print(&bus, true).await;
    }
    println!("job: {namespace}");
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
    let kv = bus.key_value(names.workers_bucket()).await?;
    let mut keys = kv.keys().await?;
    println!("workers:");
    let now = jetrl_wire::now_unix_ms();
    while let Some(Ok(key)) = keys.next().await {
        if let Ok(Some(value)) = kv.get(&key).await {
            if let Ok(beat) = Heartbeat::decode(value.as_ref()) {
                println!(
                    "  {:<10} {:<28} v{:<6} {:<11} inflight {:<4} seen {:.1}s ago {}",
                    beat.service,
                    beat.instance_id,
                    beat.policy_version,
                    beat.state().label(),
                    beat.inflight,
                    (now - beat.unix_ms) as f64 / 1000.0,
                    beat.message
                );
            }
        }
    }
    let listed = !uids.is_empty();
    let request = LedgerRequest { partition: String::new(), uids, limit: if listed { 100_000 } else { 1 } };
    let response: LedgerResponse = bus.request(names.buffer_ledger(), &request, bus.request_timeout()).await?;
    if !response.error.is_empty() {
        anyhow::bail!("replay buffer: {}", response.error);
    }
    println!("groups: {:?}", response.counts);
    if ledger {
        crate::ledger::print(&bus, false).await?;
    }
    if listed {
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
