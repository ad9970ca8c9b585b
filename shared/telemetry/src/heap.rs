//! The allocator's own figures for this process, beside its RSS: how much of what malloc holds the program is
//! using (`jetrl_process_heap_in_use_bytes`) and how much is free inside malloc's arenas
//! (`jetrl_process_heap_free_bytes`). When a process's RSS rises, they tell a growing live heap (in use rises)
//! from an allocator holding freed memory it cannot return (free rises, or neither while RSS does: pages touched
//! in fragmented arenas). Recorded every few seconds by the metrics upkeep thread ([`crate::prometheus`]).
//!
//! glibc only (`mallinfo2`); elsewhere (or under an allocator preloaded in its place) nothing is recorded.

/// The gauge of the bytes the program has allocated and not freed (in malloc's arenas and in its own mappings).
pub const IN_USE_METRIC: &str = "jetrl_process_heap_in_use_bytes";
/// The gauge of the bytes free inside malloc's arenas (held by the allocator, not by the program).
pub const FREE_METRIC: &str = "jetrl_process_heap_free_bytes";

/// What malloc reports for the whole process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapFigures {
    /// allocated and not freed: arena chunks in use plus chunks malloc mapped on their own (large allocations)
    pub in_use: u64,
    /// free chunks inside the arenas
    pub free: u64,
}

/// This process's figures from glibc's `mallinfo2` (it walks every arena under its lock: call it every few
/// seconds, not per allocation). None where the C library is not glibc.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn figures() -> Option<HeapFigures> {
    // SAFETY: mallinfo2 takes no arguments, only reads the allocator's state under its own locks and returns a
    // plain struct by value.
    #[allow(unsafe_code)]
    let info = unsafe { libc::mallinfo2() };
    Some(HeapFigures { in_use: (info.uordblks + info.hblkhd) as u64, free: info.fordblks as u64 })
}

/// This process's figures: none where the C library is not glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn figures() -> Option<HeapFigures> {
    None
}

/// Sets the two gauges from [`figures`] (nothing where there are none).
pub fn record() {
    if let Some(heap) = figures() {
        metrics::gauge!(IN_USE_METRIC).set(heap.in_use as f64);
        metrics::gauge!(FREE_METRIC).set(heap.free as f64);
    }
}

/// Describes the two gauges to the recorder.
pub fn describe() {
    metrics::describe_gauge!(
        IN_USE_METRIC,
        metrics::Unit::Bytes,
        "bytes this process allocated and has not freed (glibc mallinfo2: arena chunks in use plus large chunks)"
    );
    metrics::describe_gauge!(
        FREE_METRIC,
        metrics::Unit::Bytes,
        "bytes free inside malloc's arenas: held by the allocator, part of RSS where their pages were touched"
    );
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn an_allocation_shows_in_use_until_it_is_freed() {
        const SIZE: usize = 64 << 20;
        let before = figures().unwrap();
        let block = vec![1u8; SIZE];
        let held = figures().unwrap();
        assert!(held.in_use >= before.in_use + SIZE as u64 / 2, "{before:?} then {held:?} holding 64 MiB");
        drop(std::hint::black_box(block));
        let after = figures().unwrap();
        assert!(after.in_use + (SIZE as u64 / 2) <= held.in_use, "{held:?} then {after:?} after freeing 64 MiB");
    }

    #[tokio::test]
    async fn the_endpoint_serves_both_gauges() {
        let addr = crate::serve_metrics("127.0.0.1:0", std::future::pending()).await.unwrap();
        record();
        let body = crate::scrape(addr).await.unwrap();
        for name in [IN_USE_METRIC, FREE_METRIC] {
            let line = body.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {body}"));
            let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(value >= 0.0, "{line}");
        }
        let in_use = body.lines().find(|l| l.starts_with(IN_USE_METRIC)).unwrap();
        assert!(!in_use.ends_with(" 0"), "a running test process has a heap: {in_use}");
    }
}
