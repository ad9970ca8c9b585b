//! The façade the reward service calls: route a batch to the configured scorer, apply the DAPO overlong
//! penalty, turn every fault into a per-trajectory failure, record metrics.

use std::collections::{BTreeMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::time::Instant;

use jetrl_config::{RewardConfig, RewardKwargsConfig, RuleScorerConfig};
use serde::Serialize;

use crate::error::RewardError;
use crate::external::ExternalRunner;
use crate::failure::{FailureKind, ScoreFailure};
use crate::input::ScoreInput;
use crate::overlong::apply_overlong_penalty;
use crate::remote_rm::RemoteRewardModel;
use crate::result::RewardResult;
use crate::rule::RuleScorer;

pub const SCORES_METRIC: &str = "jetrl_reward_scores_total";
pub const LATENCY_METRIC: &str = "jetrl_reward_score_latency_seconds";
pub const FAILURES_METRIC: &str = "jetrl_reward_failures_total";
/// Distinct `data_source` label values before the rest are counted as `other`.
const MAX_DATA_SOURCE_LABELS: usize = 64;
const MAX_LABEL_CHARS: usize = 64;

/// The score of one trajectory, or why there is none (then `score` is 0.0).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoreOutcome {
    pub key: String,
    pub score: f64,
    pub extra: BTreeMap<String, f64>,
    pub extra_text: BTreeMap<String, String>,
    /// a human-readable reason when the trajectory could not be scored
    pub failure_reason: Option<String>,
    /// the stable kind of that failure (the `reason` metric label)
    pub failure_kind: Option<FailureKind>,
    /// which scorer handled it (`gsm8k`, `math`, …, `external`, `reward_model`, `rule` when none matched)
    pub scorer: &'static str,
    /// how long its scorer took (a rule: this trajectory; a user-function call or a reward-model request: the
    /// whole call it was part of); None when no scorer ran. [`RewardEngine::observe`] records it; not
    /// serialized (a timing, not a result).
    #[serde(skip)]
    pub seconds: Option<f64>,
}

impl ScoreOutcome {
    fn scored(key: String, scorer: &'static str, result: RewardResult) -> Self {
        Self {
            key,
            score: result.score,
            extra: result.extra,
            extra_text: result.extra_text,
            failure_reason: None,
            failure_kind: None,
            scorer,
            seconds: None,
        }
    }

    fn failed(key: String, scorer: &'static str, failure: ScoreFailure) -> Self {
        Self {
            key,
            score: 0.0,
            extra: BTreeMap::new(),
            extra_text: BTreeMap::new(),
            failure_reason: Some(failure.to_string()),
            failure_kind: Some(failure.kind),
            scorer,
            seconds: None,
        }
    }

    fn took(mut self, seconds: f64) -> Self {
        self.seconds = Some(seconds);
        self
    }
}

enum Route {
    Rules,
    UserFunction(ExternalRunner),
    /// boxed: it carries the reward model's tokenizer
    RewardModel(Box<RemoteRewardModel>),
}

/// Scores batches of trajectories; cheap to share behind an `Arc`.
pub struct RewardEngine {
    route: Route,
    rule_options: RuleScorerConfig,
    reward_kwargs: RewardKwargsConfig,
    /// the `data_source` label values handed out so far (the label set must stay bounded)
    data_source_labels: Mutex<HashSet<String>>,
}

impl RewardEngine {
    /// Validates `reward.*` and prepares the scorer verl would use: the custom function if configured, else the
    /// reward model if enabled, else the rule scorers. Starts the user function's processes.
    pub async fn new(config: &RewardConfig) -> Result<Self, RewardError> {
        config.validate()?;
        describe_metrics();
        let route = if config.custom_reward_function.is_configured() {
            Route::UserFunction(ExternalRunner::start(&config.custom_reward_function).await?)
        } else if config.reward_model.enable {
            Route::RewardModel(Box::new(RemoteRewardModel::new(&config.reward_model)?))
        } else {
            Route::Rules
        };
        Ok(Self {
            route,
            rule_options: config.rule.clone(),
            reward_kwargs: config.reward_kwargs.clone(),
            data_source_labels: Mutex::new(HashSet::new()),
        })
    }

    /// `rules`, `external` or `reward_model`.
    pub fn route_name(&self) -> &'static str {
        match self.route {
            Route::Rules => "rules",
            Route::UserFunction(_) => "external",
            Route::RewardModel(_) => "reward_model",
        }
    }

    /// Whether the reward model renders prompts with its own chat template (`reward.reward_model.tokenizer_path`),
    /// and therefore wants a trajectory's chat messages rather than its prompt text.
    pub fn reward_model_renders_chat(&self) -> bool {
        matches!(&self.route, Route::RewardModel(model) if model.renders_chat())
    }

    /// One outcome per input, in input order. Never fails and never panics: a trajectory that cannot be scored
    /// gets score 0.0 and a `failure_reason`.
    pub async fn score_batch(&self, inputs: Vec<ScoreInput>) -> Vec<ScoreOutcome> {
        let outcomes = match &self.route {
            Route::Rules => self.rules(&inputs),
            Route::UserFunction(runner) => self.score_with_user_function(runner, &inputs).await,
            Route::RewardModel(model) => self.score_with_reward_model(model, &inputs).await,
        };
        self.observe(&inputs, &outcomes);
        outcomes
    }

    /// The rules route's scoring alone: synchronous (CPU work, for a blocking thread) and recording no metrics;
    /// the caller records them with [`Self::observe`] from its async task. None on another route.
    ///
    /// Why apart: a histogram sample recorded on a thread leaves crossbeam-epoch garbage in that thread's bag
    /// (metrics-util's sample buckets are reclaimed through it) until the bag fills, about 250 KB a thread
    /// (measured). Recorded on the many threads of a blocking pool, that is megabytes held for the life of the
    /// service, reached over tens of minutes (`just bench soak`: the reward service's heap in use grew 30% in
    /// 10 minutes); recorded by the runtime's few worker threads, a fraction of it.
    pub fn score_rules(&self, inputs: &[ScoreInput]) -> Option<Vec<ScoreOutcome>> {
        matches!(self.route, Route::Rules).then(|| self.rules(inputs))
    }

    fn rules(&self, inputs: &[ScoreInput]) -> Vec<ScoreOutcome> {
        inputs.iter().map(|input| self.score_with_rules(input)).collect()
    }

    /// Records the metrics of scored `inputs` (their `outcomes`, in the same order): scores and failures by
    /// data source and reason, and each scorer's latency. [`Self::score_batch`] calls it.
    pub fn observe(&self, inputs: &[ScoreInput], outcomes: &[ScoreOutcome]) {
        for (input, outcome) in inputs.iter().zip(outcomes) {
            self.record(input, outcome);
            if let Some(seconds) = outcome.seconds {
                metrics::histogram!(LATENCY_METRIC, "scorer" => outcome.scorer).record(seconds);
            }
        }
    }

    fn score_with_rules(&self, input: &ScoreInput) -> ScoreOutcome {
        let key = input.key.clone();
        let Some(scorer) = RuleScorer::for_data_source(&input.data_source) else {
            let failure = ScoreFailure::new(
                FailureKind::UnknownDataSource,
                format!("no rule scorer for data_source {:?}", input.data_source),
            );
            return ScoreOutcome::failed(key, "rule", failure);
        };
        let started = Instant::now();
        // A bug in a scorer must cost one trajectory, not the service.
        let scored = std::panic::catch_unwind(AssertUnwindSafe(|| {
            scorer.score(&input.solution_str, &input.ground_truth, &self.rule_options)
        }));
        let seconds = started.elapsed().as_secs_f64();
        let outcome = match scored {
            Ok(Ok(mut result)) => {
                apply_overlong_penalty(&mut result, &self.reward_kwargs, input.response_len);
                ScoreOutcome::scored(key, scorer.name(), result)
            }
            Ok(Err(error)) => {
                ScoreOutcome::failed(key, scorer.name(), ScoreFailure::new(error.kind(), error.to_string()))
            }
            Err(_) => ScoreOutcome::failed(
                key,
                scorer.name(),
                ScoreFailure::new(FailureKind::Internal, "the rule scorer panicked"),
            ),
        };
        outcome.took(seconds)
    }

    async fn score_with_user_function(&self, runner: &ExternalRunner, inputs: &[ScoreInput]) -> Vec<ScoreOutcome> {
        const SCORER: &str = "external";
        let started = Instant::now();
        let results = runner.score(inputs).await;
        // Every trajectory of a call waited for the whole call.
        let elapsed = started.elapsed().as_secs_f64();
        inputs
            .iter()
            .zip(results)
            .map(|(input, result)| {
                let outcome = match result {
                    Ok(mut result) => {
                        apply_overlong_penalty(&mut result, &self.reward_kwargs, input.response_len);
                        ScoreOutcome::scored(input.key.clone(), SCORER, result)
                    }
                    Err(failure) => ScoreOutcome::failed(input.key.clone(), SCORER, failure),
                };
                outcome.took(elapsed)
            })
            .collect()
    }

    async fn score_with_reward_model(&self, model: &RemoteRewardModel, inputs: &[ScoreInput]) -> Vec<ScoreOutcome> {
        const SCORER: &str = "reward_model";
        let requests = inputs.iter().map(|input| async move {
            let started = Instant::now();
            let scored = match model.model_input(input) {
                Ok(text) => model.score(&text).await,
                Err(error) => Err(error),
            };
            let seconds = started.elapsed().as_secs_f64();
            let outcome = match scored {
                // verl's reward-model path reports the raw score, with no extra info and no overlong penalty.
                Ok(score) => {
                    ScoreOutcome::scored(input.key.clone(), SCORER, RewardResult { score, ..RewardResult::default() })
                }
                Err(error) => {
                    ScoreOutcome::failed(input.key.clone(), SCORER, ScoreFailure::new(error.kind(), error.to_string()))
                }
            };
            outcome.took(seconds)
        });
        futures::future::join_all(requests).await
    }

    fn record(&self, input: &ScoreInput, outcome: &ScoreOutcome) {
        match outcome.failure_kind {
            None => {
                let label = self.data_source_label(&input.data_source);
                metrics::counter!(SCORES_METRIC, "data_source" => label).increment(1);
            }
            Some(kind) => {
                metrics::counter!(FAILURES_METRIC, "reason" => kind.as_str()).increment(1);
                tracing::debug!(key = %outcome.key, reason = ?outcome.failure_reason, "trajectory not scored");
            }
        }
    }

    /// The data source itself while fewer than [`MAX_DATA_SOURCE_LABELS`] have been seen, else `other`.
    fn data_source_label(&self, data_source: &str) -> String {
        let label: String = data_source.chars().take(MAX_LABEL_CHARS).collect();
        let Ok(mut seen) = self.data_source_labels.lock() else { return "other".into() };
        if seen.contains(&label) {
            return label;
        }
        if seen.len() < MAX_DATA_SOURCE_LABELS {
            seen.insert(label.clone());
            return label;
        }
        "other".into()
    }
}

fn describe_metrics() {
    metrics::describe_counter!(SCORES_METRIC, "trajectories scored, by data_source");
    metrics::describe_histogram!(
        LATENCY_METRIC,
        metrics::Unit::Seconds,
        "time to score one trajectory (a batched call counts for each of its trajectories), by scorer"
    );
    metrics::describe_counter!(FAILURES_METRIC, "trajectories that could not be scored, by reason");
    metrics::describe_counter!(
        crate::external::RESTARTS_METRIC,
        "user reward function processes killed or found dead and restarted"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>(_: &T) {}
    fn assert_send<T: Send>(_: &T) {}

    #[tokio::test]
    async fn engine_is_shareable_and_its_batches_can_run_on_spawned_tasks() {
        let engine = RewardEngine::new(&RewardConfig::default()).await.unwrap();
        assert_send_sync(&engine);
        let batch = engine.score_batch(Vec::new());
        assert_send(&batch);
        assert!(batch.await.is_empty());
    }
}
