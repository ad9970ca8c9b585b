//! The reward service's view of a group: [`v1::ScoreRequest`] (trajectories without their token arrays) and
//! [`v1::RewardBatch`] (its rewards), and the lengths and ids both sides agree on.

use crate::packed;
use crate::v1::{GroupPrompt, ScoreRequest, Trajectory};

/// `traj` as a score request carries it: what a scorer or the reward reads, without the token arrays (prompt ids
/// stay when the trajectory has no chat messages, so a reward model or user function can still decode the prompt)
/// and without what only the trainer and the logs read (worker, agent loop, stop reason, tool rewards); uid and
/// partition are the request's. `stored_seq` names the full trajectory in TRAJ; the arrays' lengths are kept.
pub fn score_view(traj: &Trajectory, stored_seq: u64) -> Trajectory {
    Trajectory {
        key: traj.key.clone(),
        session_id: traj.session_id,
        index: traj.index,
        submit_step: traj.submit_step,
        prompt_ids: if traj.raw_prompt.is_empty() { traj.prompt_ids.clone() } else { Default::default() },
        min_version: traj.min_version,
        max_version: traj.max_version,
        finish_reason: traj.finish_reason,
        timings: traj.timings,
        response_text: traj.response_text.clone(),
        data_source: traj.data_source.clone(),
        ground_truth: traj.ground_truth.clone(),
        extra_info_json: traj.extra_info_json.clone(),
        num_turns: traj.num_turns,
        raw_prompt: traj.raw_prompt.clone(),
        greedy_baseline: traj.greedy_baseline,
        stored_seq,
        prompt_len: prompt_len(traj),
        response_len: response_len(traj),
        ..Default::default()
    }
}

/// Moves the prompt fields that every trajectory of `request` shares into `request.common` (each carried once).
pub fn factor_common(request: &mut ScoreRequest) {
    let mut common = GroupPrompt::default();
    macro_rules! factor {
        ($field:ident) => {
            if let Some((first, rest)) = request.trajectories.split_first() {
                if !first.$field.is_empty() && rest.iter().all(|t| t.$field == first.$field) {
                    common.$field = first.$field.clone();
                    for traj in &mut request.trajectories {
                        traj.$field = Default::default();
                    }
                }
            }
        };
    }
    factor!(prompt_ids);
    factor!(raw_prompt);
    factor!(data_source);
    factor!(ground_truth);
    factor!(extra_info_json);
    request.common = (common != GroupPrompt::default()).then_some(common);
}

/// Puts the fields [`factor_common`] carried once back into every trajectory of `request` (uid and partition
/// stay the request's). The prompt (ids, chat messages) and extra info only `with_prompt`: rule scorers read
/// neither.
pub fn expand_common(request: &mut ScoreRequest, with_prompt: bool) {
    let Some(common) = request.common.take() else { return };
    macro_rules! expand {
        ($field:ident) => {
            if !common.$field.is_empty() {
                for traj in &mut request.trajectories {
                    traj.$field.clone_from(&common.$field);
                }
            }
        };
    }
    expand!(data_source);
    expand!(ground_truth);
    if with_prompt {
        expand!(prompt_ids);
        expand!(raw_prompt);
        expand!(extra_info_json);
    }
}

/// Prompt tokens of a full trajectory or of its score view.
pub fn prompt_len(traj: &Trajectory) -> u32 {
    if traj.prompt_ids.is_empty() {
        traj.prompt_len
    } else {
        packed::u32_len(&traj.prompt_ids) as u32
    }
}

/// Response tokens of a full trajectory or of its score view.
pub fn response_len(traj: &Trajectory) -> u32 {
    if traj.response_ids.is_empty() {
        traj.response_len
    } else {
        packed::u32_len(&traj.response_ids) as u32
    }
}

/// The `Nats-Msg-Id` of a score request and of its reward batch: `{uid}.{count}.{hash}` over the trajectory keys
/// (in order). The same group published again with the same trajectories gets the same id (stored once); a
/// retry that produced a different set of trajectories gets a new one, so none of them goes unscored.
pub fn request_id(request: &ScoreRequest) -> String {
    let hash = fnv1a(request.trajectories.iter().map(|traj| traj.key.as_str()));
    format!("{}.{}.{hash:016x}", request.uid, request.trajectories.len())
}

/// The `Nats-Msg-Id` of a reward batch answering the score requests `ids` (in order): the id itself for one
/// request, else `batch.{count}.{hash}` over the ids. The same requests answered again are stored once.
pub fn reward_batch_id(ids: &[&str]) -> String {
    match ids {
        [one] => (*one).to_string(),
        _ => format!("batch.{}.{:016x}", ids.len(), fnv1a(ids.iter().copied())),
    }
}

/// FNV-1a, 64 bits, over `parts` each followed by a zero byte: stable across processes and versions (std's
/// hasher is not).
fn fnv1a<'a>(parts: impl Iterator<Item = &'a str>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for byte in part.bytes().chain(std::iter::once(0)) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::ChatMessage;
    use crate::Message;

    fn traj(key: &str) -> Trajectory {
        Trajectory {
            key: key.into(),
            uid: "u".into(),
            partition: "train".into(),
            prompt_ids: packed::pack_u32(&[1, 2, 3]),
            response_ids: packed::pack_u32(&[4, 5]),
            response_mask: packed::pack_u8(&[1, 1]),
            logprobs: packed::pack_f32(&[-0.1, -0.2]),
            response_text: "45".into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_score_view_drops_the_token_arrays_and_keeps_their_lengths_and_the_stored_sequence() {
        let full = Trajectory { worker_id: "w".into(), stop_reason: "eos".into(), ..traj("u_0_0") };
        let view = score_view(&full, 42);
        assert!(view.uid.is_empty() && view.worker_id.is_empty() && view.stop_reason.is_empty());
        assert!(view.response_ids.is_empty() && view.response_mask.is_empty() && view.logprobs.is_empty());
        assert_eq!((view.stored_seq, prompt_len(&view), response_len(&view)), (42, 3, 2));
        assert_eq!(view.prompt_ids, full.prompt_ids, "no chat messages: the prompt ids stay for decoding");
        assert_eq!(view.response_text, "45");
        let chat =
            Trajectory { raw_prompt: vec![ChatMessage { role: "user".into(), content: "hi".into() }], ..traj("u_0_0") };
        let view = score_view(&chat, 1);
        assert!(view.prompt_ids.is_empty(), "the chat messages stand for the prompt");
        assert_eq!((view.raw_prompt.len(), prompt_len(&view)), (1, 3));
    }

    #[test]
    fn shared_prompt_fields_travel_once_and_come_back_into_every_trajectory() {
        let mut a = traj("u_0_0");
        a.ground_truth = "45".into();
        a.data_source = "openai/gsm8k".into();
        let b = Trajectory { key: "u_1_0".into(), ..a.clone() };
        let c = Trajectory { key: "u_2_0".into(), data_source: "math".into(), ..a.clone() };
        let original =
            ScoreRequest { uid: "u".into(), partition: "train".into(), trajectories: vec![a, b, c], common: None };
        let mut request = original.clone();
        factor_common(&mut request);
        let common = request.common.clone().unwrap();
        assert_eq!((common.ground_truth.as_str(), common.prompt_ids.len()), ("45", 12));
        assert!(common.data_source.is_empty(), "differs between trajectories: stays in them");
        assert!(request.trajectories.iter().all(|t| t.ground_truth.is_empty() && t.prompt_ids.is_empty()));
        assert!(request.encoded_len() < original.encoded_len());
        let mut rules_only = request.clone();
        expand_common(&mut request, true);
        assert_eq!(request, original);
        expand_common(&mut rules_only, false);
        assert!(rules_only.trajectories.iter().all(|t| t.ground_truth == "45" && t.prompt_ids.is_empty()));
    }

    #[test]
    fn the_request_id_depends_on_the_uid_and_every_key() {
        let request = |keys: &[&str]| ScoreRequest {
            uid: "u".into(),
            partition: "train".into(),
            trajectories: keys.iter().map(|k| traj(k)).collect(),
            common: None,
        };
        let a = request_id(&request(&["u_0_0", "u_1_0"]));
        assert_eq!(a, request_id(&request(&["u_0_0", "u_1_0"])));
        assert!(a.starts_with("u.2."), "{a}");
        assert_ne!(a, request_id(&request(&["u_0_0", "u_2_0"])));
        assert_ne!(a, request_id(&request(&["u_0_0"])));
    }
}
