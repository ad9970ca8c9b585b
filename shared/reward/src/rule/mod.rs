//! verl's rule-based scorers, dispatched on `data_source` as `default_compute_score` does, plus jetrl's
//! synthetic tasks.

pub mod digits;
pub mod gsm8k;
pub mod math_dapo;
pub mod math_hendrycks;
pub mod search_r1;

use jetrl_config::RuleScorerConfig;

use crate::failure::FailureKind;
use crate::result::RewardResult;

/// The scorer families of the dispatch table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleScorer {
    Gsm8k,
    MathHendrycks,
    MathDapo,
    SearchR1ExactMatch,
    JetrlDigits,
    /// `jetrl/multiply`: the digits rule on the response's last line (the final answer after tool turns)
    JetrlFinalLine,
}

impl RuleScorer {
    /// The scorer verl's `default_compute_score` picks for `data_source`, or `None` where verl raises
    /// `NotImplementedError`.
    pub fn for_data_source(data_source: &str) -> Option<Self> {
        match data_source {
            "openai/gsm8k" => Some(Self::Gsm8k),
            "lighteval/MATH" | "DigitalLearningGmbH/MATH-lighteval" | "HuggingFaceH4/MATH-500" => {
                Some(Self::MathHendrycks)
            }
            "math_dapo" | "math" | "math_dapo_reasoning" => Some(Self::MathDapo),
            source if source.starts_with("aime") => Some(Self::MathDapo),
            "searchR1_nq"
            | "searchR1_triviaqa"
            | "searchR1_popqa"
            | "searchR1_hotpotqa"
            | "searchR1_2wikimultihopqa"
            | "searchR1_musique"
            | "searchR1_bamboogle" => Some(Self::SearchR1ExactMatch),
            "jetrl/multiply" => Some(Self::JetrlFinalLine),
            source if source.starts_with("jetrl/") => Some(Self::JetrlDigits),
            _ => None,
        }
    }

    /// Stable name, used as the `scorer` metric label.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gsm8k => "gsm8k",
            Self::MathHendrycks => "math",
            Self::MathDapo => "math_dapo",
            Self::SearchR1ExactMatch => "search_r1_em",
            Self::JetrlDigits => "jetrl_digits",
            Self::JetrlFinalLine => "jetrl_final_line",
        }
    }

    /// Scores one response, normalised as verl's reward managers normalise a scorer's answer.
    pub fn score(
        self,
        solution_str: &str,
        ground_truth: &str,
        options: &RuleScorerConfig,
    ) -> Result<RewardResult, RuleError> {
        Ok(match self {
            Self::Gsm8k => RewardResult::from_number(gsm8k::compute_score(
                solution_str,
                ground_truth,
                options.gsm8k_method,
                options.format_score,
                options.correct_score,
            )),
            Self::MathHendrycks => RewardResult::from_number(math_hendrycks::compute_score(solution_str, ground_truth)),
            Self::MathDapo => math_dapo::compute_score(solution_str, ground_truth, options.strict_box_verify),
            Self::SearchR1ExactMatch => RewardResult::from_number(search_r1::compute_score(
                solution_str,
                ground_truth,
                options.format_score,
                options.correct_score,
            )?),
            Self::JetrlDigits => digits::compute_score(solution_str, ground_truth),
            Self::JetrlFinalLine => digits::compute_final_line_score(solution_str, ground_truth),
        })
    }
}

/// Why a rule scorer gave no score.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RuleError {
    #[error("no rule scorer for data_source {0:?}")]
    UnknownDataSource(String),
    #[error(transparent)]
    InvalidGroundTruth(#[from] search_r1::InvalidTargets),
}

impl RuleError {
    pub fn kind(&self) -> FailureKind {
        match self {
            Self::UnknownDataSource(_) => FailureKind::UnknownDataSource,
            Self::InvalidGroundTruth(_) => FailureKind::InvalidGroundTruth,
        }
    }
}

/// verl's `default_compute_score`: the scorer for `data_source`, normalised.
pub fn default_compute_score(
    data_source: &str,
    solution_str: &str,
    ground_truth: &str,
    options: &RuleScorerConfig,
) -> Result<RewardResult, RuleError> {
    let scorer =
        RuleScorer::for_data_source(data_source).ok_or_else(|| RuleError::UnknownDataSource(data_source.into()))?;
    scorer.score(solution_str, ground_truth, options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_sources_dispatch_like_verl() {
        assert_eq!(RuleScorer::for_data_source("openai/gsm8k"), Some(RuleScorer::Gsm8k));
        assert_eq!(RuleScorer::for_data_source("HuggingFaceH4/MATH-500"), Some(RuleScorer::MathHendrycks));
        assert_eq!(RuleScorer::for_data_source("aime2024"), Some(RuleScorer::MathDapo));
        assert_eq!(RuleScorer::for_data_source("math"), Some(RuleScorer::MathDapo));
        assert_eq!(RuleScorer::for_data_source("searchR1_musique"), Some(RuleScorer::SearchR1ExactMatch));
        assert_eq!(RuleScorer::for_data_source("jetrl/sort"), Some(RuleScorer::JetrlDigits));
        assert_eq!(RuleScorer::for_data_source("jetrl/multiply"), Some(RuleScorer::JetrlFinalLine));
        assert_eq!(RuleScorer::for_data_source("searchR1_other"), None);
        assert_eq!(RuleScorer::for_data_source("openai/gsm8k "), None);
    }

    #[test]
    fn unknown_data_source_is_a_typed_error_naming_it() {
        let err = default_compute_score("my/dataset", "x", "y", &RuleScorerConfig::default()).unwrap_err();
        assert_eq!(err, RuleError::UnknownDataSource("my/dataset".into()));
        assert!(err.to_string().contains("my/dataset"));
        assert_eq!(err.kind(), FailureKind::UnknownDataSource);
    }

    #[test]
    fn float_scorers_report_acc_equal_to_the_score() {
        let result = default_compute_score("openai/gsm8k", "#### 5", "5", &RuleScorerConfig::default()).unwrap();
        assert_eq!((result.score, result.extra["acc"]), (1.0, 1.0));
    }
}
