//! verl's configuration as it is: `jetrl run --verl [FILE.yaml] key=value …` reads verl's key tree
//! (`actor_rollout_ref.*`, `data.*`, `algorithm.*`, `critic.*`, `reward_model.*`, `custom_reward_function.*`,
//! `trainer.*`) with Hydra's override syntax, over verl's own defaults (`defaults.yaml`), and translates it into
//! jetrl's tree. Every key has a fate ([`keys::KEYS`]): mapped, refused with the reason, ignored (listed at
//! start-up), or read by a rule; jetrl's own sections (`nats`, `run`, `buffer`, `checkpoint`, `log`, `reward`) stay
//! settable in the same file.

pub mod hydra;
pub mod keys;
pub mod layout;

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{json, Value};

use crate::{ConfigError, JobConfig};
use hydra::{get, leaves, set_path, Override};
use keys::{spelling, Fate};

const DEFAULTS: &str = include_str!("defaults.yaml");

/// A verl job in jetrl's tree.
#[derive(Debug, Clone)]
pub struct VerlJob {
    /// jetrl's tree, untyped ([`VerlJob::typed`] types and checks it)
    pub value: Value,
    /// keys the user set that only tune another engine or the cluster, with why they are ignored
    pub ignored: Vec<(String, String)>,
    /// jetrl key → the verl key it came from, so errors name the key the user wrote
    origin: Vec<(String, String)>,
}

impl VerlJob {
    /// The typed, checked job; an error names the verl key the user wrote.
    pub fn typed(&self) -> Result<JobConfig, ConfigError> {
        let cfg: JobConfig = crate::from_value(self.value.clone()).map_err(|e| self.rename(e))?;
        cfg.validate().map_err(|e| self.rename(e))?;
        Ok(cfg)
    }

    /// One line for the start-up log: what was ignored and why.
    pub fn ignored_line(&self) -> Option<String> {
        if self.ignored.is_empty() {
            return None;
        }
        let items: Vec<String> = self.ignored.iter().map(|(key, why)| format!("{key} ({why})")).collect();
        Some(format!("verl keys ignored, they tune another engine or the cluster: {}", items.join("; ")))
    }

    /// The verl key a jetrl key came from (itself when it came from jetrl's own sections).
    pub fn verl_key<'a>(&'a self, jetrl: &'a str) -> &'a str {
        self.origin.iter().find(|(j, _)| j == jetrl).map_or(jetrl, |(_, v)| v.as_str())
    }

    fn rename(&self, err: ConfigError) -> ConfigError {
        match err {
            ConfigError::Invalid { path, message } => {
                ConfigError::Invalid { path: self.verl_key(&path).to_string(), message: self.rename_text(&message) }
            }
            other => other,
        }
    }

    /// `message` with each jetrl key in it written as the verl key it came from.
    fn rename_text(&self, message: &str) -> String {
        let mut out = String::new();
        let mut token = String::new();
        let flush = |token: &mut String, out: &mut String| {
            out.push_str(self.verl_key(token));
            token.clear();
        };
        for c in message.chars() {
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' {
                token.push(c);
            } else {
                flush(&mut token, &mut out);
                out.push(c);
            }
        }
        flush(&mut token, &mut out);
        out
    }
}

/// verl's defaults for the keys jetrl reads.
pub fn defaults() -> Value {
    serde_yaml::from_str(DEFAULTS).expect("verl/defaults.yaml is valid YAML")
}

/// Reads a verl job: verl's defaults, then `file` (verl's tree), then Hydra `overrides`, translated into jetrl's tree.
pub fn load_verl(file: Option<&Path>, overrides: &[String]) -> Result<VerlJob, ConfigError> {
    let mut tree = defaults();
    let mut user = json!({});
    let mut ignored: Vec<(String, String)> = Vec::new();
    if let Some(path) = file {
        let unreadable = |message: String| ConfigError::Read { path: path.display().to_string(), message };
        let text = std::fs::read_to_string(path).map_err(|e| unreadable(e.to_string()))?;
        crate::load::check_nesting(&text).map_err(unreadable)?;
        let mut doc: Value = serde_yaml::from_str::<Option<Value>>(&text)
            .map_err(|e| unreadable(e.to_string()))?
            .unwrap_or_else(|| json!({}));
        let map = doc.as_object_mut().ok_or_else(|| unreadable("the top level is not a mapping of keys".into()))?;
        for composition in ["defaults", "hydra"] {
            if map.remove(composition).is_some() {
                ignored.push((
                    composition.into(),
                    "Hydra's composition: jetrl starts from verl's ppo_trainer defaults".into(),
                ));
            }
        }
        hydra::merge(&mut tree, doc.clone());
        hydra::merge(&mut user, doc);
    }
    for item in overrides {
        let parsed = hydra::parse_override(item)?;
        hydra::apply(&mut tree, &parsed);
        match &parsed {
            Override::Set { .. } => hydra::apply(&mut user, &parsed),
            Override::Delete { path } => hydra::apply(&mut user, &Override::Delete { path: path.clone() }),
        }
    }
    hydra::resolve_interpolations(&mut tree)?;
    let user_set: BTreeSet<String> = leaves(&user).into_iter().map(|(path, _)| path).collect();
    translate(&tree, &user_set, ignored)
}

/// Whether the user set `path` or a key inside it.
fn set_by_user(user_set: &BTreeSet<String>, path: &str) -> bool {
    user_set.iter().any(|p| p == path || p.strip_prefix(path).is_some_and(|rest| rest.starts_with('.')))
}

fn invalid(path: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { path: path.to_string(), message: message.into() }
}

struct Builder {
    value: Value,
    origin: Vec<(String, String)>,
}

impl Builder {
    fn set(&mut self, jetrl: &str, verl: &str, value: Value) {
        let parts: Vec<String> = jetrl.split('.').map(str::to_string).collect();
        set_path(&mut self.value, &parts, value);
        self.origin.retain(|(j, _)| j != jetrl);
        if jetrl != verl {
            self.origin.push((jetrl.to_string(), verl.to_string()));
        }
    }
}

fn translate(
    tree: &Value,
    user_set: &BTreeSet<String>,
    mut ignored: Vec<(String, String)>,
) -> Result<VerlJob, ConfigError> {
    let mut out = Builder { value: json!({}), origin: Vec::new() };
    for (path, value) in leaves(tree) {
        if path.split('.').any(|part| part == "_target_") || path.is_empty() {
            continue;
        }
        let key = keys::lookup(&path);
        // a leaf inside a key whose value is a mapping: the part of the path below that key
        let below = key.and_then(|key| path.strip_prefix(key.verl)).unwrap_or("");
        match key.map(|key| key.fate) {
            Some(Fate::Map(to)) => {
                if !value.is_null() {
                    out.set(&format!("{to}{below}"), &path, value);
                }
            }
            Some(Fate::MapSet(to)) => {
                if set_by_user(user_set, &path) && !value.is_null() {
                    out.set(&format!("{to}{below}"), &path, value);
                }
            }
            Some(Fate::Convert(to, conv)) => {
                let converted = conv.apply(&value).map_err(|message| invalid(&path, message))?;
                if !converted.is_null() {
                    out.set(&format!("{to}{below}"), &path, converted);
                }
            }
            Some(Fate::Only(allowed, why)) => {
                let (key, value) = match key {
                    Some(key) if !below.is_empty() => (key.verl, get(tree, key.verl).unwrap_or(&value)),
                    _ => (path.as_str(), &value),
                };
                let written = spelling(value);
                if !allowed.contains(&written.as_str()) {
                    return Err(invalid(key, format!("{written} is refused: {why}")));
                }
            }
            Some(Fate::Ignore(why)) => {
                if set_by_user(user_set, &path) {
                    ignored.push((path.clone(), why.to_string()));
                }
            }
            Some(Fate::Rule(_)) => {}
            Some(Fate::Jetrl) => out.set(&path, &path, value),
            None => match keys::SECTIONS.iter().find(|(verl, _)| path.starts_with(verl)) {
                Some((verl, jetrl)) => {
                    let to = format!("{jetrl}{}", &path[verl.len()..]);
                    out.set(&to, &path, value);
                }
                None => {
                    return Err(invalid(
                        &path,
                        "is neither a verl key jetrl reads nor in one of jetrl's own sections (nats, run, buffer, \
                         checkpoint, log, reward); a job in jetrl's own tree runs without --verl",
                    ))
                }
            },
        }
    }
    rules(tree, user_set, &mut out)?;
    Ok(VerlJob { value: out.value, ignored, origin: out.origin })
}

fn num(tree: &Value, path: &str) -> Option<u64> {
    get(tree, path).and_then(Value::as_u64)
}

fn flag(tree: &Value, path: &str) -> bool {
    get(tree, path).and_then(Value::as_bool).unwrap_or(false)
}

/// The rules over several keys.
fn rules(tree: &Value, user_set: &BTreeSet<String>, out: &mut Builder) -> Result<(), ConfigError> {
    // sampling
    if get(tree, "actor_rollout_ref.rollout.do_sample") == Some(&Value::Bool(false)) {
        out.set("rollout.temperature", "actor_rollout_ref.rollout.do_sample", json!(0.0));
    }
    if get(tree, "actor_rollout_ref.rollout.val_kwargs.do_sample") == Some(&Value::Bool(false)) {
        out.set("rollout.val_kwargs.temperature", "actor_rollout_ref.rollout.val_kwargs.do_sample", json!(0.0));
    }
    if flag(tree, "actor_rollout_ref.rollout.multi_turn.enable")
        && !set_by_user(user_set, "actor_rollout_ref.rollout.agent.default_agent_loop")
    {
        out.set("rollout.agent.default_agent_loop", "actor_rollout_ref.rollout.multi_turn.enable", json!("tool_agent"));
    }
    // the critic's model and tokenizer are the actor's
    for key in ["critic.model.path", "critic.model.tokenizer_path"] {
        if !set_by_user(user_set, key) {
            continue;
        }
        let critic = get(tree, key).map(spelling).map(|p| keys::expand_home(&p));
        let actor = get(tree, "actor_rollout_ref.model.path").map(spelling).map(|p| keys::expand_home(&p));
        if critic.is_some() && critic.as_deref() != Some("null") && critic != actor {
            return Err(invalid(
                key,
                format!(
                    "{} is refused: jetrl's critic starts from the actor's model and tokenizer \
                     (actor_rollout_ref.model.path {})",
                    critic.unwrap_or_default(),
                    actor.unwrap_or_default()
                ),
            ));
        }
    }
    reward_kwargs(tree, out)?;
    if let Some(correction) = get(tree, "algorithm.rollout_correction").filter(|v| !v.is_null()) {
        out.set("algorithm.rollout_correction", "algorithm.rollout_correction", correction.clone());
    }
    // device, and the dtype that goes with it unless the job names one
    let device = get(tree, "trainer.device").map(spelling);
    let dtype = match device.as_deref() {
        Some("cpu") => "f32",
        Some(d) if d.starts_with("cuda") => "bf16",
        other => {
            return Err(invalid(
                "trainer.device",
                format!("{} is refused: jetrl trains on cuda or cpu", other.unwrap_or("null")),
            ))
        }
    };
    out.set("model.device", "trainer.device", json!(device));
    if !set_by_user(user_set, "actor_rollout_ref.model.dtype") {
        out.set("model.dtype", "trainer.device", json!(dtype));
    }
    // names and where the run writes
    let project = get(tree, "trainer.project_name").map(spelling).unwrap_or_else(|| "verl".into());
    let experiment = get(tree, "trainer.experiment_name").map(spelling).unwrap_or_else(|| "run".into());
    out.set("trainer.experiment_name", "trainer.experiment_name", json!(experiment));
    if !set_by_user(user_set, "run.name") {
        out.set("run.name", "trainer.experiment_name", json!(experiment));
    }
    if !set_by_user(user_set, "run.dir") {
        out.set("run.dir", "trainer.experiment_name", json!(format!("runs/{project}/{experiment}")));
    }
    mode_rule(tree, user_set, out)?;
    micro_batches(tree, out)
}

/// The DAPO overlong penalty as jetrl's `reward.reward_kwargs`: verl's `main_ppo` hands
/// `reward_model.reward_kwargs` (`+reward_model.reward_kwargs.overlong_buffer_cfg.*`, `max_resp_len`) to the reward
/// manager, which only `dapo` accepts; `recipe.dapo.main_dapo` reads `reward_model.overlong_buffer.*` with
/// `data.max_response_length` as `max_resp_len`.
fn reward_kwargs(tree: &Value, out: &mut Builder) -> Result<(), ConfigError> {
    let set = |path: &str| get(tree, path).filter(|v| !v.is_null() && *v != &json!({})).cloned();
    let kwargs = set("reward_model.reward_kwargs");
    let recipe = set("reward_model.overlong_buffer");
    if kwargs.is_none() && recipe.is_none() {
        return Ok(());
    }
    for (path, subtree) in [("reward_model.reward_kwargs", &kwargs), ("reward_model.overlong_buffer", &recipe)] {
        if subtree.as_ref().is_some_and(|v| !v.is_object()) {
            return Err(invalid(path, "must be a mapping of keys"));
        }
    }
    let manager = get(tree, "reward_model.reward_manager").map(spelling).unwrap_or_else(|| "naive".into());
    let given = if kwargs.is_some() { "reward_model.reward_kwargs" } else { "reward_model.overlong_buffer" };
    if manager != "dapo" {
        return Err(invalid(
            given,
            format!(
                "is read by verl's dapo reward manager, and reward_model.reward_manager is {manager}: set \
                 reward_model.reward_manager=dapo"
            ),
        ));
    }
    for (rest, value) in kwargs.as_ref().map(leaves).unwrap_or_default() {
        out.set(&format!("reward.reward_kwargs.{rest}"), &format!("reward_model.reward_kwargs.{rest}"), value);
    }
    if let Some(buffer) = &recipe {
        for (rest, value) in leaves(buffer) {
            out.set(
                &format!("reward.reward_kwargs.overlong_buffer_cfg.{rest}"),
                &format!("reward_model.overlong_buffer.{rest}"),
                value,
            );
        }
        if get(tree, "reward_model.reward_kwargs.max_resp_len").is_none() {
            let max = get(tree, "data.max_response_length").cloned().unwrap_or(Value::Null);
            out.set("reward.reward_kwargs.max_resp_len", "data.max_response_length", max);
        }
    } else if get(tree, "reward_model.reward_kwargs.max_resp_len").is_none() {
        // an error about the missing key names it as verl's
        out.origin.push(("reward.reward_kwargs.max_resp_len".into(), "reward_model.reward_kwargs.max_resp_len".into()));
    }
    Ok(())
}

/// `trainer.v1.trainer_mode` and the keys of each mode: a mode's keys set in a job of another mode are refused.
fn mode_rule(tree: &Value, user_set: &BTreeSet<String>, out: &mut Builder) -> Result<(), ConfigError> {
    let mode = get(tree, "trainer.v1.trainer_mode").map(spelling).unwrap_or_else(|| "sync".into());
    for section in ["colocate_async", "separate_async"] {
        let prefix = format!("trainer.v1.{section}.");
        let subtree = get(tree, &format!("trainer.v1.{section}")).cloned().unwrap_or(Value::Null);
        for (rest, value) in leaves(&subtree) {
            if rest.is_empty() {
                continue;
            }
            let verl = format!("{prefix}{rest}");
            if section != mode && user_set.contains(&verl) {
                let hint = match mode.as_str() {
                    "sync" => "a sync job has no such key".to_string(),
                    other => {
                        let twin = format!("trainer.v1.{other}.{rest}");
                        if get(tree, &twin).is_some() {
                            format!("this is a {other} job: set {twin}")
                        } else {
                            format!("this is a {other} job, which has no such key")
                        }
                    }
                };
                return Err(invalid(
                    &verl,
                    format!("is a {section} key, refused in trainer.v1.trainer_mode={mode}: {hint}"),
                ));
            }
            out.set(&format!("trainer.{section}.{rest}"), &verl, value);
        }
    }
    Ok(())
}

/// verl's batch checks and its micro-batches as jetrl's token budget per micro-batch: `use_dynamic_bsz` takes
/// `ppo_max_token_len_per_gpu` as it is; otherwise `ppo_micro_batch_size_per_gpu` responses of at most
/// `max_prompt_length + max_response_length` tokens.
fn micro_batches(tree: &Value, out: &mut Builder) -> Result<(), ConfigError> {
    let world = num(tree, "trainer.n_gpus_per_node").unwrap_or(1) * num(tree, "trainer.nnodes").unwrap_or(1);
    let n = num(tree, "actor_rollout_ref.rollout.n").unwrap_or(1);
    let batch = num(tree, "data.train_batch_size").unwrap_or(0);
    let sequence =
        num(tree, "data.max_prompt_length").unwrap_or(0) + num(tree, "data.max_response_length").unwrap_or(0);
    const WORLD: &str = "trainer.n_gpus_per_node × trainer.nnodes";
    if world == 0 || n == 0 || batch == 0 {
        return Ok(()); // the typed checks name these keys
    }
    if !(batch * n).is_multiple_of(world) {
        return Err(invalid(
            "data.train_batch_size",
            format!(
                "data.train_batch_size ({batch}) × actor_rollout_ref.rollout.n ({n}) = {} responses do not divide evenly \
                 over {WORLD} = {world} ranks",
                batch * n
            ),
        ));
    }
    let use_critic = match get(tree, "critic.enable") {
        Some(Value::Bool(b)) => *b,
        _ => get(tree, "algorithm.adv_estimator").map(spelling).as_deref() == Some("gae"),
    };
    let roles: &[(&str, &str)] = if use_critic {
        &[("actor_rollout_ref.actor", "actor"), ("critic", "critic")]
    } else {
        &[("actor_rollout_ref.actor", "actor")]
    };
    for &(role, jetrl) in roles {
        let key = |name: &str| format!("{role}.{name}");
        let actor = |name: &str| format!("actor_rollout_ref.actor.{name}");
        let inherited = |name: &str| get(tree, &key(name)).filter(|v| !v.is_null()).or_else(|| get(tree, &actor(name)));
        let mini_key = if get(tree, &key("ppo_mini_batch_size")).is_some_and(|v| !v.is_null()) {
            key("ppo_mini_batch_size")
        } else {
            actor("ppo_mini_batch_size")
        };
        let mini = inherited("ppo_mini_batch_size").and_then(Value::as_u64).unwrap_or(batch);
        if mini == 0 {
            return Err(invalid(&mini_key, "must be > 0"));
        }
        if batch < mini {
            return Err(invalid(&mini_key, format!("data.train_batch_size ({batch}) must be >= {mini_key} ({mini})")));
        }
        if !(mini * n).is_multiple_of(world) {
            return Err(invalid(
                &mini_key,
                format!(
                    "{mini_key} ({mini}) × actor_rollout_ref.rollout.n ({n}) = {} responses per mini-batch do not divide \
                     evenly over {WORLD} = {world} ranks",
                    mini * n
                ),
            ));
        }
        let mini_per_rank = mini * n / world;
        let dynamic = inherited("use_dynamic_bsz").and_then(Value::as_bool).unwrap_or(false);
        let budget = if dynamic {
            let max_key = key("ppo_max_token_len_per_gpu");
            let max = num(tree, &max_key).ok_or_else(|| invalid(&max_key, "must be a positive integer"))?;
            if max == 0 {
                return Err(invalid(&max_key, "must be > 0"));
            }
            max
        } else {
            let global = num(tree, &key("ppo_micro_batch_size"));
            let per_rank = num(tree, &key("ppo_micro_batch_size_per_gpu"));
            let (micro_key, micro) = match (global, per_rank) {
                (Some(_), Some(_)) => {
                    return Err(invalid(
                        &key("ppo_micro_batch_size"),
                        format!(
                            "both {} and {} are set: set only {} (ppo_micro_batch_size is the older, global spelling)",
                            key("ppo_micro_batch_size"),
                            key("ppo_micro_batch_size_per_gpu"),
                            key("ppo_micro_batch_size_per_gpu")
                        ),
                    ))
                }
                (None, None) => {
                    return Err(invalid(
                        &key("ppo_micro_batch_size_per_gpu"),
                        format!(
                            "set {} (or {}=True with {}), as verl requires",
                            key("ppo_micro_batch_size_per_gpu"),
                            key("use_dynamic_bsz"),
                            key("ppo_max_token_len_per_gpu")
                        ),
                    ))
                }
                (Some(global), None) => (key("ppo_micro_batch_size"), global / world),
                (None, Some(per_rank)) => (key("ppo_micro_batch_size_per_gpu"), per_rank),
            };
            if micro == 0 {
                return Err(invalid(&micro_key, format!("is less than one response per rank over {WORLD} = {world}")));
            }
            if !mini_per_rank.is_multiple_of(micro) {
                return Err(invalid(
                    &micro_key,
                    format!(
                        "{mini_key} ({mini}) × actor_rollout_ref.rollout.n ({n}) / {WORLD} ({world}) = {mini_per_rank} \
                         responses per rank and mini-batch is not a multiple of {micro_key}'s {micro} per rank"
                    ),
                ));
            }
            micro * sequence.max(1)
        };
        out.set(&format!("{jetrl}.ppo_max_token_len"), &key("ppo_max_token_len_per_gpu"), json!(budget));
    }
    Ok(())
}

/// The table of every verl key's fate, for docs/configuration.md.
pub fn table_markdown() -> String {
    keys::table_markdown()
}

#[cfg(test)]
mod tests;
