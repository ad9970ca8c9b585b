//! What the scorers read: one trajectory and its prompt's chat messages. A leaf every scorer imports.

use serde::{Deserialize, Serialize};

/// One trajectory to score.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ScoreInput {
    /// the trajectory key `{uid}_{session_id}_{index}`, echoed in the outcome and sent to user functions
    pub key: String,
    pub data_source: String,
    /// the decoded response (special tokens skipped), verl's `solution_str`
    pub solution_str: String,
    /// verl's `reward_model.ground_truth` as text (search-R1: the JSON `{"target": [...]}`)
    pub ground_truth: String,
    pub extra_info: serde_json::Value,
    /// the prompt as text, already in chat format: the reward model reads it before the response when it cannot
    /// render `raw_prompt` itself, and user functions receive it (for generative judges); may be empty
    pub prompt_str: String,
    /// the prompt's chat messages (verl's `raw_prompt`): the reward model renders them with its own chat template
    pub raw_prompt: Vec<ChatTurn>,
    /// valid response tokens, for the overlong penalty
    pub response_len: usize,
}

/// One message of a chat prompt, as chat templates read it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatTurn {
    pub role: String,
    pub content: String,
}
