//! Where step metrics go (verl's `trainer.logger`): `metrics.jsonl` in the run directory (one JSON object per
//! step, verl's names; always written, `jetrl run` and the tests read it), `jetrl.<ns>.trainer.metrics` on NATS (for
//! `jetrl run`'s progress display), Prometheus gauges, TensorBoard event files (`tensorboard`), a log line per
//! step (`console`), verl's JSONL file (`file`), the experiment trackers (`mlflow`, `wandb`: [`crate::trackers`]),
//! and the reward-curve picture.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use jetrl_bus::Bus;
use jetrl_config::{JobConfig, Logger};

use crate::dump::Generation;
use crate::tensorboard::EventWriter;
use crate::trackers::file::FileLogger;
use crate::trackers::{self, Finish, Policy, RunEnd, TrackerHandle};

pub struct MetricsSink {
    bus: Bus,
    jsonl: std::fs::File,
    run_dir: PathBuf,
    /// (step, critic/score/mean) so far, for the curve
    curve: Vec<(u64, f64)>,
    tensorboard: Option<EventWriter>,
    console: bool,
    /// verl's `file` logger
    file: Option<FileLogger>,
    /// `mlflow`, `wandb`: each behind its own queue
    trackers: Vec<TrackerHandle>,
    /// the step of the last line in the file
    last_step: Option<u64>,
    /// the trainer's heartbeat, told each line
    heartbeat: Option<jetrl_bus::heartbeat::StepMetrics>,
}

/// The step a metrics line belongs to.
fn line_step(v: &serde_json::Value) -> Option<u64> {
    v["training/global_step"].as_f64().map(|s| s as u64)
}

impl MetricsSink {
    /// Opens `<run_dir>/metrics.jsonl`. A fresh run truncates it; a run resumed after step `resumed_from`
    /// keeps the lines up to that step and drops later ones (they belonged to the steps being redone), so the
    /// file reads as one uninterrupted run. Starts the trackers of `trainer.logger` (on the current tokio
    /// runtime); one that cannot be set up is reported and left out, training goes on.
    pub fn open(bus: &Bus, run_dir: &Path, cfg: &JobConfig, resumed_from: Option<u64>) -> std::io::Result<Self> {
        let trainer = &cfg.trainer;
        std::fs::create_dir_all(run_dir)?;
        let path = run_dir.join("metrics.jsonl");
        let mut curve = Vec::new();
        let mut kept = String::new();
        let mut last_step = None;
        if let Some(resumed) = resumed_from {
            if let Ok(text) = std::fs::read_to_string(&path) {
                for line in text.lines() {
                    let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
                    if line_step(&v).is_some_and(|s| s > resumed) {
                        continue;
                    }
                    if let (Some(s), Some(r)) = (line_step(&v), v["critic/score/mean"].as_f64()) {
                        curve.push((s, r));
                    }
                    last_step = line_step(&v).max(last_step);
                    kept.push_str(line);
                    kept.push('\n');
                }
            }
        }
        let mut jsonl = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(&path)?;
        jsonl.write_all(kept.as_bytes())?;
        let tensorboard = if trainer.logger.contains(&Logger::Tensorboard) {
            let dir = trainer.tensorboard_dir.clone().map(PathBuf::from).unwrap_or_else(|| run_dir.join("tensorboard"));
            Some(EventWriter::create(&dir, resumed_from.map(|s| s + 1))?)
        } else {
            None
        };
        let file = if trainer.logger.contains(&Logger::File) {
            let path = trackers::file::resolve_path(
                &trainer.project_name,
                &trackers::experiment_name(cfg),
                std::env::var_os("VERL_FILE_LOGGER_PATH"),
                std::env::var_os("VERL_FILE_LOGGER_ROOT"),
                std::env::var_os("HOME"),
            );
            match FileLogger::open(&path, resumed_from) {
                Ok(file) => {
                    tracing::info!(path = %path.display(), "trainer.logger file: verl's file logger writes here");
                    Some(file)
                }
                Err(err) => {
                    tracing::error!(error = %err, path = %path.display(), "trainer.logger file: cannot open the file; nothing is written to it this run");
                    None
                }
            }
        } else {
            None
        };
        let mut trackers = Vec::new();
        let resumed = resumed_from.is_some();
        if trainer.logger.contains(&Logger::Mlflow) {
            match trackers::mlflow::Mlflow::from_env(cfg, run_dir, resumed) {
                Ok(mlflow) => trackers.push(TrackerHandle::spawn("mlflow", mlflow, Policy::default())),
                Err(why) => tracing::error!("trainer.logger mlflow: {why}; nothing is sent to MLflow this run"),
            }
        }
        if trainer.logger.contains(&Logger::Wandb) {
            let wandb = trackers::wandb::Wandb::new(cfg, run_dir, resumed);
            trackers.push(TrackerHandle::spawn("wandb", wandb, Policy::default()));
        }
        Ok(Self {
            bus: bus.clone(),
            jsonl,
            run_dir: run_dir.to_path_buf(),
            curve,
            tensorboard,
            console: trainer.logger.contains(&Logger::Console),
            file,
            trackers,
            last_step,
            heartbeat: None,
        })
    }

    /// Tells `heartbeat` every line from now on.
    pub fn report_to(&mut self, heartbeat: jetrl_bus::heartbeat::StepMetrics) {
        self.heartbeat = Some(heartbeat);
    }

    /// The step of the last line kept or written.
    pub fn last_step(&self) -> Option<u64> {
        self.last_step
    }

    /// Writes a step's metrics everywhere; `generations`, the validation generations of the step (verl's
    /// `log_val_generations`), go to the trackers with them.
    pub async fn record(&mut self, step: u64, metrics: &BTreeMap<String, f64>, generations: Vec<Generation>) {
        // JSON has no NaN or infinity: such values are left out of the line
        let finite: BTreeMap<&String, f64> =
            metrics.iter().filter(|(_, v)| v.is_finite()).map(|(k, v)| (k, *v)).collect();
        let line = serde_json::to_string(&finite).unwrap_or_default();
        if let Err(err) = writeln!(self.jsonl, "{line}").and_then(|_| self.jsonl.flush()) {
            tracing::error!(error = %err, "cannot append to metrics.jsonl");
        }
        if let Some(heartbeat) = &self.heartbeat {
            heartbeat.record(line.as_bytes());
        }
        let subject = self.bus.names().trainer_metrics().to_string();
        if let Err(err) = self.bus.client().publish(subject, line.into_bytes().into()).await {
            tracing::debug!(error = %err, "metrics not published");
        }
        for (name, value) in metrics {
            metrics::gauge!("jetrl_trainer_metric", "name" => name.clone()).set(*value);
        }
        metrics::gauge!("jetrl_trainer_step").set(step as f64);
        if let Some(file) = self.file.as_mut() {
            if let Err(err) = file.write(step, metrics) {
                tracing::warn!(error = %err, path = %file.path().display(), "trainer.logger file: line not written");
            }
        }
        if !self.trackers.is_empty() {
            let finite: BTreeMap<String, f64> = finite.iter().map(|(k, v)| ((*k).clone(), *v)).collect();
            let finite = Arc::new(finite);
            let generations = (!generations.is_empty()).then(|| Arc::new(generations));
            for tracker in &mut self.trackers {
                let mut line = trackers::Step::now(step, finite.clone());
                line.generations = generations.clone();
                tracker.record(line);
            }
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            if let Err(err) = tb.scalars(step, metrics) {
                tracing::warn!(error = %err, "tensorboard event not written");
            }
        }
        if self.console {
            let get = |k: &str| metrics.get(k).copied().unwrap_or(f64::NAN);
            tracing::info!(
                step,
                score = get("critic/score/mean"),
                pg_loss = get("actor/pg_loss"),
                grad_norm = get("actor/grad_norm"),
                step_s = get("timing_s/step"),
                "step metrics"
            );
        }
        if let Some(score) = metrics.get("critic/score/mean") {
            self.curve.push((step, *score));
        }
        self.last_step = Some(step).max(self.last_step);
        if step % 10 == 0 {
            self.write_curve();
        }
    }

    /// Ends the run's records however training ended: writes the reward curve, then gives the trackers the
    /// end (`mlflow` and `wandb` keep the curve and `summary.json` with the run), waiting at most
    /// [`trackers::FINISH_WAIT`] for them.
    pub async fn finish(&mut self, end: RunEnd) {
        self.write_curve();
        if self.trackers.is_empty() {
            return;
        }
        let files = ["reward_curve.svg", "summary.json"]
            .into_iter()
            .map(|name| self.run_dir.join(name))
            .filter(|path| path.exists())
            .collect();
        trackers::finish_all(std::mem::take(&mut self.trackers), Finish { end, files }).await;
    }

    /// Writes `<run_dir>/reward_curve.svg`.
    pub fn write_curve(&self) {
        let path = self.run_dir.join("reward_curve.svg");
        if let Err(err) = std::fs::write(&path, reward_curve_svg(&self.curve)) {
            tracing::warn!(error = %err, path = %path.display(), "reward curve not written");
        }
    }

    pub fn curve(&self) -> &[(u64, f64)] {
        &self.curve
    }
}

/// A self-contained SVG line chart of mean reward per step (axes 0..1 for reward).
pub fn reward_curve_svg(points: &[(u64, f64)]) -> String {
    let (w, h, left, bottom, top, right) = (720.0, 360.0, 60.0, 40.0, 30.0, 20.0);
    let max_step = points.iter().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let lo = points.iter().map(|p| p.1).fold(0.0f64, f64::min);
    let hi = points.iter().map(|p| p.1).fold(1.0f64, f64::max);
    let x = |s: f64| left + (w - left - right) * s / max_step;
    let y = |r: f64| h - bottom - (h - bottom - top) * (r - lo) / (hi - lo).max(1e-9);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">mean reward per step (critic/score/mean)</text>\n",
        w / 2.0
    );
    for i in 0..=4 {
        let r = lo + (hi - lo) * f64::from(i) / 4.0;
        svg += &format!(
            "<line x1=\"{left}\" y1=\"{y0:.1}\" x2=\"{x1}\" y2=\"{y0:.1}\" stroke=\"#ddd\"/><text x=\"{lx}\" y=\"{ty:.1}\" text-anchor=\"end\">{r:.2}</text>\n",
            y0 = y(r),
            x1 = w - right,
            lx = left - 6.0,
            ty = y(r) + 4.0
        );
    }
    svg += &format!(
        "<line x1=\"{left}\" y1=\"{b}\" x2=\"{x1}\" y2=\"{b}\" stroke=\"black\"/><line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"{cx}\" y=\"{ly}\" text-anchor=\"middle\">step (max {max_step})</text>\n",
        b = h - bottom,
        x1 = w - right,
        cx = (left + w - right) / 2.0,
        ly = h - 8.0
    );
    if !points.is_empty() {
        let path: Vec<String> = points.iter().map(|(s, r)| format!("{:.1},{:.1}", x(*s as f64), y(*r))).collect();
        svg +=
            &format!("<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"{}\"/>\n", path.join(" "));
    }
    svg += "</svg>\n";
    svg
}

#[cfg(test)]
mod tests {
    #[test]
    fn svg_has_one_vertex_per_point() {
        let svg = super::reward_curve_svg(&[(1, 0.1), (2, 0.5), (3, 0.9)]);
        assert!(svg.starts_with("<svg"));
        let points = svg.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
        assert_eq!(points.split(' ').count(), 3);
    }
}
