//! The sandboxed python tool: runs code, and stops runaway code by time, memory and output size.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::time::{Duration, Instant};

use jetrl_rollout_worker::tools::{PythonLimits, PythonTool, Tool, ToolError};
use serde_json::json;

/// The tool under test, on `JETRL_TEST_PYTHON` or python3 (a prerequisite of the project: missing is a failure).
fn python() -> PythonTool {
    let bin = std::env::var("JETRL_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let runs = std::process::Command::new(&bin).arg("-c").arg("pass").status().is_ok_and(|s| s.success());
    assert!(runs, "{bin} does not run here: the python tool cannot be tested");
    PythonTool::new(PythonLimits {
        bin,
        timeout: Duration::from_secs(3),
        memory_bytes: 256 << 20,
        max_output_bytes: 1000,
    })
}

#[tokio::test]
async fn python_runs_the_code_and_returns_what_it_prints() {
    let py = python();
    let out = py.call(json!({"code": "import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)"})).await.unwrap();
    assert_eq!(out.text, "42\nwarn\n");
    assert_eq!(out.reward, 0.0);
    let err = py.call(json!({"code": "raise ValueError('nope')"})).await.unwrap_err();
    assert!(
        matches!(&err, ToolError::Execution(text) if text.contains("exit status 1") && text.contains("ValueError: nope")),
        "{err}"
    );
    assert!(matches!(py.call(json!({"program": "x"})).await, Err(ToolError::Arguments(_))));
}

#[tokio::test]
async fn runaway_code_is_stopped_by_the_timeout_memory_and_output_limits() {
    let py = python();
    let started = Instant::now();
    let err = py
        .call(json!({"code": "import subprocess\nsubprocess.Popen(['sleep', '100'])\nwhile True: pass"}))
        .await
        .unwrap_err();
    assert_eq!(err, ToolError::Timeout(3.0));
    assert!(started.elapsed() < Duration::from_secs(6));

    let err = py.call(json!({"code": "x = bytearray(1 << 30)\nprint(len(x))"})).await.unwrap_err();
    assert!(matches!(&err, ToolError::Execution(text) if text.contains("MemoryError")), "{err}");

    let out = py.call(json!({"code": "print('y' * 100000)"})).await.unwrap();
    assert!(out.text.len() < 1100, "output capped: {} bytes", out.text.len());
    assert!(out.text.ends_with("...(output truncated at 1000 bytes)"));

    let out = py.call(json!({"code": "import os\nprint(sorted(os.environ))"})).await.unwrap();
    assert!(!out.text.contains("HOME"), "a minimal environment: {}", out.text);
}
