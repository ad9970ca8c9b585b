//! MLflow (`trainer.logger` `mlflow`) through its REST API, no Python: the tracking server at
//! `MLFLOW_TRACKING_URI` (`http://` only), with `MLFLOW_TRACKING_TOKEN` (bearer) or
//! `MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD` (basic) when set.
//!
//! - experiment: `trainer.project_name` (found by name, else created); run name: `trainer.experiment_name`, else
//!   `run.name`. The run's ids are kept in `<run.dir>/mlflow_run.json`: a resumed trainer continues the same
//!   MLflow run (the steps it redoes are logged again: MLflow keeps both values of such a step).
//! - params: the resolved job config, secrets redacted, flattened to dotted keys (`actor.optim.lr`), 100 per
//!   request; a value longer than MLflow's 6000 characters is truncated (the trainer says which).
//! - metrics: every step's `metrics.jsonl` keys and values under verl's names (verl's key clean-up: `@` becomes
//!   `_at_`, characters MLflow refuses become `_`), batched with `log-batch` (1000 a request).
//! - a step that validated: its `log_val_generations` generations as the artifact `val_step<step>.json`, a list
//!   of `{input, output, score}`, as verl's `log_generations_to_mlflow` writes it.
//! - at the end: the reward curve and `summary.json` uploaded through the server's proxied artifact API
//!   (`mlflow server` serves it by default), and the run set `FINISHED`, `FAILED` or `KILLED`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use jetrl_config::JobConfig;
use jetrl_telemetry::http::{self, HttpEndpoint, HttpResponse, Request};
use serde_json::{json, Value};

use super::{Failure, Finish, RunEnd, Step, Tracker};

const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// MLflow's limits on one `log-batch` request and on a param's value
const MAX_METRICS_PER_REQUEST: usize = 1000;
const MAX_PARAMS_PER_REQUEST: usize = 100;
const MAX_PARAM_VALUE_CHARS: usize = 6000;
/// where a run directory keeps the MLflow run it reports to
pub(crate) const STATE_FILE: &str = "mlflow_run.json";

/// The MLflow run this job reports to.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct RunIds {
    tracking_uri: String,
    experiment_id: String,
    run_id: String,
    #[serde(default)]
    artifact_uri: String,
}

pub(crate) struct Mlflow {
    /// `MLFLOW_TRACKING_URI` without a trailing `/`
    uri: String,
    endpoint: HttpEndpoint,
    /// the `Authorization` header's value
    auth: Option<String>,
    experiment_name: String,
    run_name: String,
    run_dir: PathBuf,
    /// continue the run named in the run directory, if any
    resume: bool,
    params: Vec<(String, String)>,
    params_logged: bool,
    run: Option<RunIds>,
}

/// A refused or failed call: the HTTP status (none when no response came) and MLflow's error.
#[derive(Debug)]
struct ApiError {
    status: Option<u16>,
    code: String,
    message: String,
}

impl ApiError {
    fn is(&self, code: &str) -> bool {
        self.code == code
    }

    /// A failure that may pass (no response, 5xx, 408, 429) is retried; another refusal is not.
    fn failure(self, what: &str) -> Failure {
        let why = match self.status {
            Some(status) => format!("{what}: HTTP {status} {}: {}", self.code, self.message),
            None => format!("{what}: {}", self.message),
        };
        match self.status {
            None | Some(408 | 429 | 500..=599) => Failure::Retry(why),
            Some(_) => Failure::Permanent(why),
        }
    }
}

impl Mlflow {
    /// The tracker for `cfg` from the environment; an error says what is missing or wrong.
    pub fn from_env(cfg: &JobConfig, run_dir: &Path, resume: bool) -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let uri = var("MLFLOW_TRACKING_URI").ok_or(
            "MLFLOW_TRACKING_URI is not set: set it to the http:// or https:// address of an MLflow tracking \
             server (`mlflow server`)",
        )?;
        let uri = uri.trim_end_matches('/').to_string();
        let endpoint = HttpEndpoint::parse(&uri).map_err(|_| {
            format!(
                "MLFLOW_TRACKING_URI {uri:?} is not an http[s]://host[:port][/path] URL: jetrl talks to an \
                 MLflow tracking server over its REST API (a file or database store needs `mlflow server` in front \
                 of it)"
            )
        })?;
        let auth = match (var("MLFLOW_TRACKING_TOKEN"), var("MLFLOW_TRACKING_USERNAME")) {
            (Some(token), _) => Some(format!("Bearer {token}")),
            (None, Some(user)) => {
                let password = var("MLFLOW_TRACKING_PASSWORD").unwrap_or_default();
                Some(format!("Basic {}", base64(format!("{user}:{password}").as_bytes())))
            }
            (None, None) => None,
        };
        let (params, truncated) = params(&super::redacted_config(cfg));
        if !truncated.is_empty() {
            tracing::warn!(
                tracker = "mlflow",
                params = truncated.join(", "),
                "params longer than MLflow's {MAX_PARAM_VALUE_CHARS} characters are logged truncated"
            );
        }
        Ok(Self {
            uri,
            endpoint,
            auth,
            experiment_name: cfg.trainer.project_name.clone(),
            run_name: super::experiment_name(cfg),
            run_dir: run_dir.to_path_buf(),
            resume,
            params,
            params_logged: false,
            run: None,
        })
    }

    /// One REST call; the parsed JSON answer of a 2xx.
    async fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, ApiError> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let content_type = (method != "GET").then_some("application/json");
        self.request(method, path, content_type, body.as_bytes()).await
    }

    async fn request(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<Value, ApiError> {
        let auth: Vec<(&str, &str)> = self.auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        let request = Request { method, path, headers: &auth, content_type, body };
        let response = http::send(&self.endpoint, &request, REQUEST_TIMEOUT).await.map_err(|err| ApiError {
            status: None,
            code: String::new(),
            message: err.to_string(),
        })?;
        answer(response)
    }

    /// The experiment named `trainer.project_name`, created if there is none.
    async fn experiment_id(&self) -> Result<String, Failure> {
        let get = format!("/api/2.0/mlflow/experiments/get-by-name?experiment_name={}", encode(&self.experiment_name));
        let found = match self.call("GET", &get, None).await {
            Ok(v) => Some(v),
            Err(err) if err.is("RESOURCE_DOES_NOT_EXIST") || err.status == Some(404) => None,
            Err(err) => return Err(err.failure("reading the MLflow experiment")),
        };
        let found = match found {
            Some(v) => v,
            None => {
                let create = json!({ "name": self.experiment_name });
                match self.call("POST", "/api/2.0/mlflow/experiments/create", Some(&create)).await {
                    Ok(v) => return str_at(&v, "/experiment_id", "experiments/create"),
                    // created meanwhile by another run
                    Err(err) if err.is("RESOURCE_ALREADY_EXISTS") => {
                        self.call("GET", &get, None).await.map_err(|e| e.failure("reading the MLflow experiment"))?
                    }
                    Err(err) => return Err(err.failure("creating the MLflow experiment")),
                }
            }
        };
        if found["experiment"]["lifecycle_stage"] == "deleted" {
            return Err(Failure::Permanent(format!(
                "the MLflow experiment {:?} is deleted: restore it, or set trainer.project_name to another name",
                self.experiment_name
            )));
        }
        str_at(&found, "/experiment/experiment_id", "experiments/get-by-name")
    }

    /// The run named in the run directory, if this trainer resumes and it is still there.
    async fn saved_run(&self) -> Result<Option<RunIds>, Failure> {
        if !self.resume {
            return Ok(None);
        }
        let Some(saved) = std::fs::read_to_string(self.run_dir.join(STATE_FILE))
            .ok()
            .and_then(|t| serde_json::from_str::<RunIds>(&t).ok())
            .filter(|r| r.tracking_uri == self.uri)
        else {
            return Ok(None);
        };
        let get = format!("/api/2.0/mlflow/runs/get?run_id={}", encode(&saved.run_id));
        let run = match self.call("GET", &get, None).await {
            Ok(run) => run,
            Err(err) if err.status == Some(404) || err.is("RESOURCE_DOES_NOT_EXIST") => {
                tracing::warn!(
                    tracker = "mlflow",
                    run_id = saved.run_id,
                    "the MLflow run of this run directory is gone; a new one is created"
                );
                return Ok(None);
            }
            Err(err) => return Err(err.failure("reading the MLflow run")),
        };
        if run["run"]["info"]["lifecycle_stage"] == "deleted" {
            tracing::warn!(
                tracker = "mlflow",
                run_id = saved.run_id,
                "the MLflow run of this run directory is deleted; a new one is created"
            );
            return Ok(None);
        }
        let update = json!({ "run_id": saved.run_id, "status": "RUNNING" });
        self.call("POST", "/api/2.0/mlflow/runs/update", Some(&update))
            .await
            .map_err(|e| e.failure("setting the MLflow run RUNNING"))?;
        let artifact_uri = run["run"]["info"]["artifact_uri"].as_str().unwrap_or_default().to_string();
        tracing::info!(
            tracker = "mlflow",
            run_id = saved.run_id,
            url = self.run_url(&saved),
            "continuing the MLflow run"
        );
        Ok(Some(RunIds { artifact_uri, ..saved }))
    }

    async fn create_run(&self) -> Result<RunIds, Failure> {
        let experiment_id = self.experiment_id().await?;
        let mut tags = vec![
            json!({ "key": "mlflow.source.name", "value": "jetrl" }),
            json!({ "key": "jetrl.run_dir", "value": self.run_dir.display().to_string() }),
        ];
        if let Ok(user) = std::env::var("USER") {
            tags.push(json!({ "key": "mlflow.user", "value": user }));
        }
        let create = json!({
            "experiment_id": experiment_id,
            "run_name": self.run_name,
            "start_time": now_ms(),
            "tags": tags,
        });
        let run = self
            .call("POST", "/api/2.0/mlflow/runs/create", Some(&create))
            .await
            .map_err(|e| e.failure("creating the MLflow run"))?;
        let ids = RunIds {
            tracking_uri: self.uri.clone(),
            experiment_id,
            run_id: str_at(&run, "/run/info/run_id", "runs/create")?,
            artifact_uri: run["run"]["info"]["artifact_uri"].as_str().unwrap_or_default().to_string(),
        };
        let state = self.run_dir.join(STATE_FILE);
        if let Err(err) = std::fs::write(&state, serde_json::to_string_pretty(&ids).unwrap_or_default()) {
            tracing::warn!(tracker = "mlflow", error = %err, path = %state.display(), "MLflow run id not kept: a resumed trainer will start a new MLflow run");
        }
        tracing::info!(tracker = "mlflow", run_id = ids.run_id, url = self.run_url(&ids), "MLflow run created");
        Ok(ids)
    }

    fn run_url(&self, run: &RunIds) -> String {
        format!("{}/#/experiments/{}/runs/{}", self.uri, run.experiment_id, run.run_id)
    }

    fn run_id(&self) -> Result<&str, Failure> {
        self.run.as_ref().map(|r| r.run_id.as_str()).ok_or_else(|| Failure::Retry("no MLflow run yet".into()))
    }

    /// The params, 100 a request. A refusal (a resumed run whose config changed a value: MLflow keeps a
    /// param's first value) is said once and not retried.
    async fn log_params(&self) -> Result<(), Failure> {
        let run_id = self.run_id()?;
        for chunk in self.params.chunks(MAX_PARAMS_PER_REQUEST) {
            let params: Vec<Value> = chunk.iter().map(|(k, v)| json!({ "key": k, "value": v })).collect();
            let batch = json!({ "run_id": run_id, "params": params });
            match self.call("POST", "/api/2.0/mlflow/runs/log-batch", Some(&batch)).await {
                Ok(_) => {}
                Err(err) if err.status.is_some_and(|s| (400..500).contains(&s) && s != 408 && s != 429) => {
                    tracing::warn!(
                        tracker = "mlflow",
                        "the config was not logged as MLflow params (HTTP {}: {}: {}); metrics are",
                        err.status.unwrap_or_default(),
                        err.code,
                        err.message
                    );
                    return Ok(());
                }
                Err(err) => return Err(err.failure("logging the MLflow params")),
            }
        }
        Ok(())
    }

    /// Uploads `path` as an artifact of the run (at its root) through the server's artifact proxy.
    async fn upload(&self, path: &Path) -> Result<(), Failure> {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { return Ok(()) };
        let Ok(bytes) = std::fs::read(path) else { return Ok(()) };
        let content_type = match path.extension().and_then(|e| e.to_str()) {
            Some("svg") => "image/svg+xml",
            Some("json") => "application/json",
            _ => "application/octet-stream",
        };
        self.put_artifact(name, content_type, &bytes).await
    }

    /// Puts `bytes` as the artifact `name` of the run (at its root) through the server's artifact proxy.
    async fn put_artifact(&self, name: &str, content_type: &str, bytes: &[u8]) -> Result<(), Failure> {
        let run = self.run.as_ref().ok_or_else(|| Failure::Retry("no MLflow run yet".into()))?;
        let Some(root) = proxied_artifact_path(&run.artifact_uri) else {
            return Err(Failure::Permanent(format!(
                "the run's artifacts live at {:?}, which jetrl reaches only through the tracking server's \
                 artifact proxy (`mlflow server` without --no-serve-artifacts)",
                run.artifact_uri
            )));
        };
        let segments: Vec<String> = root.split('/').chain([name]).map(encode).collect();
        let target = format!("/api/2.0/mlflow-artifacts/artifacts/{}", segments.join("/"));
        self.request("PUT", &target, Some(content_type), bytes)
            .await
            .map(|_| ())
            .map_err(|e| e.failure(&format!("uploading {name}")))
    }

    /// A step's validation generations as verl's `log_generations_to_mlflow` keeps them: the artifact
    /// `val_step<step>.json`, a list of `{input, output, score}`. Put before the step's metrics, so that a retry
    /// of the batch puts the same file again rather than logging its metrics twice; a refusal that will not pass
    /// is a warning, and the metrics still go.
    async fn put_generations(&self, step: &Step) -> Result<(), Failure> {
        let Some(generations) = &step.generations else { return Ok(()) };
        let name = format!("val_step{}.json", step.step);
        let bytes = serde_json::to_vec(generations.as_slice()).unwrap_or_default();
        match self.put_artifact(&name, "application/json", &bytes).await {
            Err(Failure::Permanent(why)) => {
                tracing::warn!(tracker = "mlflow", step = step.step, "validation generations not uploaded: {why}");
                Ok(())
            }
            other => other,
        }
    }
}

impl Tracker for Mlflow {
    async fn start(&mut self) -> Result<(), Failure> {
        if self.run.is_none() {
            // a refusal while setting the run up (credentials, a deleted experiment) will not pass
            let disabled = |failure| match failure {
                Failure::Permanent(why) => Failure::Disabled(format!("no MLflow run: {why}")),
                other => other,
            };
            let run = match self.saved_run().await.map_err(disabled)? {
                Some(run) => run,
                None => self.create_run().await.map_err(disabled)?,
            };
            self.run = Some(run);
        }
        if !self.params_logged {
            self.log_params().await?;
            self.params_logged = true;
        }
        Ok(())
    }

    async fn send(&mut self, pending: &mut VecDeque<Step>) -> Result<(), Failure> {
        while !pending.is_empty() {
            // whole steps while they fit one request (a step larger than that goes alone, in several)
            let mut metrics = Vec::new();
            let mut steps = 0;
            for step in pending.iter() {
                if steps > 0 && metrics.len() + step.metrics.len() > MAX_METRICS_PER_REQUEST {
                    break;
                }
                metrics.extend(step.metrics.iter().map(|(key, value)| {
                    json!({ "key": metric_key(key), "value": value, "timestamp": step.timestamp_ms, "step": step.step })
                }));
                steps += 1;
            }
            for step in pending.iter().take(steps) {
                self.put_generations(step).await?;
            }
            let run_id = self.run_id()?;
            for chunk in metrics.chunks(MAX_METRICS_PER_REQUEST) {
                let batch = json!({ "run_id": run_id, "metrics": chunk });
                self.call("POST", "/api/2.0/mlflow/runs/log-batch", Some(&batch))
                    .await
                    .map_err(|e| e.failure("logging MLflow metrics"))?;
            }
            pending.drain(..steps);
        }
        Ok(())
    }

    async fn finish(&mut self, finish: &Finish) -> Result<(), Failure> {
        for path in &finish.files {
            match self.upload(path).await {
                Ok(()) => {}
                Err(Failure::Permanent(why)) => {
                    tracing::warn!(tracker = "mlflow", file = %path.display(), "artifact not uploaded: {why}");
                }
                Err(other) => return Err(other),
            }
        }
        let status = match finish.end {
            RunEnd::Finished => "FINISHED",
            RunEnd::Failed => "FAILED",
            RunEnd::Stopped => "KILLED",
        };
        let update = json!({ "run_id": self.run_id()?, "status": status, "end_time": now_ms() });
        self.call("POST", "/api/2.0/mlflow/runs/update", Some(&update))
            .await
            .map_err(|e| e.failure("ending the MLflow run"))?;
        tracing::info!(tracker = "mlflow", status, "MLflow run ended");
        Ok(())
    }
}

/// A 2xx's JSON body (`{}` when empty), else MLflow's `error_code` and `message`.
fn answer(response: HttpResponse) -> Result<Value, ApiError> {
    let body: Option<Value> = serde_json::from_slice(&response.body).ok();
    if (200..300).contains(&response.status) {
        return Ok(body.unwrap_or_else(|| json!({})));
    }
    let text = String::from_utf8_lossy(&response.body);
    let field = |name: &str| body.as_ref().and_then(|b| b[name].as_str()).map(str::to_string);
    Err(ApiError {
        status: Some(response.status),
        code: field("error_code").unwrap_or_default(),
        message: field("message").unwrap_or_else(|| text.chars().take(300).collect()),
    })
}

fn str_at(value: &Value, pointer: &str, what: &str) -> Result<String, Failure> {
    value
        .pointer(pointer)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| Failure::Permanent(format!("MLflow's {what} answer has no {pointer}: {value}")))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// verl's clean-up of a metric key: `@` becomes `_at_`, characters MLflow refuses (all but alphanumerics, `_`,
/// `-`, `.`, ` `, `:` and `/`) become `_`, runs of `/` one `/`.
pub(crate) fn metric_key(key: &str) -> String {
    let replaced = key.replace('@', "_at_");
    let mut out = String::with_capacity(replaced.len());
    for c in replaced.chars() {
        let c = if c.is_alphanumeric() || "_-. :/".contains(c) { c } else { '_' };
        if !(c == '/' && out.ends_with('/')) {
            out.push(c);
        }
    }
    out
}

/// The config's leaves as (dotted key, value text) params, and the keys whose values were cut to MLflow's
/// limit.
fn params(config: &Value) -> (Vec<(String, String)>, Vec<String>) {
    fn walk(prefix: &str, value: &Value, out: &mut Vec<(String, String)>) {
        match value {
            Value::Object(map) if !map.is_empty() => {
                for (key, child) in map {
                    let key = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                    walk(&key, child, out);
                }
            }
            Value::String(text) => out.push((prefix.to_string(), text.clone())),
            other => out.push((prefix.to_string(), other.to_string())),
        }
    }
    let mut flat = Vec::new();
    walk("", config, &mut flat);
    let mut truncated = Vec::new();
    for (key, value) in &mut flat {
        *key = metric_key(key);
        if value.chars().count() > MAX_PARAM_VALUE_CHARS {
            *value = value.chars().take(MAX_PARAM_VALUE_CHARS).collect();
            truncated.push(key.clone());
        }
    }
    (flat, truncated)
}

/// The path under the artifact proxy of an `mlflow-artifacts:` artifact URI (`mlflow-artifacts:/1/<run>/artifacts`
/// or `mlflow-artifacts://host:port/1/<run>/artifacts`); `None` for another store.
fn proxied_artifact_path(artifact_uri: &str) -> Option<String> {
    let rest = artifact_uri.strip_prefix("mlflow-artifacts:")?;
    let path = match rest.strip_prefix("//") {
        Some(with_authority) => &with_authority[with_authority.find('/')?..],
        None => rest,
    };
    Some(path.trim_matches('/').to_string())
}

/// Percent-encodes all but RFC 3986's unreserved characters.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Standard base64 with padding (HTTP basic authentication).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(chunk.get(1).copied().unwrap_or(0)) << 8)
            | u32::from(chunk.get(2).copied().unwrap_or(0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn metric_keys_are_cleaned_as_verl_cleans_them() {
        assert_eq!(metric_key("critic/score/mean"), "critic/score/mean");
        assert_eq!(metric_key("val-core/reverse/acc/mean@4"), "val-core/reverse/acc/mean_at_4");
        assert_eq!(metric_key("a//b(c)"), "a/b_c_");
    }

    #[test]
    fn params_are_dotted_leaves_and_long_values_are_cut() {
        let config = json!({ "actor": { "optim": { "lr": 0.001 }, "name": "x" }, "logger": ["console", "mlflow"],
                             "none": null, "long": "y".repeat(7000), "empty": {} });
        let (params, truncated) = params(&config);
        let get = |k: &str| params.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()).unwrap();
        assert_eq!(get("actor.optim.lr"), "0.001");
        assert_eq!(get("actor.name"), "x");
        assert_eq!(get("logger"), r#"["console","mlflow"]"#);
        assert_eq!(get("none"), "null");
        assert_eq!(get("empty"), "{}");
        assert_eq!(get("long").len(), MAX_PARAM_VALUE_CHARS);
        assert_eq!(truncated, ["long"]);
    }

    #[test]
    fn artifact_uris_of_the_proxy_give_their_path() {
        assert_eq!(proxied_artifact_path("mlflow-artifacts:/1/abc/artifacts").unwrap(), "1/abc/artifacts");
        assert_eq!(proxied_artifact_path("mlflow-artifacts://h:5000/1/abc/artifacts").unwrap(), "1/abc/artifacts");
        assert_eq!(proxied_artifact_path("s3://bucket/1/abc/artifacts"), None);
    }

    #[test]
    fn encodings() {
        assert_eq!(encode("jetrl demo/1"), "jetrl%20demo%2F1");
        assert_eq!(base64(b"user:pass"), "dXNlcjpwYXNz");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(base64(b"a"), "YQ==");
    }

    #[test]
    fn failures_that_may_pass_are_told_from_refusals() {
        let err = |status| ApiError { status, code: "X".into(), message: "m".into() };
        assert!(matches!(err(None).failure("w"), Failure::Retry(_)));
        assert!(matches!(err(Some(503)).failure("w"), Failure::Retry(_)));
        assert!(matches!(err(Some(429)).failure("w"), Failure::Retry(_)));
        assert!(matches!(err(Some(400)).failure("w"), Failure::Permanent(_)));
        assert!(matches!(err(Some(404)).failure("w"), Failure::Permanent(_)));
        let response =
            HttpResponse { status: 400, body: br#"{"error_code":"INVALID_PARAMETER_VALUE","message":"bad"}"#.to_vec() };
        let refused = answer(response).unwrap_err();
        assert_eq!((refused.code.as_str(), refused.message.as_str()), ("INVALID_PARAMETER_VALUE", "bad"));
    }
}
