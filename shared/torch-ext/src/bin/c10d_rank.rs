//! One rank of the c10d tests (`tests/c10d.rs`): a child process that forms a Gloo group with its siblings through a
//! TCPStore on 127.0.0.1 and plays the role named in `JETRL_C10D_ROLE`; it exits 0 when every check of the role
//! passed. A test helper, not a tool.
#![allow(clippy::unwrap_used)] // test helper: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jetrl_torch_ext::{Backend, DistError, ProcessGroup, ProcessGroupOptions, ReduceOp};
use tch::{Device, Kind, Tensor};

const ROLE: &str = "JETRL_C10D_ROLE";
const RANK: &str = "JETRL_C10D_RANK";
const WORLD: &str = "JETRL_C10D_WORLD";
const PORT: &str = "JETRL_C10D_PORT";
const SIGNAL: &str = "JETRL_C10D_SIGNAL";

fn options(rank: usize, world: usize, port: u16, timeout: Duration) -> ProcessGroupOptions {
    ProcessGroupOptions::new(Backend::Gloo, rank, world, "127.0.0.1", port).with_timeout(timeout)
}

fn f32s(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
}

fn i64s(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t.flatten(0, -1)).unwrap()
}

fn cpu(kind: Kind) -> (Kind, Device) {
    (kind, Device::Cpu)
}

fn main() {
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: this is a test helper"));
    let role = var(ROLE);
    let rank: usize = var(RANK).parse().unwrap();
    let world: usize = var(WORLD).parse().unwrap();
    let port: u16 = var(PORT).parse().unwrap();
    match role.as_str() {
        "collectives" => collectives(rank, world, port),
        "hold" => hold(rank, world, port, &PathBuf::from(var(SIGNAL))),
        "timeout" => collective_timeout(rank, world, port),
        "store" => store_channel(rank, world, port),
        other => panic!("unknown role {other}"),
    }
    println!("rank {rank}: role {role} passed");
}

/// Every collective on known tensors, results checked exactly.
fn collectives(rank: usize, world: usize, port: u16) {
    let opts = options(rank, world, port, Duration::from_secs(8)).with_store_prefix("attempt-0");
    let mut pg = ProcessGroup::new(opts).unwrap();
    assert_eq!((pg.rank(), pg.world_size(), pg.backend()), (rank, world, Backend::Gloo));
    let w = world as f32;
    let scale = (rank + 1) as f32;
    // Σ_r (r+1) and max_r (r+1)
    let sum_scale = (1..=world).sum::<usize>() as f32;

    // all_reduce: Sum, Avg (Gloo: sum then divide), Max, integers
    let base: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let mut t = Tensor::from_slice(&base).reshape([2, 3]) * f64::from(scale);
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(f32s(&t), base.iter().map(|x| x * sum_scale).collect::<Vec<_>>());
    assert_eq!(t.size(), vec![2, 3]);

    let mut t = Tensor::from_slice(&base) * f64::from(scale);
    pg.all_reduce(&mut t, ReduceOp::Avg).unwrap();
    assert_eq!(f32s(&t), base.iter().map(|x| x * sum_scale / w).collect::<Vec<_>>());

    let mine: Vec<f32> = vec![rank as f32, 10.0 - rank as f32, -(rank as f32)];
    let mut t = Tensor::from_slice(&mine);
    pg.all_reduce(&mut t, ReduceOp::Max).unwrap();
    assert_eq!(f32s(&t), vec![(world - 1) as f32, 10.0, 0.0]);

    let mut t = Tensor::from_slice(&[rank as i64, 1 << 40]);
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(i64s(&t), vec![(0..world as i64).sum::<i64>(), (1i64 << 40) * world as i64]);

    // Avg of integers is refused before anything is sent (no rank issues it, so the group stays in step)
    let mut t = Tensor::from_slice(&[1i64, 2]);
    let err = pg.all_reduce(&mut t, ReduceOp::Avg).unwrap_err();
    assert!(matches!(err, DistError::InvalidArgument { op: "all_reduce", .. }), "{err}");

    // reduce_scatter: input world × n, this rank keeps slice `rank`
    let n = 4usize;
    let input_base: Vec<f32> = (0..world * n).map(|i| i as f32).collect();
    let input = Tensor::from_slice(&input_base) * f64::from(scale);
    let mine = &input_base[rank * n..(rank + 1) * n];
    for (op, expected) in [
        (ReduceOp::Sum, mine.iter().map(|x| x * sum_scale).collect::<Vec<_>>()),
        (ReduceOp::Avg, mine.iter().map(|x| x * sum_scale / w).collect()),
        (ReduceOp::Max, mine.iter().map(|x| x * w).collect()),
    ] {
        let mut out = Tensor::full([n as i64], -1.0, cpu(Kind::Float));
        pg.reduce_scatter(&mut out, &input, op).unwrap();
        assert_eq!(f32s(&out), expected, "reduce_scatter {op:?}");
    }
    // shapes other than flat: a [world, 2, 2] input scatters into a [2, 2] output
    let input = (Tensor::arange((world * n) as i64, cpu(Kind::Float)) * f64::from(scale)).reshape([world as i64, 2, 2]);
    let mut out = Tensor::zeros([2, 2], cpu(Kind::Float));
    pg.reduce_scatter(&mut out, &input, ReduceOp::Sum).unwrap();
    assert_eq!(f32s(&out), mine.iter().map(|x| x * sum_scale).collect::<Vec<_>>());
    // bf16 through the same path
    let input = Tensor::ones([(world * n) as i64], cpu(Kind::BFloat16)) * f64::from(scale);
    let mut out = Tensor::zeros([n as i64], cpu(Kind::BFloat16));
    pg.reduce_scatter(&mut out, &input, ReduceOp::Sum).unwrap();
    assert_eq!(f32s(&out.to_kind(Kind::Float)), vec![sum_scale; n]);
    // a wrongly sized input is refused locally
    let mut out = Tensor::zeros([3], cpu(Kind::Float));
    let err = pg.reduce_scatter(&mut out, &Tensor::zeros([5], cpu(Kind::Float)), ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, DistError::InvalidArgument { op: "reduce_scatter", .. }), "{err}");

    // all_gather_into: rank-major
    let input = Tensor::full([3], scale as f64, cpu(Kind::Float));
    let mut out = Tensor::zeros([world as i64, 3], cpu(Kind::Float));
    pg.all_gather_into(&mut out, &input).unwrap();
    let expected: Vec<f32> = (0..world).flat_map(|r| vec![(r + 1) as f32; 3]).collect();
    assert_eq!(f32s(&out), expected);
    let input = Tensor::from_slice(&[rank as i64 * 10, rank as i64 * 10 + 1]);
    let mut out = Tensor::zeros([(2 * world) as i64], cpu(Kind::Int64));
    pg.all_gather_into(&mut out, &input).unwrap();
    assert_eq!(i64s(&out), (0..world as i64).flat_map(|r| [r * 10, r * 10 + 1]).collect::<Vec<_>>());

    // broadcast from the last rank
    let root = world - 1;
    let mut t = Tensor::full([5], rank as f64, cpu(Kind::Float));
    pg.broadcast(&mut t, root).unwrap();
    assert_eq!(f32s(&t), vec![root as f32; 5]);
    let err = pg.broadcast(&mut t, world).unwrap_err();
    assert!(matches!(err, DistError::InvalidArgument { op: "broadcast", .. }), "{err}");

    pg.barrier().unwrap();
}

/// Rank 0 writes a command into the store; the others wait for it (first for a key that never comes: `None` after
/// the wait, not an error), read it and answer under their own keys, which rank 0 reads.
fn store_channel(rank: usize, world: usize, port: u16) {
    let mut pg = ProcessGroup::new(options(rank, world, port, Duration::from_secs(8))).unwrap();
    if rank == 0 {
        pg.store_set("cmd/1", b"train step 7").unwrap();
        for r in 1..world {
            let answer = pg.store_get(&format!("ack/1/{r}"), Duration::from_secs(8)).unwrap();
            assert_eq!(answer.as_deref(), Some(format!("rank {r} read train step 7").as_bytes()));
        }
        // a command every rank has read is deleted; an empty value is a value
        pg.store_delete("cmd/1").unwrap();
        pg.store_delete("cmd/never").unwrap();
        pg.store_set("cmd/2", b"").unwrap();
    } else {
        let start = Instant::now();
        assert_eq!(pg.store_get("cmd/never", Duration::from_millis(300)).unwrap(), None);
        assert!(start.elapsed() >= Duration::from_millis(250), "{:?}", start.elapsed());
        let cmd = pg.store_get("cmd/1", Duration::from_secs(8)).unwrap().unwrap();
        pg.store_set(
            &format!("ack/1/{rank}"),
            format!("rank {rank} read {}", String::from_utf8_lossy(&cmd)).as_bytes(),
        )
        .unwrap();
        assert_eq!(pg.store_get("cmd/2", Duration::from_secs(8)).unwrap(), Some(Vec::new()));
        assert_eq!(pg.store_get("cmd/1", Duration::from_millis(200)).unwrap(), None, "cmd/1 was deleted before cmd/2");
    }
    pg.barrier().unwrap();
}

/// Forms the group, says so with a `ready-<rank>` file in `dir`, then holds it until the test writes `dir/done`
/// (so that a duplicate rank can knock meanwhile).
fn hold(rank: usize, world: usize, port: u16, dir: &Path) {
    let mut pg = ProcessGroup::new(options(rank, world, port, Duration::from_secs(8))).unwrap();
    pg.barrier().unwrap();
    std::fs::write(dir.join(format!("ready-{rank}")), b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(8);
    while !dir.join("done").exists() {
        assert!(Instant::now() < deadline, "no signal from the test");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut t = Tensor::ones([2], cpu(Kind::Float));
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(f32s(&t), vec![world as f32; 2]);
    pg.barrier().unwrap();
}

/// Rank 0 all-reduces while rank 1 never does: rank 0 must get a timeout naming the op, rank and store.
fn collective_timeout(rank: usize, world: usize, port: u16) {
    let timeout = Duration::from_secs(2);
    let mut pg = ProcessGroup::new(options(rank, world, port, timeout)).unwrap();
    pg.barrier().unwrap();
    if rank == 0 {
        let mut t = Tensor::ones([4], cpu(Kind::Float));
        let start = Instant::now();
        let err = pg.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
        let elapsed = start.elapsed();
        let message = err.to_string();
        assert!(matches!(err, DistError::Timeout { op: "all_reduce", rank: 0, .. }), "{message}");
        assert!(message.contains("all_reduce") && message.contains("rank 0"), "{message}");
        assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
        assert!(elapsed >= timeout.mul_f32(0.9) && elapsed < timeout + Duration::from_secs(3), "{elapsed:?}");
        println!("rank 0: {message}");
    } else {
        // stay connected (silent, not gone) past rank 0's deadline
        std::thread::sleep(timeout + Duration::from_secs(2));
    }
}
