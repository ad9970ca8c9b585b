//! The rule route of `RewardEngine`: dispatch, order, failures, the overlong penalty, and its metrics.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use jetrl_config::RewardConfig;
use jetrl_reward::{FailureKind, RewardEngine, RewardError, ScoreInput};
use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

fn input(key: &str, data_source: &str, solution: &str, truth: &str) -> ScoreInput {
    ScoreInput {
        key: key.into(),
        data_source: data_source.into(),
        solution_str: solution.into(),
        ground_truth: truth.into(),
        response_len: 10,
        ..ScoreInput::default()
    }
}

/// Counts every counter increment and histogram sample by metric name and labels.
#[derive(Default, Clone)]
struct CapturingRecorder {
    values: Arc<Mutex<HashMap<String, f64>>>,
}

struct Cell {
    name: String,
    values: Arc<Mutex<HashMap<String, f64>>>,
}

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        *self.values.lock().unwrap().entry(self.name.clone()).or_default() += value as f64;
    }
    fn absolute(&self, value: u64) {
        self.values.lock().unwrap().insert(self.name.clone(), value as f64);
    }
}

impl HistogramFn for Cell {
    fn record(&self, _value: f64) {
        *self.values.lock().unwrap().entry(self.name.clone()).or_default() += 1.0;
    }
}

impl CapturingRecorder {
    fn cell(&self, key: &Key) -> Arc<Cell> {
        let mut labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        labels.sort();
        Arc::new(Cell { name: format!("{}{{{}}}", key.name(), labels.join(",")), values: Arc::clone(&self.values) })
    }

    fn get(&self, name: &str) -> f64 {
        self.values.lock().unwrap().get(name).copied().unwrap_or_default()
    }
}

impl Recorder for CapturingRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.cell(key))
    }
}

#[tokio::test]
async fn batch_is_scored_in_order_with_failures_for_unknown_sources_and_metrics_recorded() {
    let recorder = CapturingRecorder::default();
    // The only test in this binary that installs a recorder.
    metrics::set_global_recorder(recorder.clone()).unwrap();

    let engine = RewardEngine::new(&RewardConfig::default()).await.unwrap();
    assert_eq!(engine.route_name(), "rules");
    let outcomes = engine
        .score_batch(vec![
            input("a", "openai/gsm8k", "#### 1,234", "1234"),
            input("b", "lighteval/MATH", "\\boxed{\\frac12}", "0.5"),
            input("c", "math_dapo", "Answer: 40 dollars", "40"),
            input("d", "my/unknown", "x", "x"),
            input("e", "searchR1_nq", "<answer>x</answer>", "{not json"),
            input("f", "jetrl/reverse", "4301", "4321"),
        ])
        .await;
    let summary: Vec<(&str, f64, &str)> = outcomes.iter().map(|o| (o.key.as_str(), o.score, o.scorer)).collect();
    assert_eq!(
        summary,
        [
            ("a", 1.0, "gsm8k"),
            ("b", 1.0, "math"),
            ("c", 1.0, "math_dapo"),
            ("d", 0.0, "rule"),
            ("e", 0.0, "search_r1_em"),
            ("f", 0.75, "jetrl_digits")
        ]
    );
    assert_eq!(outcomes[2].extra_text["pred"], "40");
    assert_eq!(outcomes[3].failure_kind, Some(FailureKind::UnknownDataSource));
    assert!(outcomes[3].failure_reason.as_deref().unwrap_or_default().contains("my/unknown"));
    assert_eq!(outcomes[4].failure_kind, Some(FailureKind::InvalidGroundTruth));
    assert_eq!(outcomes[5].extra["acc"], 0.0);

    assert_eq!(recorder.get("jetrl_reward_scores_total{data_source=openai/gsm8k}"), 1.0);
    assert_eq!(recorder.get("jetrl_reward_failures_total{reason=unknown_data_source}"), 1.0);
    assert_eq!(recorder.get("jetrl_reward_failures_total{reason=invalid_ground_truth}"), 1.0);
    // Other tests of this binary score math_dapo concurrently through the same global recorder.
    assert!(recorder.get("jetrl_reward_score_latency_seconds{scorer=math_dapo}") >= 1.0);

    // The rules alone (what the reward service runs on a blocking thread) record nothing; observe, called where
    // the caller chooses, records the scores and each rule's latency (only this test scores lighteval/MATH).
    let math = [input("m1", "lighteval/MATH", "\\boxed{2}", "2"), input("m2", "lighteval/MATH", "\\boxed{3}", "2")];
    let latency_before = recorder.get("jetrl_reward_score_latency_seconds{scorer=math}");
    let scored = std::thread::spawn({
        let engine = std::sync::Arc::new(engine);
        let math = math.clone();
        move || (engine.score_rules(&math), engine)
    });
    let (outcomes, engine) = scored.join().unwrap();
    let outcomes = outcomes.expect("the rules route");
    assert_eq!(outcomes.iter().map(|o| o.score).collect::<Vec<_>>(), [1.0, 0.0]);
    assert!(outcomes.iter().all(|o| o.seconds.is_some_and(|s| s >= 0.0)), "each rule's time is kept: {outcomes:?}");
    assert_eq!(
        recorder.get("jetrl_reward_scores_total{data_source=lighteval/MATH}"),
        1.0,
        "score_rules records nothing"
    );
    assert_eq!(recorder.get("jetrl_reward_score_latency_seconds{scorer=math}"), latency_before);
    engine.observe(&math, &outcomes);
    assert_eq!(recorder.get("jetrl_reward_scores_total{data_source=lighteval/MATH}"), 3.0);
    assert_eq!(recorder.get("jetrl_reward_score_latency_seconds{scorer=math}"), latency_before + 2.0);
    let engine = std::sync::Arc::into_inner(engine).expect("the only handle");

    // Past the label budget, new data sources share the `other` label.
    let many = (0..80).map(|i| input(&format!("g{i}"), &format!("jetrl/task{i}"), "1", "1")).collect();
    engine.score_batch(many).await;
    assert!(recorder.get("jetrl_reward_scores_total{data_source=other}") >= 16.0);
}

#[tokio::test]
async fn overlong_penalty_is_added_to_rule_scores_and_logged() {
    let mut config = RewardConfig::default();
    config.reward_kwargs.max_resp_len = Some(100);
    config.reward_kwargs.overlong_buffer_cfg.enable = true;
    config.reward_kwargs.overlong_buffer_cfg.len = 20;
    config.reward_kwargs.overlong_buffer_cfg.log = true;
    let engine = RewardEngine::new(&config).await.unwrap();
    let mut long = input("a", "math_dapo", "Answer: 3", "3");
    long.response_len = 90;
    let mut short = input("b", "math_dapo", "Answer: 3", "3");
    short.response_len = 80;
    let outcomes = engine.score_batch(vec![long, short]).await;
    assert_eq!(
        (outcomes[0].score, outcomes[0].extra["overlong_reward"], outcomes[0].extra["overlong"]),
        (0.5, -0.5, 1.0)
    );
    assert_eq!((outcomes[1].score, outcomes[1].extra["overlong"]), (1.0, 0.0));
}

#[tokio::test]
async fn invalid_reward_config_is_rejected_naming_the_key() {
    let mut config = RewardConfig::default();
    config.reward_kwargs.overlong_buffer_cfg.enable = true;
    let Err(RewardError::Config(error)) = RewardEngine::new(&config).await else {
        panic!("an enabled penalty without max_resp_len was accepted")
    };
    assert!(error.to_string().contains("reward.reward_kwargs.max_resp_len"));
}
