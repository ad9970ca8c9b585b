//! `just bench cluster_sim` shortened, so the simulation cannot rot: the demo profile, 16 paced stand-in rollout
//! workers, 3 steps of each mode, the invariants only (no timing is judged): every step trained with a full batch,
//! nothing lost or duplicated, no group trained staler than the buffer's bound. Needs the service binaries
//! (`cargo build --bins`, which `just test` runs first).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use jetrl_tests::cluster_sim;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: the cluster simulation's invariants (16 stand-in workers, 3 steps of each mode)"]
async fn the_paced_simulation_trains_every_step_and_loses_nothing_in_every_mode() {
    let mut profile = cluster_sim::load_profile(&cluster_sim::profile_path("demo"));
    profile.steps = 3;
    let dir = tempfile::Builder::new().prefix("jetrl-cluster-sim-test-").tempdir().unwrap();
    let job = cluster_sim::profile_job(&profile, dir.path());
    let batch = u64::from(job.data.train_batch_size);
    for mode in ["sync", "colocate_async", "separate_async"] {
        let o = cluster_sim::run_mode(&profile, mode, 16, profile.time_scale, dir.path()).await;
        let trainer_log = std::fs::read_to_string(dir.path().join("trainer.log")).unwrap_or_default();
        assert!(o.trainer_ok, "{mode}: the trainer failed:\n{trainer_log}");
        assert_eq!(o.steps_trained, vec![1, 2, 3], "{mode}: every step trained once:\n{trainer_log}");
        assert!(o.groups_per_step.iter().all(|&g| g == batch), "{mode}: a full batch every step: {o:?}");
        assert_eq!((o.lost, o.duplicated, o.worker_errors), (0, 0, 0), "{mode}: nothing lost or duplicated: {o:?}");
        let trained: u64 = o.staleness.values().sum();
        assert_eq!(trained, 3 * batch, "{mode}: every trained group was completed by a stand-in: {o:?}");
        if mode == "sync" {
            assert_eq!(o.staleness.keys().copied().collect::<Vec<_>>(), vec![0], "sync is on-policy: {o:?}");
        }
        let stalest = o.staleness.keys().copied().max().unwrap_or(0);
        assert!(stalest <= o.staleness_max_allowed, "{mode}: staleness {stalest} over the bound: {o:?}");
    }
}
