//! `jetrl status`: a snapshot of a running job.

use std::time::Duration;

use futures::StreamExt;
use jetrl_bus::Bus;
use jetrl_config::NatsConfig;
use jetrl_wire::subjects::{self, Names};
use jetrl_wire::v1::{Heartbeat, LedgerRequest, LedgerResponse};
use jetrl_wire::Message;

pub async fn status(url: &str, namespace: &str, ledger: bool, uids: Vec<String>) -> anyhow::Result<()> {
    let cfg = NatsConfig { url: url.to_string(), connect_timeout_s: 5.0, ..NatsConfig::default() };
    let names = Names::new(namespace).map_err(|e| anyhow::anyhow!("--namespace: {e}"))?;
    let bus = Bus::connect(&cfg, &names, "jetrl-status").await?;
    // Looking a job up must not declare one: a mistyped namespace would leave empty buckets behind.
    if bus.jetstream().get_stream(names.prompts_stream()).await.is_err() {
        let mut jobs = Vec::new();
        let mut streams = bus.jetstream().stream_names();
        while let Some(Ok(stream)) = streams.next().await {
            jobs.extend(subjects::job_of_prompts_stream(&stream).map(str::to_string));
        }
        jobs.sort();
        anyhow::bail!("no job {namespace:?} at {url} (no stream {}); jobs there: {jobs:?}", names.prompts_stream());
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
                    "  {:<10} {:<28} v{:<6} {:<8} inflight {:<4} seen {:.1}s ago",
                    beat.service,
                    beat.instance_id,
                    beat.policy_version,
                    beat.state,
                    beat.inflight,
                    (now - beat.unix_ms) as f64 / 1000.0
                );
            }
        }
    }
    let request = LedgerRequest { partition: String::new(), uids, limit: if ledger { 100_000 } else { 1 } };
    let response: LedgerResponse = bus.request(names.buffer_ledger(), &request, Duration::from_secs(10)).await?;
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
