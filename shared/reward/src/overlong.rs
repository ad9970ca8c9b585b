//! DAPO's soft overlong punishment (verl reward manager `dapo`).

use jetrl_config::RewardKwargsConfig;

use crate::result::{bool_to_f64, RewardResult};

/// The penalty for a response of `valid_response_len` tokens: 0 up to `max_resp_len − len`, then falling
/// linearly to `−penalty_factor` at `max_resp_len` (and further below past it). `None` when disabled.
pub fn overlong_penalty(kwargs: &RewardKwargsConfig, valid_response_len: usize) -> Option<f64> {
    let buffer = &kwargs.overlong_buffer_cfg;
    let max_resp_len = kwargs.max_resp_len?;
    if !buffer.enable || buffer.len == 0 {
        return None;
    }
    let expected_len = max_resp_len as f64 - buffer.len as f64;
    let exceed_len = valid_response_len as f64 - expected_len;
    Some((-exceed_len / buffer.len as f64 * buffer.penalty_factor).min(0.0))
}

/// Adds the penalty to the score and, when `log` is set, reports `overlong_reward` and `overlong` (0/1).
pub fn apply_overlong_penalty(result: &mut RewardResult, kwargs: &RewardKwargsConfig, valid_response_len: usize) {
    let Some(penalty) = overlong_penalty(kwargs, valid_response_len) else { return };
    result.add_to_score(penalty);
    if kwargs.overlong_buffer_cfg.log {
        result.extra.insert("overlong_reward".into(), penalty);
        result.extra.insert("overlong".into(), bool_to_f64(penalty < 0.0));
    }
}

#[cfg(test)]
mod tests {
    use jetrl_config::OverlongBufferConfig;

    use super::*;

    fn kwargs(log: bool) -> RewardKwargsConfig {
        RewardKwargsConfig {
            overlong_buffer_cfg: OverlongBufferConfig { enable: true, len: 100, penalty_factor: 1.0, log },
            max_resp_len: Some(1000),
        }
    }

    #[test]
    fn responses_within_the_expected_length_are_not_penalised() {
        assert_eq!(overlong_penalty(&kwargs(false), 900), Some(0.0));
        assert_eq!(overlong_penalty(&kwargs(false), 10), Some(0.0));
    }

    #[test]
    fn penalty_grows_linearly_through_the_buffer_and_beyond() {
        assert_eq!(overlong_penalty(&kwargs(false), 950), Some(-0.5));
        assert_eq!(overlong_penalty(&kwargs(false), 1000), Some(-1.0));
        assert_eq!(overlong_penalty(&kwargs(false), 1100), Some(-2.0));
    }

    #[test]
    fn penalty_factor_scales_the_penalty() {
        let mut scaled = kwargs(false);
        scaled.overlong_buffer_cfg.penalty_factor = 0.5;
        assert_eq!(overlong_penalty(&scaled, 1000), Some(-0.5));
    }

    #[test]
    fn logged_penalty_is_added_and_reported() {
        let mut result = RewardResult::from_number(1.0);
        apply_overlong_penalty(&mut result, &kwargs(true), 925);
        assert_eq!(result.score, 0.75);
        assert_eq!(result.extra["overlong_reward"], -0.25);
        assert_eq!(result.extra["overlong"], 1.0);
        assert_eq!(result.extra["acc"], 1.0);
    }

    #[test]
    fn unlogged_or_disabled_penalty_adds_no_extra_values() {
        let mut result = RewardResult::from_number(1.0);
        apply_overlong_penalty(&mut result, &kwargs(false), 925);
        assert_eq!(result.score, 0.75);
        assert!(!result.extra.contains_key("overlong"));
        let mut untouched = RewardResult::from_number(1.0);
        apply_overlong_penalty(&mut untouched, &RewardKwargsConfig::default(), 5000);
        assert_eq!(untouched, RewardResult::from_number(1.0));
    }
}
