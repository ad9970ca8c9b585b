//! A training job on a three-node JetStream cluster (deploy/nats/gen.sh --cluster: routes over TLS, the
//! least-privilege identities, replicas 3), every service under its own identity: the node leading the PROMPTS
//! stream is SIGKILLed mid-run and started again later. The run completes, the ledger shows every row trained
//! exactly once, and the services counted the disconnections and the leader elections.
//!
//! Every call of the services waits out the election that follows the leader's death (group records, lease,
//! weight store and announcement, publishes, topology lookups, the buffer's GROUPS watch and REWARDS consumer);
//! docs/deploy.md, "The cluster", says how. `just test-cluster` runs this test alone; `JETRL_TEST_KEEP=1` keeps
//! its logs and stores, `JETRL_TEST_LOG=info,jetrl_bus=debug` (a `RUST_LOG` filter) makes the services say more.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jetrl_tests::secure_nats::{all_but_the_trainer, spawn_service, SecureCluster, Service};

const STEPS: usize = 10;
const BATCH: usize = 4;

fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

fn metric_lines(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl")).map(|t| t.lines().count()).unwrap_or(0)
}

/// Sum of a counter family on a service's /metrics endpoint.
fn scrape_sum(addr: &str, family: &str) -> f64 {
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else { return 0.0 };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(stream, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut body = String::new();
    let _ = stream.read_to_string(&mut body);
    jetrl_tests::metric_family_sum(&body, family)
}

/// Waits for `done`; on a timeout, fails with `what` and `context()` (read then: the logs so far).
fn wait_until(what: &str, timeout: Duration, context: impl Fn() -> String, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < timeout, "{what} (waited {timeout:?})\n{}", context());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "slow tier: a three-node NATS cluster losing a node mid-run"]
fn a_job_on_a_three_node_cluster_survives_a_killed_node_and_trains_every_row_once() {
    let mut cluster = SecureCluster::start();
    let dir = jetrl_tests::test_dir("cluster-job");
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny-digits", &model, 1).unwrap();
    let run: PathBuf = dir.path().join("run");
    let reward_metrics = free_addr();
    let job = [
        format!("run.dir={}", run.display()),
        format!("model.path={}", model.display()),
        format!("trainer.total_training_steps={STEPS}"),
        "trainer.test_freq=-1".to_string(),
        format!("data.train_batch_size={BATCH}"),
        "rollout.n=2".to_string(),
        format!("reward.metrics_addr={reward_metrics}"),
        // the buffer reads its inputs again whenever the trainer waits a second with nothing coming in: through
        // the failover too, where a missed update would otherwise stall the run
        "buffer.reread_after_s=1".to_string(),
    ];
    let spawn = |user: &str, binary: &str| spawn_service(dir.path(), user, binary, &job, &cluster.overrides(user));
    let logs = || -> String {
        ["trainer", "checkpoint-sync", "replay-buffer", "reward-service", "rollout-worker"]
            .iter()
            .map(|u| {
                let text = std::fs::read_to_string(dir.path().join(format!("{u}.log"))).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
                format!("----- {u} (last 40 lines) -----\n{}\n", tail.join("\n"))
            })
            .collect()
    };
    let mut trainer = spawn("trainer", "jetrl-trainer");
    let _services: Vec<Service> = all_but_the_trainer(&spawn);
    // a trainer that exits before the end fails the test at once, not after a wait's timeout
    let steps_while_training = |trainer: &mut Service| {
        if let Some(status) = trainer.0.try_wait().unwrap() {
            panic!("the trainer exited early ({status})\n{}", logs());
        }
        metric_lines(&run)
    };

    wait_until("three steps before the node is killed", Duration::from_secs(240), logs, || {
        steps_while_training(&mut trainer) >= 3
    });
    // the node leading the job's PROMPTS stream: its death forces an election
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let leader = runtime.block_on(async {
        let bus = cluster.connect("status").await;
        let mut stream = bus.jetstream().get_stream(bus.names().prompts_stream()).await.unwrap();
        let info = stream.info().await.unwrap();
        assert_eq!(info.config.num_replicas, 3, "the job's streams are replicated on the three nodes");
        // a follower answers a direct get from what it has applied: the group records are read from the leader
        let groups = bus.jetstream().get_stream(format!("KV_{}", bus.names().groups_bucket())).await.unwrap();
        assert!(!groups.cached_info().config.allow_direct, "GROUPS is read by direct get in a cluster");
        info.cluster.as_ref().and_then(|c| c.leader.clone()).expect("a stream leader")
    });
    assert!(cluster.nodes().contains(&leader), "leader {leader} is not one of {:?}", cluster.nodes());
    let killed_at = metric_lines(&run);
    cluster.kill(&leader);
    wait_until(&format!("training went on while {leader} was down"), Duration::from_secs(240), logs, || {
        steps_while_training(&mut trainer) >= killed_at + 3
    });
    cluster.restart(&leader);

    let started = Instant::now();
    let status = loop {
        if let Some(status) = trainer.0.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "the trainer did not finish\n{}", logs());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "the trainer failed:\n{}", logs());
    assert_eq!(metric_lines(&run), STEPS, "one metrics line per step");

    // every dataset row drawn was trained exactly once
    let ledger = std::fs::read_to_string(run.join("ledger.jsonl")).expect("ledger.jsonl");
    let mut rows = std::collections::HashMap::new();
    for line in ledger.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        *rows.entry((row["epoch"].as_u64().unwrap(), row["row"].as_u64().unwrap())).or_insert(0) += 1;
        assert_eq!(row["fate"], "trained", "{row}\nledger:\n{ledger}\n{}", logs());
    }
    assert_eq!(rows.len(), STEPS * BATCH, "{rows:?}");
    assert!(rows.values().all(|&n| n == 1), "a row was decided twice: {rows:?}");

    // the reward service (subscribed to JetStream advisories) counted the election
    let elections = scrape_sum(&reward_metrics, "jetrl_bus_leader_elections_total");
    assert!(elections >= 1.0, "no leader election counted by the reward service\n{}", logs());
    // A reply's permission (allow_responses) lives on the node that delivered the request: a responder whose
    // connection moved to another node while the cluster re-formed has that one reply refused, and the requester
    // asks again after its timeout (the run above completed through it). Anything else refused is a defect.
    let (replies, others): (Vec<String>, Vec<String>) =
        cluster.violations().into_iter().partition(|v| v.contains("Publish Violation - Subject \"_INBOX_"));
    if !replies.is_empty() {
        eprintln!("replies refused during the failover: {replies:?}");
    }
    assert!(others.is_empty(), "refused: {others:?}");
}
