//! verl's `file` logger (`verl/utils/tracking.py`, `FileLogger`): one JSON object per step,
//! `{"step": <step>, "data": {<metric>: <value>, ...}}` (a value that is not finite is `null`, as orjson writes
//! it), at `VERL_FILE_LOGGER_PATH`, else `<VERL_FILE_LOGGER_ROOT, default .>/<project_name>/<experiment_name>.jsonl`
//! (`~` in the root is the home directory; relative paths are from the trainer's working directory).
//!
//! A fresh run truncates the file, as verl does; a resumed run keeps the lines up to the step it resumed from
//! (the same rule as `metrics.jsonl`).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Where verl's file logger writes: `path` (`VERL_FILE_LOGGER_PATH`) as it is, else
/// `<root (VERL_FILE_LOGGER_ROOT, default ".", "~" expanded)>/<project>/<experiment>.jsonl`.
pub(crate) fn resolve_path(
    project: &str,
    experiment: &str,
    path: Option<OsString>,
    root: Option<OsString>,
    home: Option<OsString>,
) -> PathBuf {
    if let Some(path) = path {
        return PathBuf::from(path);
    }
    let root = root.unwrap_or_else(|| ".".into());
    let root = match (root.to_str(), home) {
        (Some("~"), Some(home)) => PathBuf::from(home),
        (Some(r), Some(home)) if r.starts_with("~/") => PathBuf::from(home).join(&r[2..]),
        _ => PathBuf::from(root),
    };
    root.join(project).join(format!("{experiment}.jsonl"))
}

pub(crate) struct FileLogger {
    file: std::fs::File,
    path: PathBuf,
}

impl FileLogger {
    /// Opens the file at `path` (creating its directory): truncated for a fresh run, kept up to step
    /// `resumed_from` for a resumed one.
    pub fn open(path: &Path, resumed_from: Option<u64>) -> std::io::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let mut kept = String::new();
        if let Some(resumed) = resumed_from {
            for line in std::fs::read_to_string(path).unwrap_or_default().lines() {
                let step = serde_json::from_str::<serde_json::Value>(line).ok().and_then(|v| v["step"].as_u64());
                if step.is_some_and(|s| s <= resumed) {
                    kept.push_str(line);
                    kept.push('\n');
                }
            }
        }
        let mut file = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(path)?;
        file.write_all(kept.as_bytes())?;
        Ok(Self { file, path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends the step's line.
    pub fn write(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        // verl's key order: step, then data (serde_json writes a non-finite value as null, as orjson does)
        let data = serde_json::to_string(metrics).map_err(std::io::Error::other)?;
        writeln!(self.file, "{{\"step\":{step},\"data\":{data}}}")?;
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_path_resolves_as_verl_resolves_it() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(resolve_path("p", "e", os("/x/m.jsonl"), os("/r"), os("/h")), PathBuf::from("/x/m.jsonl"));
        assert_eq!(resolve_path("p", "e", None, os("/r"), os("/h")), PathBuf::from("/r/p/e.jsonl"));
        assert_eq!(resolve_path("p", "e", None, os("~/logs"), os("/h")), PathBuf::from("/h/logs/p/e.jsonl"));
        assert_eq!(resolve_path("p", "e", None, None, os("/h")), PathBuf::from("./p/e.jsonl"));
    }

    #[test]
    fn lines_are_verls_and_a_resume_keeps_the_steps_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p").join("e.jsonl");
        let mut logger = FileLogger::open(&path, None).unwrap();
        for step in 1..=3 {
            let metrics = BTreeMap::from([("critic/score/mean".to_string(), 0.5), ("x".to_string(), f64::NAN)]);
            logger.write(step, &metrics).unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().next().unwrap(), r#"{"step":1,"data":{"critic/score/mean":0.5,"x":null}}"#);
        let mut logger = FileLogger::open(&path, Some(2)).unwrap();
        logger.write(3, &BTreeMap::new()).unwrap();
        let steps: Vec<u64> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, [1, 2, 3]);
        FileLogger::open(&path, None).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "", "a fresh run starts the file again");
    }
}
