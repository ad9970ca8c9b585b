//! c10d through the shim with real processes: Gloo on the CPU, a real TCPStore on a free port of 127.0.0.1.
//!
//! Ranks are child processes of the `c10d_rank` helper binary, with the role in environment variables; a child exits
//! 0 when its role passed.
#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use jetrl_torch_ext::{Backend, DistError, ProcessGroup, ProcessGroupOptions, ReduceOp};
use tch::{Device, Kind, Tensor};

const ROLE: &str = "JETRL_C10D_ROLE";
const RANK: &str = "JETRL_C10D_RANK";
const WORLD: &str = "JETRL_C10D_WORLD";
const PORT: &str = "JETRL_C10D_PORT";
const SIGNAL: &str = "JETRL_C10D_SIGNAL";

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn options(rank: usize, world: usize, port: u16, timeout: Duration) -> ProcessGroupOptions {
    ProcessGroupOptions::new(Backend::Gloo, rank, world, "127.0.0.1", port).with_timeout(timeout)
}

fn spawn_rank(role: &str, rank: usize, world: usize, port: u16, signal: Option<&Path>) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_c10d_rank"));
    cmd.env(ROLE, role)
        .env(RANK, rank.to_string())
        .env(WORLD, world.to_string())
        .env(PORT, port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(signal) = signal {
        cmd.env(SIGNAL, signal);
    }
    cmd.spawn().unwrap()
}

/// Waits for a child, killing it past `deadline`; panics with its output unless it exited 0.
fn expect_success(name: &str, mut child: Child, deadline: Instant) -> Output {
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!("{name} ran past its deadline\nstdout:\n{}\nstderr:\n{}", text(&out.stdout), text(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    print!("{}", text(&out.stdout));
    assert!(
        out.status.success(),
        "{name} failed ({})\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

// ---------------------------------------------------------------------------------------------------------------
// tests

#[test]
fn two_ranks_run_every_collective() {
    let port = free_port();
    let deadline = Instant::now() + Duration::from_secs(20);
    let children: Vec<Child> = (0..2).map(|r| spawn_rank("collectives", r, 2, port, None)).collect();
    for (rank, child) in children.into_iter().enumerate() {
        expect_success(&format!("rank {rank}"), child, deadline);
    }
}

#[test]
fn rank_without_a_store_fails_within_its_timeout() {
    let port = free_port();
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let err = ProcessGroup::new(options(1, 2, port, timeout)).unwrap_err();
    let elapsed = start.elapsed();
    let message = err.to_string();
    println!("{message}");
    assert!(matches!(err, DistError::StoreUnreachable { rank: 1, .. }), "{message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")) && message.contains("rank 1"), "{message}");
    assert!(elapsed >= timeout.mul_f32(0.9), "gave up early: {elapsed:?}");
    assert!(elapsed < timeout + Duration::from_secs(4), "took {elapsed:?}");
}

#[test]
fn rank_zero_alone_times_out_in_the_rendezvous() {
    let port = free_port();
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let err = ProcessGroup::new(options(0, 2, port, timeout)).unwrap_err();
    let elapsed = start.elapsed();
    let message = err.to_string();
    println!("{message}");
    assert!(matches!(err, DistError::Timeout { op: "rendezvous", rank: 0, .. }), "{message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(elapsed < timeout + Duration::from_secs(4), "took {elapsed:?}");
}

#[test]
fn rank_not_below_world_size_is_refused() {
    let err = ProcessGroup::new(options(2, 2, free_port(), Duration::from_secs(1))).unwrap_err();
    assert!(matches!(err, DistError::InvalidOptions(_)), "{err}");
    assert!(err.to_string().contains("rank 2 is not below the world size 2"), "{err}");
    let err = ProcessGroup::new(options(0, 0, free_port(), Duration::from_secs(1))).unwrap_err();
    assert!(matches!(err, DistError::InvalidOptions(_)), "{err}");
}

#[test]
fn nccl_without_the_backend_or_a_gpu_is_a_clear_error() {
    let opts =
        ProcessGroupOptions::new(Backend::Nccl, 0, 1, "127.0.0.1", free_port()).with_timeout(Duration::from_secs(3));
    if !jetrl_torch_ext::nccl_built() {
        let err = ProcessGroup::new(opts).unwrap_err();
        println!("{err}");
        assert!(matches!(err, DistError::NotBuilt { backend: Backend::Nccl, .. }), "{err}");
    } else if !tch::Cuda::is_available() {
        let err = ProcessGroup::new(opts).unwrap_err();
        println!("{err}");
        assert!(matches!(err, DistError::Failed { op: "rendezvous", .. }), "{err}");
        assert!(err.to_string().contains("needs a CUDA device"), "{err}");
    } else {
        // a GPU host: the NCCL path with world size 1 (a real group) reduces on the device
        let mut pg = ProcessGroup::new(opts).unwrap();
        let mut t = Tensor::ones([4], (Kind::Float, Device::Cuda(0)));
        pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(Vec::<f32>::try_from(t.to_device(Device::Cpu)).unwrap(), vec![1.0; 4]);
    }
}

/// The CUDA allocator's peak: nothing without the CUDA part or a device; on a GPU, at least a tensor just made.
#[test]
fn cuda_peak_allocated_is_none_without_a_gpu_and_counts_a_tensor_with_one() {
    if jetrl_torch_ext::nccl_built() && tch::Cuda::is_available() {
        let _reset = jetrl_torch_ext::cuda_peak_allocated(0, true);
        let t = Tensor::zeros([1 << 20], (Kind::Float, Device::Cuda(0)));
        let peak = jetrl_torch_ext::cuda_peak_allocated(0, false).unwrap();
        assert!(peak >= 4 << 20, "a 4 MiB tensor, peak {peak}");
        drop(t);
    } else {
        assert_eq!(jetrl_torch_ext::cuda_peak_allocated(0, false), None);
    }
    assert_eq!(jetrl_torch_ext::cuda_peak_allocated(4096, false), None, "no device 4096");
}

#[test]
fn a_rank_started_twice_is_refused() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut children: Vec<Child> = (0..2).map(|r| spawn_rank("hold", r, 2, port, Some(dir.path()))).collect();
    // wait until both ranks hold the formed group (rank 1 has claimed its rank)
    while !(dir.path().join("ready-0").exists() && dir.path().join("ready-1").exists()) {
        assert!(Instant::now() < deadline, "the group never formed");
        for child in &mut children {
            assert!(child.try_wait().unwrap().is_none(), "a rank exited early");
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    let start = Instant::now();
    let err = ProcessGroup::new(options(1, 2, port, Duration::from_secs(3))).unwrap_err();
    let message = err.to_string();
    println!("{message}");
    assert!(matches!(err, DistError::DuplicateRank { rank: 1, .. }), "{message}");
    assert!(message.contains("rank 1 started twice") && message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(start.elapsed() < Duration::from_secs(2), "took {:?}", start.elapsed());

    std::fs::write(dir.path().join("done"), b"").unwrap();
    for (rank, child) in children.into_iter().enumerate() {
        expect_success(&format!("rank {rank}"), child, deadline);
    }
}

#[test]
fn ranks_pass_commands_through_the_store_without_a_collective() {
    let port = free_port();
    let deadline = Instant::now() + Duration::from_secs(20);
    let children: Vec<Child> = (0..3).map(|r| spawn_rank("store", r, 3, port, None)).collect();
    for (rank, child) in children.into_iter().enumerate() {
        expect_success(&format!("rank {rank}"), child, deadline);
    }
}

#[test]
fn a_silent_peer_times_out_the_collective() {
    let port = free_port();
    let deadline = Instant::now() + Duration::from_secs(20);
    let children: Vec<Child> = (0..2).map(|r| spawn_rank("timeout", r, 2, port, None)).collect();
    for (rank, child) in children.into_iter().enumerate() {
        expect_success(&format!("rank {rank}"), child, deadline);
    }
}

#[test]
fn a_rank_started_for_another_world_size_is_refused() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    // rank 0 of a group of 2 hosts the store and waits for its rank 1; a rank 1 started for a group of 3 knocks
    let mut zero = spawn_rank("hold", 0, 2, port, Some(dir.path()));
    let start = Instant::now();
    let err = ProcessGroup::new(options(1, 3, port, Duration::from_secs(5))).unwrap_err();
    let message = err.to_string();
    println!("{message}");
    assert!(matches!(err, DistError::InvalidOptions(_)), "{message}");
    assert!(message.contains("group of 3") && message.contains("rank 0 leads a group of 2"), "{message}");
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    let _ = zero.kill();
    let _ = zero.wait();
}
