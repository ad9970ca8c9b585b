//! `just bench cluster_sim`: the trainer's three schedules at cluster scale, by a paced simulation
//! (`jetrl_tests::cluster_sim`: the real trainer with the paced stand-in learner, the real buffer, reward service
//! and checkpoint-sync, a fleet of paced stand-in rollout workers in this process).
//!
//! Knobs (env): `JETRL_SIM_PROFILE` (`h100-7b-grpo-math`; a name under `benches/cluster_sim/` or a path),
//! `JETRL_SIM_WORKERS` (the profile's largest fleet), `JETRL_SIM_MODES` (`sync,colocate_async,separate_async`),
//! `JETRL_SIM_TIME_SCALE` (the profile's), `JETRL_SIM_STEPS` (the profile's), `JETRL_SIM_KEEP` (1: keep the logs and
//! run directories), `JETRL_SIM_SCALE_CHECK` (1: run separate_async again at half the time
//! scale, to show the result does not depend on it; 0: not), `JETRL_SIM_CHAOS` (1: kill -9 a random stand-in
//! worker every 10 s, restarted at once under its instance id, and a random service every 60 s, restarted after a
//! second: checkpoint-sync, the replay buffer, the reward service or the trainer, which resumes from its newest
//! checkpoint, saved every step; the lines report the kills, the trainer's longest stall and the longest and
//! median step), `JETRL_SIM_CHAOS_KILL` (the services chaos may kill, comma-separated; all four by default).
//!
//! One JSON line per mode, then the summary: `{"bench":"cluster_sim","profile":…,"workers":…,
//! "speedup_separate":…,"speedup_colocate":…,"ideal_bound":…,"trainer_wait_share":…,"sample_p99_ms":…,
//! "lost":…,"duplicated":…}`.

use jetrl_tests::bench::knob;
use jetrl_tests::cluster_sim::{self, round};

#[tokio::main]
async fn main() {
    let name: String = knob("JETRL_SIM_PROFILE", "h100-7b-grpo-math".to_string());
    let mut profile = cluster_sim::load_profile(&cluster_sim::profile_path(&name));
    profile.steps = knob("JETRL_SIM_STEPS", profile.steps);
    let workers: usize = knob("JETRL_SIM_WORKERS", profile.workers.iter().copied().max().unwrap_or(16));
    let modes: String = knob("JETRL_SIM_MODES", "sync,colocate_async,separate_async".to_string());
    let scale: f64 = knob("JETRL_SIM_TIME_SCALE", profile.time_scale);
    let scale_check: u32 = knob("JETRL_SIM_SCALE_CHECK", 1);
    let dir = tempfile::Builder::new().prefix("jetrl-cluster-sim-").tempdir().expect("tempdir");
    // JETRL_SIM_KEEP=1: the logs and run directories stay (their path is printed)
    let dir = if knob("JETRL_SIM_KEEP", 0u32) > 0 {
        let kept = dir.keep();
        println!("cluster_sim: logs and runs kept in {}", kept.display());
        Dir::Kept(kept)
    } else {
        Dir::Temp(dir)
    };
    let job = cluster_sim::profile_job(&profile, dir.path());
    let bound = cluster_sim::ideal_bound(&profile, &job, workers, 50);
    println!(
        "cluster_sim: profile {} ({} steps, {} stand-in workers, time scale {scale}: modelled seconds per real \
         second); bound from the profile: sync step {:.1} s (generate {:.1} s + update and publish {:.1} s), \
         ideal async step {:.1} s (steady generation {:.1} s), ideal speedup {:.2}",
        profile.name,
        profile.steps,
        workers,
        bound.sync_step_s,
        bound.generate_sync_s,
        bound.update_s,
        bound.async_step_s,
        bound.generate_steady_s,
        bound.speedup()
    );
    let mut outcomes = Vec::new();
    for mode in modes.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        let o = cluster_sim::run_mode(&profile, mode, workers, scale, dir.path()).await;
        println!("{}", cluster_sim::mode_json(&profile, &o, &bound));
        outcomes.push(o);
    }
    let mut scale_check_line = serde_json::Value::Null;
    if scale_check > 0 && modes.contains("separate_async") {
        let o = cluster_sim::run_mode(&profile, "separate_async", workers, scale / 2.0, dir.path()).await;
        let line = cluster_sim::mode_json(&profile, &o, &bound);
        println!("{line}");
        let at_full = outcomes.iter().find(|o| o.mode == "separate_async").map_or(f64::NAN, |o| o.wall_s);
        scale_check_line = serde_json::json!({
            "time_scale": [scale, scale / 2.0],
            "wall_s": [round(at_full, 1), round(o.wall_s, 1)],
            "relative_difference": round((o.wall_s - at_full).abs() / at_full, 4),
        });
    }
    let wall = |mode: &str| outcomes.iter().find(|o| o.mode == mode).map_or(f64::NAN, |o| o.wall_s);
    let steady = |mode: &str| outcomes.iter().find(|o| o.mode == mode).map_or(f64::NAN, |o| o.steady_step_s);
    let separate = outcomes.iter().find(|o| o.mode == "separate_async");
    let mut p99 = separate.map_or(f64::NAN, |o| cluster_sim::percentile(&o.sample_latency_ms, 0.99));
    if p99.is_nan() {
        p99 = outcomes.iter().map(|o| cluster_sim::percentile(&o.sample_latency_ms, 0.99)).fold(f64::NAN, f64::max);
    }
    let speedup_separate = wall("sync") / wall("separate_async");
    // the bound is per step in steady state: compared with the steps after the first (which fills the pipeline)
    let steady_separate = steady("sync") / steady("separate_async");
    let summary = serde_json::json!({
        "bench": "cluster_sim",
        "profile": profile.name,
        "workers": workers,
        "time_scale": scale,
        "sync_s": round(wall("sync"), 1),
        "colocate_async_s": round(wall("colocate_async"), 1),
        "separate_async_s": round(wall("separate_async"), 1),
        "speedup_separate": round(speedup_separate, 3),
        "speedup_colocate": round(wall("sync") / wall("colocate_async"), 3),
        "ideal_bound": round(bound.speedup(), 3),
        "steady_speedup_separate": round(steady_separate, 3),
        "steady_speedup_colocate": round(steady("sync") / steady("colocate_async"), 3),
        "of_ideal": round(steady_separate / bound.speedup(), 3),
        "trainer_wait_share": round(separate.map_or(f64::NAN, |o| o.trainer_wait_share), 4),
        "fleet_idle_share": round(separate.map_or(f64::NAN, |o| o.fleet_idle_share), 4),
        "sample_p99_ms": round(p99, 2),
        "reward_queue_max": outcomes.iter().map(|o| o.reward_queue_max).max().unwrap_or(0),
        "lost": outcomes.iter().map(|o| o.lost).sum::<u64>(),
        "duplicated": outcomes.iter().map(|o| o.duplicated).sum::<u64>(),
        "all_steps_trained": outcomes.iter().all(|o| o.trainer_ok && o.steps_trained.len() as u64 == o.steps),
        "scale_check": scale_check_line,
        "chaos": outcomes.first().is_some_and(|o| o.chaos).then(|| serde_json::json!({
            "workers_killed": outcomes.iter().map(|o| o.workers_killed).sum::<u64>(),
            "services_killed": outcomes.iter().flat_map(|o| o.services_killed.iter().cloned()).collect::<Vec<_>>(),
            "longest_stall_s": outcomes.iter().map(|o| round(o.longest_stall_s, 1)).collect::<Vec<_>>(),
            "longest_step_s": outcomes.iter().map(|o| round(o.longest_step_s, 1)).collect::<Vec<_>>(),
            "median_step_s": outcomes.iter().map(|o| round(o.median_step_s, 1)).collect::<Vec<_>>(),
        })),
    });
    println!("{summary}");
}

/// Where the logs and run directories go: a temporary directory, or one kept after the run.
enum Dir {
    Temp(tempfile::TempDir),
    Kept(std::path::PathBuf),
}

impl Dir {
    fn path(&self) -> &std::path::Path {
        match self {
            Dir::Temp(dir) => dir.path(),
            Dir::Kept(path) => path,
        }
    }
}
