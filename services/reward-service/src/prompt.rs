//! The prompt as a reward model or a user function reads it.
//!
//! verl's discriminative reward model reads the trajectory's chat messages (`raw_prompt`) plus the response as
//! the assistant turn, rendered with the reward model's own chat template. A trajectory carries those messages in
//! `Trajectory.raw_prompt`, filled by the rollout worker from the task's `messages`. When a trajectory has none
//! (a task given as prompt ids, or a worker that does not fill them yet), the prompt is its `prompt_ids` decoded
//! with the policy tokenizer (`model.path`), special tokens kept: the text the policy read, in the policy's chat
//! format. Without that tokenizer a reward model reads the response alone (logged once).
//!
//! Rule scorers never read the prompt, so nothing here runs for them.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use jetrl_config::JobConfig;
use jetrl_reward::{ChatTurn, RewardEngine};
use jetrl_tokenizer::Tokenizer;
use jetrl_wire::packed;
use jetrl_wire::v1::Trajectory;

/// Which prompt forms the configured scorer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reader {
    /// rule scorers: no prompt
    Nobody,
    /// the reward model; `renders_chat` when it has its own tokenizer (`reward.reward_model.tokenizer_path`)
    RewardModel { renders_chat: bool },
    /// a user function: `prompt_str` for generative judges
    UserFunction,
}

/// Fills a [`jetrl_reward::ScoreInput`]'s prompt fields for the configured scorer.
pub struct PromptSource {
    reader: Reader,
    /// the policy's tokenizer, to decode `prompt_ids` of trajectories without chat messages
    policy_tokenizer: Option<Tokenizer>,
    /// set once the "reward model reads the response alone" warning was logged
    warned_response_only: AtomicBool,
}

/// The prompt of one trajectory, in the forms the scorer reads.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Prompt {
    pub text: String,
    pub messages: Vec<ChatTurn>,
}

impl PromptSource {
    pub fn new(cfg: &JobConfig, engine: &RewardEngine) -> Self {
        let reader = match engine.route_name() {
            "reward_model" => Reader::RewardModel { renders_chat: engine.reward_model_renders_chat() },
            "external" => Reader::UserFunction,
            _ => Reader::Nobody,
        };
        let policy_tokenizer = match reader {
            Reader::Nobody => None,
            _ => load_policy_tokenizer(Path::new(&cfg.model.path)),
        };
        if let Reader::RewardModel { renders_chat } = reader {
            tracing::info!(
                rm_chat_template = renders_chat,
                policy_tokenizer = policy_tokenizer.is_some(),
                "reward model prompt: chat messages rendered with the RM template when present, else prompt ids \
                 decoded with the policy tokenizer"
            );
        }
        Self { reader, policy_tokenizer, warned_response_only: AtomicBool::new(false) }
    }

    /// Whether the scorer reads the prompt at all (nothing is decoded for rule scorers).
    pub fn needed(&self) -> bool {
        self.reader != Reader::Nobody
    }

    /// The prompt of `traj` as the scorer reads it.
    pub fn prompt(&self, traj: &Trajectory) -> Prompt {
        let messages: Vec<ChatTurn> = match self.reader {
            Reader::Nobody => return Prompt::default(),
            Reader::RewardModel { renders_chat: true } => {
                traj.raw_prompt.iter().map(|m| ChatTurn { role: m.role.clone(), content: m.content.clone() }).collect()
            }
            _ => Vec::new(),
        };
        if !messages.is_empty() {
            return Prompt { text: String::new(), messages };
        }
        let text = self.decoded_prompt(traj).unwrap_or_default();
        if text.is_empty()
            && matches!(self.reader, Reader::RewardModel { .. })
            && !self.warned_response_only.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                key = %traj.key,
                "the reward model reads this trajectory's response without its prompt: it carries no chat messages \
                 (raw_prompt) the RM template could render (set reward.reward_model.tokenizer_path), and model.path \
                 has no tokenizer to decode its prompt ids; logged once"
            );
        }
        Prompt { text, messages }
    }

    /// `prompt_ids` decoded with the policy tokenizer, special tokens kept, a leading BOS token left out (the
    /// reward model's server adds its own).
    fn decoded_prompt(&self, traj: &Trajectory) -> Option<String> {
        let tokenizer = self.policy_tokenizer.as_ref()?;
        let ids = packed::unpack_u32(&traj.prompt_ids).ok()?;
        let bos = tokenizer.special_token("bos_token").and_then(|bos| tokenizer.token_to_id(bos));
        let ids = match (ids.split_first(), bos) {
            (Some((&first, rest)), Some(bos)) if first == bos => rest,
            _ => &ids[..],
        };
        match tokenizer.decode(ids, false) {
            Ok(text) => Some(text),
            Err(err) => {
                tracing::debug!(key = %traj.key, error = %err, "prompt ids do not decode with the policy tokenizer");
                None
            }
        }
    }
}

fn load_policy_tokenizer(dir: &Path) -> Option<Tokenizer> {
    if !dir.join("tokenizer.json").is_file() {
        tracing::info!(path = %dir.display(), "no policy tokenizer at model.path: prompt ids are not decoded");
        return None;
    }
    match Tokenizer::from_dir(dir) {
        Ok(tokenizer) => Some(tokenizer),
        Err(err) => {
            tracing::warn!(path = %dir.display(), error = %err, "policy tokenizer at model.path does not load");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use jetrl_wire::v1::ChatMessage;

    use super::*;

    fn source(reader: Reader) -> PromptSource {
        PromptSource { reader, policy_tokenizer: None, warned_response_only: AtomicBool::new(false) }
    }

    fn with_messages() -> Trajectory {
        Trajectory {
            prompt_ids: packed::pack_u32(&[1, 2, 3]),
            raw_prompt: vec![ChatMessage { role: "user".into(), content: "reverse 1234".into() }],
            ..Trajectory::default()
        }
    }

    #[test]
    fn reward_model_with_its_own_template_gets_the_chat_messages() {
        let prompt = source(Reader::RewardModel { renders_chat: true }).prompt(&with_messages());
        assert_eq!(prompt.messages, [ChatTurn { role: "user".into(), content: "reverse 1234".into() }]);
    }

    #[test]
    fn rule_scorers_get_no_prompt_and_nothing_is_decoded() {
        let rules = source(Reader::Nobody);
        assert!(!rules.needed());
        assert_eq!(rules.prompt(&with_messages()), Prompt::default());
    }

    #[test]
    fn without_a_policy_tokenizer_the_prompt_text_is_empty_and_messages_go_only_where_rendered() {
        for reader in [Reader::RewardModel { renders_chat: false }, Reader::UserFunction] {
            assert_eq!(source(reader).prompt(&with_messages()), Prompt::default(), "{reader:?}");
        }
    }

    #[test]
    fn user_function_gets_the_prompt_ids_decoded_with_the_policy_tokenizer_without_the_bos() {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/tokenizer/tests/fixtures/chatml-word-level");
        let tokenizer = load_policy_tokenizer(Path::new(fixture));
        assert!(tokenizer.is_some(), "the fixture loads");
        let judge = PromptSource {
            reader: Reader::UserFunction,
            policy_tokenizer: tokenizer,
            warned_response_only: AtomicBool::new(false),
        };
        let traj = Trajectory { prompt_ids: packed::pack_u32(&[1, 2, 4, 7, 8, 3, 2, 5]), ..with_messages() };
        let prompt = judge.prompt(&traj);
        assert_eq!(prompt.text, "<|im_start|> user reverse 1234 <|im_end|> <|im_start|> assistant");
        assert!(prompt.messages.is_empty());
    }
}
