//! Checks one golden case (`tests/golden/README.md`): the inputs of a verl reference computation, run through
//! this crate, must reproduce the expected outputs within `|a − e| ≤ tol + tol·|e|` (tol 1e-6 in float64,
//! 1e-4 for a case with `"dtype": "float32"` in its config, or the case's own `"tolerance"`).
//!
//! Families: advantage, policy_loss, agg_loss, kl_penalty, value_loss, entropy, logprobs, kl_controller, and
//! jetrl's own rollout_correction. `reward` belongs to `jetrl-reward`.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::{
    agg_loss, compute_advantage, compute_policy_loss, compute_rollout_correction, compute_value_loss,
    f_entropy_from_logits, f_kl_penalty, f_logprobs_from_logits, AdvantageConfig, AdvantageEstimator, AdvantageInputs,
    AggMode, GlobalBatchInfo, KlController, KlPenalty, PolicyLossInputs, PolicyLossMode, PolicyLossParams,
    RolloutCorrectionParams,
};

/// Runs `case` on the CPU and compares every expected output; the error names the case, the output and the
/// worst mismatch.
pub fn check_case(case: &Value) -> Result<(), String> {
    check_case_on(case, Device::Cpu)
}

/// [`check_case`] with every input tensor placed on `device` (to check the GPU paths).
pub fn check_case_on(case: &Value, device: Device) -> Result<(), String> {
    let family = case.get("fn").and_then(Value::as_str).ok_or("the case has no \"fn\"")?;
    let name = case.get("name").and_then(Value::as_str).ok_or("the case has no \"name\"")?;
    let empty = Value::Object(Default::default());
    let config = case.get("config").unwrap_or(&empty);
    let inputs = case.get("inputs").ok_or_else(|| format!("{family}/{name}: no \"inputs\""))?;
    let expected = case.get("expected").ok_or_else(|| format!("{family}/{name}: no \"expected\""))?;
    let kind = match config.get("dtype").and_then(Value::as_str) {
        Some("float32") => Kind::Float,
        _ => Kind::Double,
    };
    let tolerance =
        case.get("tolerance").and_then(Value::as_f64).unwrap_or(if kind == Kind::Float { 1e-4 } else { 1e-6 });
    let cx = Case { inputs, expected, config, kind, device };
    let outputs = match family {
        "advantage" => advantage(&cx, name),
        "policy_loss" => policy_loss(&cx, name),
        "agg_loss" => aggregation(&cx, name),
        "kl_penalty" => kl(&cx, name),
        "value_loss" => value_loss(&cx, name),
        "entropy" => entropy(&cx, name),
        "logprobs" => logprobs(&cx, name),
        "kl_controller" => kl_controller(&cx, name),
        "rollout_correction" => rollout_correction(&cx),
        "reward" => Err("reward cases are checked by jetrl-reward, not jetrl-algos".to_string()),
        other => Err(format!("unknown golden fn {other:?}")),
    }
    .map_err(|e| format!("{family}/{name}: {e}"))?;
    let expected_map = expected.as_object().ok_or_else(|| format!("{family}/{name}: \"expected\" is not an object"))?;
    if expected_map.is_empty() {
        return Err(format!("{family}/{name}: nothing is expected"));
    }
    for (output, want) in expected_map {
        let got = outputs
            .get(output.as_str())
            .ok_or_else(|| format!("{family}/{name}: jetrl does not produce expected output {output:?}"))?;
        compare(got, want, tolerance).map_err(|e| format!("{family}/{name}: {output}: {e}"))?;
    }
    Ok(())
}

/// An output: a tensor of any shape or a list of scalars.
enum Output {
    Tensor(Tensor),
    Scalars(Vec<f64>),
}

impl From<Tensor> for Output {
    fn from(tensor: Tensor) -> Self {
        Self::Tensor(tensor)
    }
}

impl From<f64> for Output {
    fn from(value: f64) -> Self {
        Self::Scalars(vec![value])
    }
}

type Outputs = BTreeMap<String, Output>;

struct Case<'a> {
    inputs: &'a Value,
    expected: &'a Value,
    config: &'a Value,
    kind: Kind,
    device: Device,
}

impl Case<'_> {
    fn tensor(&self, name: &str) -> Result<Tensor, String> {
        let value = self.inputs.get(name).ok_or_else(|| format!("input {name:?} is missing"))?;
        tensor_from_json(value, self.kind)
            .and_then(|t| t.f_to_device(self.device).map_err(|e| e.to_string()))
            .map_err(|e| format!("input {name:?}: {e}"))
    }

    fn optional_tensor(&self, name: &str) -> Result<Option<Tensor>, String> {
        match self.inputs.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.tensor(name).map(Some),
        }
    }

    fn strings(&self, name: &str) -> Result<Option<Vec<String>>, String> {
        match self.inputs.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(s.clone()),
                    Value::Number(n) => Ok(n.to_string()),
                    other => Err(format!("input {name:?}: {other} is not a string")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(other) => Err(format!("input {name:?} must be a list, got {other}")),
        }
    }

    fn number(&self, key: &str) -> Option<f64> {
        self.config.get(key).and_then(Value::as_f64)
    }

    fn global_batch_info(&self) -> Result<GlobalBatchInfo, String> {
        let empty = Value::Null;
        let nested = self.config.get("global_batch_info").unwrap_or(&empty);
        let read = |key: &str| nested.get(key).and_then(Value::as_f64).or_else(|| self.number(key));
        let dp_size = read("dp_size").unwrap_or(1.0);
        if dp_size.fract() != 0.0 || dp_size < 1.0 {
            return Err(format!("dp_size must be a positive integer, got {dp_size}"));
        }
        Ok(GlobalBatchInfo {
            dp_size: dp_size as i64,
            batch_num_tokens: read("batch_num_tokens"),
            global_batch_size: read("global_batch_size"),
            loss_scale_factor: read("loss_scale_factor"),
        })
    }
}

fn tensor_from_json(value: &Value, kind: Kind) -> Result<Tensor, String> {
    fn walk(value: &Value, depth: usize, shape: &mut Vec<i64>, flat: &mut Vec<f64>) -> Result<(), String> {
        match value {
            Value::Array(items) => {
                if shape.len() == depth {
                    shape.push(items.len() as i64);
                } else if shape.get(depth) != Some(&(items.len() as i64)) {
                    return Err("ragged nested list".into());
                }
                items.iter().try_for_each(|item| walk(item, depth + 1, shape, flat))
            }
            Value::Number(n) if shape.len() == depth => {
                flat.push(n.as_f64().ok_or("number out of range")?);
                Ok(())
            }
            Value::Bool(b) if shape.len() == depth => {
                flat.push(f64::from(u8::from(*b)));
                Ok(())
            }
            other => Err(format!("unexpected {other} in a numeric list")),
        }
    }
    let mut shape = Vec::new();
    let mut flat = Vec::new();
    walk(value, 0, &mut shape, &mut flat)?;
    Tensor::f_from_slice(&flat)
        .and_then(|t| t.f_reshape(&shape))
        .and_then(|t| t.f_to_kind(kind))
        .map_err(|e| e.to_string())
}

fn compare(got: &Output, want: &Value, tolerance: f64) -> Result<(), String> {
    let (actual, shape) = match got {
        Output::Tensor(t) => (crate::util::to_vec_f64(t).map_err(|e| e.to_string())?, t.size()),
        Output::Scalars(values) => (values.clone(), vec![values.len() as i64]),
    };
    let expected = tensor_from_json(want, Kind::Double)?;
    let expected_values = crate::util::to_vec_f64(&expected).map_err(|e| e.to_string())?;
    if expected_values.len() != actual.len() {
        return Err(format!(
            "expected {} values (shape {:?}), jetrl produced shape {shape:?}",
            expected_values.len(),
            expected.size()
        ));
    }
    let mut worst: Option<(usize, f64)> = None;
    for (i, (a, e)) in actual.iter().zip(&expected_values).enumerate() {
        let error = (a - e).abs();
        let ok = error <= tolerance + tolerance * e.abs() || (a.is_nan() && e.is_nan()) || a == e;
        if !ok && worst.is_none_or(|(_, w)| error > w || error.is_nan()) {
            worst = Some((i, error));
        }
    }
    match worst {
        None => Ok(()),
        Some((i, error)) => Err(format!(
            "element {i}: got {}, expected {} (|error| {error:e} > tolerance {tolerance:e})",
            actual[i], expected_values[i]
        )),
    }
}

fn advantage(cx: &Case, name: &str) -> Result<Outputs, String> {
    let estimator = AdvantageEstimator::from_str(name).map_err(|e| e.to_string())?;
    let rewards = cx.tensor("token_level_rewards")?;
    let mask = cx.tensor("response_mask")?;
    let values = cx.optional_tensor("values")?;
    let baselines = cx.optional_tensor("reward_baselines")?;
    let old = cx.optional_tensor("old_log_probs")?;
    let spsq = cx.optional_tensor("sum_pi_squared")?;
    let weights = cx.optional_tensor("rollout_is_weights")?;
    let index = cx.strings("index")?;
    let keys = cx.strings("keys")?;
    let defaults = AdvantageConfig::default();
    let gdpo_reward_keys: Vec<String> = match cx.config.get("gdpo_reward_keys") {
        Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).map(String::from).collect(),
        _ => Vec::new(),
    };
    let gdpo_reward_weights = match cx.config.get("gdpo_reward_weights") {
        Some(Value::Array(items)) => Some(items.iter().filter_map(Value::as_f64).collect()),
        _ => None,
    };
    let mut extra = BTreeMap::new();
    let nested = cx.inputs.get("extra_scores");
    for key in &gdpo_reward_keys {
        let source = nested.and_then(|n| n.get(key)).or_else(|| cx.inputs.get(key));
        let value = source.ok_or_else(|| format!("gdpo reward component {key:?} is missing from the inputs"))?;
        extra.insert(key.clone(), tensor_from_json(value, cx.kind)?.to_device(cx.device));
    }
    let cfg = AdvantageConfig {
        gamma: cx.number("gamma").unwrap_or(defaults.gamma),
        lam: cx.number("lam").unwrap_or(defaults.lam),
        norm_adv_by_std_in_grpo: cx
            .config
            .get("norm_adv_by_std_in_grpo")
            .and_then(Value::as_bool)
            .unwrap_or(defaults.norm_adv_by_std_in_grpo),
        epsilon: cx.number("epsilon").unwrap_or(defaults.epsilon),
        gdpo_reward_keys,
        gdpo_reward_weights,
        handle_zero_tail: cx
            .config
            .get("handle_zero_tail")
            .and_then(Value::as_bool)
            .unwrap_or(defaults.handle_zero_tail),
    };
    let inputs = AdvantageInputs {
        index: index.as_deref(),
        values: values.as_ref(),
        reward_baselines: baselines.as_ref(),
        keys: keys.as_deref(),
        extra_scores: if extra.is_empty() { None } else { Some(&extra) },
        old_log_probs: old.as_ref(),
        sum_pi_squared: spsq.as_ref(),
        rollout_is_weights: weights.as_ref(),
        ..AdvantageInputs::new(&rewards, &mask)
    };
    let (advantages, returns) = compute_advantage(estimator, &inputs, &cfg).map_err(|e| e.to_string())?;
    Ok(BTreeMap::from([("advantages".into(), advantages.into()), ("returns".into(), returns.into())]))
}

fn policy_params(cx: &Case) -> Result<PolicyLossParams, String> {
    let defaults = PolicyLossParams::default();
    let empty = Value::Null;
    let loss = cx.config.get("policy_loss").unwrap_or(&empty);
    let loss_number = |key: &str| loss.get(key).and_then(Value::as_f64);
    let rollout_correction = match loss.get("rollout_correction").or_else(|| cx.config.get("rollout_correction")) {
        None | Some(Value::Null) => None,
        Some(value) => Some(rollout_correction_params(value)?),
    };
    Ok(PolicyLossParams {
        clip_ratio: cx.number("clip_ratio").unwrap_or(defaults.clip_ratio),
        clip_ratio_low: cx.number("clip_ratio_low"),
        clip_ratio_high: cx.number("clip_ratio_high"),
        clip_ratio_c: cx.number("clip_ratio_c").unwrap_or(defaults.clip_ratio_c),
        loss_agg_mode: match cx.config.get("loss_agg_mode").and_then(Value::as_str) {
            Some(mode) => mode.parse().map_err(|e: jetrl_config::UnknownValue| e.to_string())?,
            None => defaults.loss_agg_mode,
        },
        loss_scale_factor: cx.number("loss_scale_factor"),
        tau_pos: cx.number("tau_pos").unwrap_or(defaults.tau_pos),
        tau_neg: cx.number("tau_neg").unwrap_or(defaults.tau_neg),
        clip_cov_ratio: loss_number("clip_cov_ratio").unwrap_or(defaults.clip_cov_ratio),
        clip_cov_lb: loss_number("clip_cov_lb").unwrap_or(defaults.clip_cov_lb),
        clip_cov_ub: loss_number("clip_cov_ub").unwrap_or(defaults.clip_cov_ub),
        kl_cov_ratio: loss_number("kl_cov_ratio").unwrap_or(defaults.kl_cov_ratio),
        ppo_kl_coef: loss_number("ppo_kl_coef").unwrap_or(defaults.ppo_kl_coef),
        dro_beta: loss_number("dro_beta"),
        rollout_correction,
        seed: cx.config.get("seed").and_then(Value::as_u64).unwrap_or(defaults.seed),
    })
}

fn rollout_correction_params(value: &Value) -> Result<RolloutCorrectionParams, String> {
    let cfg: jetrl_config::RolloutCorrectionConfig =
        serde_json::from_value(value.clone()).map_err(|e| format!("rollout_correction config: {e}"))?;
    RolloutCorrectionParams::from_config(&cfg).map_err(|e| e.to_string())
}

fn policy_loss(cx: &Case, name: &str) -> Result<Outputs, String> {
    let mode = PolicyLossMode::from_str(name).map_err(|e| e.to_string())?;
    let params = policy_params(cx)?;
    let info = cx.global_batch_info()?;
    let old = cx.tensor("old_log_prob")?;
    let log_prob = cx.tensor("log_prob")?.set_requires_grad(true);
    let advantages = cx.tensor("advantages")?;
    let mask = cx.tensor("response_mask")?;
    let weights = cx.optional_tensor("rollout_is_weights")?;
    let inputs = PolicyLossInputs {
        old_log_prob: &old,
        log_prob: &log_prob,
        advantages: &advantages,
        response_mask: &mask,
        rollout_is_weights: weights.as_ref(),
    };
    let (loss, metrics) = compute_policy_loss(mode, &inputs, &params, &info).map_err(|e| e.to_string())?;
    let mut outputs: Outputs = BTreeMap::new();
    if cx.expected.get("grad_log_prob").is_some() {
        outputs.insert("grad_log_prob".into(), gradient(&loss, &log_prob)?.into());
    }
    outputs.insert("pg_loss".into(), loss.detach().into());
    for (key, value) in [
        ("pg_clipfrac", metrics.pg_clipfrac),
        ("ppo_kl", metrics.ppo_kl),
        ("pg_clipfrac_lower", metrics.pg_clipfrac_lower),
    ] {
        if let Some(value) = value {
            outputs.insert(key.into(), value.into());
        }
    }
    Ok(outputs)
}

fn gradient(output: &Tensor, input: &Tensor) -> Result<Tensor, String> {
    let grads = Tensor::f_run_backward(&[output], &[input], false, false).map_err(|e| format!("backward: {e}"))?;
    grads.into_iter().next().ok_or_else(|| "backward returned no gradient".to_string())
}

fn aggregation(cx: &Case, name: &str) -> Result<Outputs, String> {
    let mode = AggMode::from_str(name).map_err(|e| e.to_string())?;
    let loss_mat = cx.tensor("loss_mat")?.set_requires_grad(true);
    let mask = cx.tensor("loss_mask")?;
    let loss = agg_loss(&loss_mat, &mask, mode, &cx.global_batch_info()?).map_err(|e| e.to_string())?;
    let mut outputs: Outputs = BTreeMap::new();
    if cx.expected.get("grad_loss_mat").is_some() {
        outputs.insert("grad_loss_mat".into(), gradient(&loss, &loss_mat)?.into());
    }
    outputs.insert("loss".into(), loss.detach().into());
    Ok(outputs)
}

fn kl(cx: &Case, name: &str) -> Result<Outputs, String> {
    let kind = KlPenalty::from_str(name).map_err(|e| e.to_string())?;
    let logprob = cx.tensor("logprob")?.set_requires_grad(true);
    let ref_logprob = cx.tensor("ref_logprob")?;
    let estimate = f_kl_penalty(&logprob, &ref_logprob, kind).map_err(|e| e.to_string())?;
    let mut outputs: Outputs = BTreeMap::new();
    if let Some(mask) = cx.optional_tensor("response_mask")? {
        let total = (&estimate * mask).sum(None::<Kind>);
        outputs.insert("grad_logprob_of_masked_sum".into(), gradient(&total, &logprob)?.into());
    }
    outputs.insert("kl".into(), estimate.detach().into());
    Ok(outputs)
}

fn value_loss(cx: &Case, name: &str) -> Result<Outputs, String> {
    if name != "clipped" {
        return Err(format!("unknown value_loss variant {name:?} (expected \"clipped\")"));
    }
    let mode = match cx.config.get("loss_agg_mode").and_then(Value::as_str) {
        Some(mode) => mode.parse().map_err(|e: jetrl_config::UnknownValue| e.to_string())?,
        None => AggMode::TokenMean,
    };
    let cliprange = cx.number("cliprange_value").ok_or("config cliprange_value is missing")?;
    let vpreds = cx.tensor("vpreds")?.set_requires_grad(true);
    let (loss, metrics) = compute_value_loss(
        &vpreds,
        &cx.tensor("returns")?,
        &cx.tensor("values")?,
        &cx.tensor("response_mask")?,
        cliprange,
        mode,
        &cx.global_batch_info()?,
    )
    .map_err(|e| e.to_string())?;
    let mut outputs: Outputs = BTreeMap::new();
    if cx.expected.get("grad_vpreds").is_some() {
        outputs.insert("grad_vpreds".into(), gradient(&loss, &vpreds)?.into());
    }
    outputs.insert("vf_loss".into(), loss.detach().into());
    outputs.insert("vf_clipfrac".into(), metrics.vf_clipfrac.into());
    outputs.insert("vpred_mean".into(), metrics.vpred_mean.into());
    Ok(outputs)
}

fn entropy(cx: &Case, name: &str) -> Result<Outputs, String> {
    if name != "from_logits" {
        return Err(format!("unknown entropy variant {name:?} (expected \"from_logits\")"));
    }
    let logits = cx.tensor("logits")?;
    let entropy = f_entropy_from_logits(&logits).map_err(|e| e.to_string())?;
    Ok(BTreeMap::from([("entropy".into(), entropy.into())]))
}

fn logprobs(cx: &Case, name: &str) -> Result<Outputs, String> {
    if name != "from_logits" {
        return Err(format!("unknown logprobs variant {name:?} (expected \"from_logits\")"));
    }
    let logits = cx.tensor("logits")?;
    let ids = cx.tensor("ids")?.to_kind(Kind::Int64);
    let logprobs = f_logprobs_from_logits(&logits, &ids).map_err(|e| e.to_string())?;
    Ok(BTreeMap::from([("logprobs".into(), logprobs.into())]))
}

fn kl_controller(cx: &Case, name: &str) -> Result<Outputs, String> {
    let coef = cx.number("kl_coef").ok_or("config kl_coef is missing")?;
    let mut controller = match name {
        "fixed" => KlController::Fixed { value: coef },
        "adaptive" => KlController::adaptive(
            coef,
            cx.number("target_kl").ok_or("config target_kl is missing")?,
            cx.number("horizon").ok_or("config horizon is missing")?,
        )
        .map_err(|e| e.to_string())?,
        other => return Err(format!("unknown kl_controller {other:?} (expected fixed or adaptive)")),
    };
    let updates = cx.inputs.get("updates").and_then(Value::as_array).ok_or("input \"updates\" must be a list")?;
    let mut values = Vec::with_capacity(updates.len());
    for update in updates {
        let pair = update.as_array().filter(|p| p.len() == 2).ok_or("every update must be [current_kl, n_steps]")?;
        let current_kl = pair[0].as_f64().ok_or("current_kl must be a number")?;
        let n_steps = pair[1].as_f64().filter(|n| *n >= 0.0 && n.fract() == 0.0).ok_or("n_steps must be a count")?;
        controller.update(current_kl, n_steps as u64);
        values.push(controller.value());
    }
    Ok(BTreeMap::from([("values".into(), Output::Scalars(values))]))
}

fn rollout_correction(cx: &Case) -> Result<Outputs, String> {
    let params = rollout_correction_params(cx.config.get("rollout_correction").unwrap_or(cx.config))?;
    let corrected = compute_rollout_correction(
        &cx.tensor("old_log_prob")?,
        &cx.tensor("rollout_log_prob")?,
        &cx.tensor("response_mask")?,
        &params,
    )
    .map_err(|e| e.to_string())?;
    let mut outputs: Outputs = BTreeMap::new();
    if let Some(weights) = corrected.weights {
        outputs.insert("rollout_is_weights".into(), weights.into());
    }
    outputs.insert("response_mask".into(), corrected.response_mask.into());
    for (key, value) in corrected.metrics {
        outputs.insert(key, value.into());
    }
    Ok(outputs)
}
