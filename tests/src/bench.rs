//! What the benchmarks (`src/bin/bench_*.rs`) measure besides time: CPU seconds of each side of a run.

/// CPU seconds (user + system) used so far by process `pid` (this process for `None`), from /proc; 0 elsewhere.
pub fn cpu_seconds(pid: Option<u32>) -> f64 {
    let path = pid.map_or_else(|| "/proc/self/stat".to_string(), |pid| format!("/proc/{pid}/stat"));
    let Ok(stat) = std::fs::read_to_string(path) else { return 0.0 };
    // fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on Linux
    let hz = 100.0;
    (ticks(11) + ticks(12)) / hz
}

/// CPU seconds used so far by this process and by process `server` (a benchmark's two sides of one run).
pub fn cpu_seconds_here_and(server: Option<u32>) -> (f64, f64) {
    (cpu_seconds(None), cpu_seconds(server))
}
