//! The training batch as the actor sees it: scored trajectories ([`Sample`]), their per-token columns padded
//! to `[rows, response_len]`, micro-batches that fit a token budget, and mini-batches of whole prompt groups.

use std::collections::{BTreeMap, HashMap};

use jetrl_model::{CausalLm, Checkpoints, ModelError, Packed};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tch::{Device, Kind, Tensor};

/// One scored trajectory, as the trainer trains on it.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub key: String,
    pub uid: String,
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// 1 = policy token (trained on), 0 = tool/observation token
    pub response_mask: Vec<u8>,
    /// behaviour log-probs from the rollout
    pub rollout_logprobs: Vec<f32>,
    pub score: f64,
    /// numeric reward components (verl `reward_extra_info`; GDPO reads them)
    pub extra: BTreeMap<String, f64>,
    pub min_version: u64,
    pub max_version: u64,
    pub submit_step: u64,
    pub data_source: String,
    pub ground_truth: String,
    /// the response hit max_new_tokens
    pub truncated: bool,
    pub num_turns: u32,
    /// tool calls the agent loop ran for this trajectory (one `tool_rewards` entry each on the wire)
    pub tool_calls: u32,
    /// the task's dataloader epoch and dataset row (batches are ordered by them)
    pub epoch: u64,
    pub dataset_row: u64,
    pub session_id: u32,
    /// `(first response position, version)` of each run of tokens sampled under one weight version
    pub version_runs: Vec<(u32, u64)>,
    /// remax: the score of the greedy rollout of the same prompt (verl's `reward_baselines`)
    pub reward_baseline: Option<f64>,
    /// R3: the experts the rollout routed each prompt and response token to, token-major
    /// (`[token][sparse layer][top_k]`), for the tokens a rollout forward read; empty without R3
    pub routed_experts: Vec<u16>,
    /// the layout of `routed_experts`: (sparse layers, experts per token)
    pub routes_layout: (u32, u32),
}

/// What a trajectory from the wire may hold before the trainer uses it: the model's vocabulary and context.
#[derive(Debug, Clone, Copy)]
pub struct SampleLimits {
    pub vocab_size: u64,
    /// prompt + response tokens at most (`max_position_embeddings`)
    pub max_len: usize,
}

impl Sample {
    /// A trajectory payload and its reward as a training row, checked at the boundary: every id inside the
    /// vocabulary, prompt and response non-empty and within the context, one mask entry and one finite log-prob
    /// per response token, the version span ordered, the score finite. Any violation names what was wrong; the
    /// caller fails the trajectory's group instead of training a partial one (or crashing the model thread on an
    /// out-of-range id).
    pub fn from_wire(
        traj: &jetrl_wire::v1::Trajectory,
        reward: &jetrl_wire::v1::Reward,
        limits: SampleLimits,
    ) -> Result<Self, String> {
        use jetrl_wire::packed;
        let prompt = packed::unpack_u32(&traj.prompt_ids).map_err(|e| format!("prompt_ids: {e}"))?;
        let response = packed::unpack_u32(&traj.response_ids).map_err(|e| format!("response_ids: {e}"))?;
        if prompt.is_empty() || response.is_empty() {
            return Err(format!("empty prompt ({} ids) or response ({} ids)", prompt.len(), response.len()));
        }
        if prompt.len() + response.len() > limits.max_len {
            return Err(format!(
                "{} prompt + {} response tokens exceed the model's context of {}",
                prompt.len(),
                response.len(),
                limits.max_len
            ));
        }
        if let Some(bad) = prompt.iter().chain(&response).find(|&&id| u64::from(id) >= limits.vocab_size) {
            return Err(format!("token id {bad} is outside the vocabulary ({})", limits.vocab_size));
        }
        let mut response_mask = traj.response_mask.to_vec();
        if response_mask.is_empty() {
            response_mask = vec![1; response.len()];
        }
        if response_mask.len() != response.len() || response_mask.iter().any(|&m| m > 1) {
            return Err(format!(
                "response_mask has {} entries (each 0 or 1) for {} response tokens",
                response_mask.len(),
                response.len()
            ));
        }
        let rollout_logprobs = packed::unpack_f32(&traj.logprobs).map_err(|e| format!("logprobs: {e}"))?;
        if rollout_logprobs.len() != response.len() {
            return Err(format!("{} log-probs for {} response tokens", rollout_logprobs.len(), response.len()));
        }
        if let Some(bad) = rollout_logprobs.iter().find(|lp| !lp.is_finite() || **lp > 0.0) {
            return Err(format!("log-prob {bad} is not a finite number <= 0"));
        }
        if traj.min_version > traj.max_version {
            return Err(format!("version span {}..{} is reversed", traj.min_version, traj.max_version));
        }
        if !reward.score.is_finite() {
            return Err(format!("score {} is not finite", reward.score));
        }
        let per_token = (traj.routed_experts_layers as usize) * (traj.routed_experts_top_k as usize);
        if !traj.routed_experts.is_empty()
            && (per_token == 0
                || traj.routed_experts.len() % per_token != 0
                || traj.routed_experts.len() / per_token > prompt.len() + response.len())
        {
            return Err(format!(
                "routed_experts has {} entries, not whole tokens of {} layers × {} experts for at most {} tokens",
                traj.routed_experts.len(),
                traj.routed_experts_layers,
                traj.routed_experts_top_k,
                prompt.len() + response.len()
            ));
        }
        let routed_experts = traj
            .routed_experts
            .iter()
            .map(|&e| u16::try_from(e).map_err(|_| format!("routed expert {e} is not an expert index")))
            .collect::<Result<Vec<u16>, String>>()?;
        Ok(Sample {
            key: traj.key.clone(),
            uid: traj.uid.clone(),
            prompt,
            response,
            response_mask,
            rollout_logprobs,
            score: reward.score,
            extra: reward.extra.iter().filter(|(_, v)| v.is_finite()).map(|(k, v)| (k.clone(), *v)).collect(),
            min_version: traj.min_version,
            max_version: traj.max_version,
            submit_step: traj.submit_step,
            data_source: traj.data_source.clone(),
            ground_truth: traj.ground_truth.clone(),
            truncated: traj.finish_reason == jetrl_wire::v1::FinishReason::Length as i32,
            num_turns: traj.num_turns,
            tool_calls: u32::try_from(traj.tool_rewards.len()).unwrap_or(u32::MAX),
            epoch: traj.epoch,
            dataset_row: traj.dataset_row,
            session_id: traj.session_id,
            version_runs: traj.version_runs.iter().map(|r| (r.first_token, r.version)).collect(),
            routed_experts,
            routes_layout: (traj.routed_experts_layers, traj.routed_experts_top_k),
            reward_baseline: None,
        })
    }
}

/// Per-row tensors of a micro-batch: prompts left-padded to `p`, responses right-padded to `r`, so position
/// `p − 1 + j` of the sequence predicts response token `j` in every row; and, when packed, the same rows end to
/// end without padding.
pub struct MicroBatch {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub response_ids: Tensor,
    /// the samples' own response masks (1 = trained on)
    pub response_mask: Tensor,
    pub p: i64,
    pub r: i64,
    /// the rows packed into one (`model.use_remove_padding`): the forward passes run on this instead
    pub packed: Option<PackedRows>,
}

/// A micro-batch's rows packed end to end in one row, and where each response token's prediction is in it.
pub struct PackedRows {
    /// `[1, N]`: each row's prompt then response, rows in order
    pub input_ids: Tensor,
    /// each row's prompt + response length
    pub lens: Vec<i64>,
    /// `[T]`: for each response token (rows in order), the position in the packed row that predicts it
    pub predicting: Tensor,
    /// `[T]`: each response token's place in the `[n, r]` matrices (`row · r + j`)
    pub slots: Tensor,
    /// `[T]`: the response tokens
    pub response_ids: Tensor,
}

impl MicroBatch {
    /// The rows padded, and packed too when `packed` (the forward passes then use the packed row).
    pub fn build_for(rows: &[&Sample], pad_id: i64, device: Device, packed: bool) -> Result<Self, tch::TchError> {
        let mut mb = Self::build(rows, pad_id, device)?;
        if packed {
            mb.packed = Some(PackedRows::build(rows, mb.r, device)?);
        }
        Ok(mb)
    }

    /// Where each of `rows` (the rows this micro-batch was built from, in order) has its prompt and response tokens
    /// in the forward's flattened token order: (first index, token count). Padded rows are `[n, p + r]` row-major
    /// with the prompt left-padded to `p`; packed rows lie end to end.
    pub fn token_spans(&self, rows: &[&Sample]) -> Vec<(i64, i64)> {
        let mut next = 0;
        rows.iter()
            .enumerate()
            .map(|(i, s)| {
                let (prompt, len) = (s.prompt.len() as i64, (s.prompt.len() + s.response.len()) as i64);
                let start = match &self.packed {
                    None => i as i64 * (self.p + self.r) + self.p - prompt,
                    Some(_) => next,
                };
                next += len;
                (start, len)
            })
            .collect()
    }

    /// The forward's token count: `n × (p + r)` padded, the packed row's length packed.
    pub fn token_count(&self) -> i64 {
        match &self.packed {
            None => self.input_ids.numel() as i64,
            Some(p) => p.lens.iter().sum(),
        }
    }

    /// The ids the response logits score: `[n, r]` padded, `[T]` packed.
    pub fn scored_ids(&self) -> &Tensor {
        self.packed.as_ref().map_or(&self.response_ids, |p| &p.response_ids)
    }

    /// Per-token values of the response tokens as `[n, r]` (zero past each response): padded values are that
    /// already; packed ones (`[T]`) are put in their slots (differentiably).
    pub fn to_rows(&self, values: &Tensor) -> Result<Tensor, tch::TchError> {
        match &self.packed {
            None => Ok(values.shallow_clone()),
            Some(p) => {
                let n = self.response_ids.size()[0];
                Tensor::f_zeros([n * self.r], (values.kind(), values.device()))?
                    .f_index_copy(0, &p.slots, values)?
                    .f_view([n, self.r])
            }
        }
    }

    /// The model's final hidden states at the positions that predict the response tokens: `[n, r, H]` padded,
    /// `[T, H]` packed. With `checkpointing` the decoder layers keep no activations and the returned checkpoints
    /// must be back-propagated ([`CausalLm::backward_checkpointed`]) right after the loss's backward pass.
    pub fn response_hidden(
        &self,
        model: &CausalLm,
        checkpointing: bool,
    ) -> Result<(Tensor, Option<Checkpoints>), ModelError> {
        let (hidden, checkpoints) = match (&self.packed, checkpointing) {
            (None, false) => (model.forward_hidden(&self.input_ids, &self.attention_mask)?, None),
            (None, true) => {
                let (hidden, checkpoints) = model.forward_hidden_checkpointed(&self.input_ids, &self.attention_mask)?;
                (hidden, Some(checkpoints))
            }
            (Some(p), false) => {
                (model.forward_hidden_packed(&Packed { input_ids: &p.input_ids, lens: &p.lens })?, None)
            }
            (Some(p), true) => {
                let packed = Packed { input_ids: &p.input_ids, lens: &p.lens };
                let (hidden, checkpoints) = model.forward_hidden_packed_checkpointed(&packed)?;
                (hidden, Some(checkpoints))
            }
        };
        let at_responses = match &self.packed {
            // position p-1+j predicts response token j
            None => hidden.f_narrow(1, self.p - 1, self.r)?,
            Some(p) => hidden.f_squeeze_dim(0)?.f_index_select(0, &p.predicting)?,
        };
        Ok((at_responses, checkpoints))
    }

    pub fn build(rows: &[&Sample], pad_id: i64, device: Device) -> Result<Self, tch::TchError> {
        let p = rows.iter().map(|s| s.prompt.len()).max().unwrap_or(1).max(1);
        let r = rows.iter().map(|s| s.response.len()).max().unwrap_or(1).max(1);
        let width = p + r;
        let mut ids = vec![pad_id; rows.len() * width];
        let mut attn = vec![0i64; rows.len() * width];
        let mut resp_ids = vec![pad_id; rows.len() * r];
        let mut resp_mask = vec![0f32; rows.len() * r];
        for (i, s) in rows.iter().enumerate() {
            let offset = i * width + p - s.prompt.len();
            for (j, &t) in s.prompt.iter().enumerate() {
                ids[offset + j] = i64::from(t);
                attn[offset + j] = 1;
            }
            for (j, &t) in s.response.iter().enumerate() {
                ids[i * width + p + j] = i64::from(t);
                attn[i * width + p + j] = 1;
                resp_ids[i * r + j] = i64::from(t);
                resp_mask[i * r + j] = f32::from(s.response_mask.get(j).copied().unwrap_or(1));
            }
        }
        let (n, p, r) = (rows.len() as i64, p as i64, r as i64);
        Ok(MicroBatch {
            input_ids: Tensor::f_from_slice(&ids)?.f_view([n, p + r])?.f_to_device(device)?,
            attention_mask: Tensor::f_from_slice(&attn)?.f_view([n, p + r])?.f_to_device(device)?,
            response_ids: Tensor::f_from_slice(&resp_ids)?.f_view([n, r])?.f_to_device(device)?,
            response_mask: Tensor::f_from_slice(&resp_mask)?.f_view([n, r])?.f_to_device(device)?,
            p,
            r,
            packed: None,
        })
    }
}

impl PackedRows {
    /// `rows` end to end; `r` is the padded response width of their `[n, r]` matrices.
    fn build(rows: &[&Sample], r: i64, device: Device) -> Result<Self, tch::TchError> {
        let (mut ids, mut lens, mut predicting, mut slots, mut response_ids) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, s) in rows.iter().enumerate() {
            let start = ids.len() as i64;
            let prompt = s.prompt.len() as i64;
            ids.extend(s.prompt.iter().chain(&s.response).map(|&t| i64::from(t)));
            lens.push((s.prompt.len() + s.response.len()) as i64);
            for (j, &t) in s.response.iter().enumerate() {
                // the prompt's last token predicts the first response token
                predicting.push(start + prompt - 1 + j as i64);
                slots.push(i as i64 * r + j as i64);
                response_ids.push(i64::from(t));
            }
        }
        let tensor = |v: &[i64]| Tensor::f_from_slice(v).and_then(|t| t.f_to_device(device));
        Ok(PackedRows {
            input_ids: tensor(&ids)?.f_view([1, ids.len() as i64])?,
            lens,
            predicting: tensor(&predicting)?,
            slots: tensor(&slots)?,
            response_ids: tensor(&response_ids)?,
        })
    }
}

/// Splits `rows` (kept in order) into runs whose padded size `rows × (max prompt + max response)` stays within
/// `max_tokens`; a row larger than the budget gets a micro-batch of its own.
pub fn split_by_token_budget(rows: &[usize], samples: &[Sample], max_tokens: usize) -> Vec<Vec<usize>> {
    split_by_lengths(rows, |row| (samples[row].prompt.len(), samples[row].response.len()), max_tokens)
}

/// [`split_by_token_budget`] over rows known by their (prompt, response) lengths.
pub fn split_by_lengths(rows: &[usize], lens: impl Fn(usize) -> (usize, usize), max_tokens: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let (mut p, mut r) = (0usize, 0usize);
    for &row in rows {
        let (prompt, response) = lens(row);
        let np = p.max(prompt);
        let nr = r.max(response);
        if !current.is_empty() && (current.len() + 1) * (np + nr) > max_tokens {
            out.push(std::mem::take(&mut current));
            p = prompt;
            r = response;
        } else {
            p = np;
            r = nr;
        }
        current.push(row);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Rows grouped by prompt (uid), groups in order of first appearance.
pub fn groups_of(samples: &[Sample]) -> Vec<Vec<usize>> {
    groups_of_uids(samples.iter().map(|s| s.uid.as_str()))
}

/// Row indices grouped by uid, groups in order of first appearance.
pub fn groups_of_uids<'a>(uids: impl Iterator<Item = &'a str>) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (i, uid) in uids.enumerate() {
        let slot = *index.entry(uid).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[slot].push(i);
    }
    groups
}

/// What the whole-batch math needs of a row that another rank holds: its ids, score and lengths.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RowInfo {
    pub key: String,
    pub uid: String,
    pub score: f64,
    pub extra: BTreeMap<String, f64>,
    pub prompt_len: usize,
    pub response_len: usize,
    /// remax: the score of the greedy rollout of the row's prompt
    #[serde(default)]
    pub reward_baseline: Option<f64>,
}

impl RowInfo {
    pub fn of(s: &Sample) -> Self {
        Self {
            key: s.key.clone(),
            uid: s.uid.clone(),
            score: s.score,
            extra: s.extra.clone(),
            prompt_len: s.prompt.len(),
            response_len: s.response.len(),
            reward_baseline: s.reward_baseline,
        }
    }
}

/// A step's batch as one trainer rank holds it: every row of the batch in the order all ranks agree on (what the
/// whole-batch math needs: group ids, scores, lengths), and the payloads of the rows this rank trains on. With one
/// rank it holds every row.
#[derive(Debug, Clone, Default)]
pub struct RankBatch {
    pub rows: Vec<RowInfo>,
    /// payloads of this rank's rows, by row index
    pub local: BTreeMap<usize, Sample>,
}

impl RankBatch {
    /// Every row, held here (one rank).
    pub fn whole(samples: Vec<Sample>) -> Self {
        Self { rows: samples.iter().map(RowInfo::of).collect(), local: samples.into_iter().enumerate().collect() }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The longest response of the batch: the width of its per-token matrices.
    pub fn width(&self) -> usize {
        self.rows.iter().map(|r| r.response_len).max().unwrap_or(1).max(1)
    }

    /// Rows grouped by prompt (uid), groups in order of first appearance.
    pub fn groups(&self) -> Vec<Vec<usize>> {
        groups_of_uids(self.rows.iter().map(|r| r.uid.as_str()))
    }

    /// This rank's rows among `rows` (kept in order), split into micro-batches within `max_tokens`.
    pub fn local_micro_batches(&self, rows: &[usize], max_tokens: usize) -> Vec<Vec<usize>> {
        let mine: Vec<usize> = rows.iter().copied().filter(|r| self.local.contains_key(r)).collect();
        split_by_lengths(&mine, |r| (self.rows[r].prompt_len, self.rows[r].response_len), max_tokens)
    }

    /// Every row this rank holds, in order.
    pub fn local_rows(&self) -> Vec<usize> {
        self.local.keys().copied().collect()
    }

    /// The payloads of `rows` (all held here).
    pub fn samples(&self, rows: &[usize]) -> Vec<&Sample> {
        rows.iter().filter_map(|r| self.local.get(r)).collect()
    }

    /// The batch resampled (PF-PPO): row `k` of the result is row `picked[k]` of this one, held where it was.
    pub fn resampled(&self, picked: &[usize]) -> Self {
        Self {
            rows: picked.iter().map(|&i| self.rows[i].clone()).collect(),
            local: picked.iter().enumerate().filter_map(|(k, i)| self.local.get(i).map(|s| (k, s.clone()))).collect(),
        }
    }
}

/// The mini-batches of one PPO epoch: `groups_per_mini_batch` whole prompt groups each (0 = all), the group
/// order shuffled when `shuffle` with a seed derived from (`seed`, `step`, `epoch`) — so a resumed run
/// shuffles exactly as an uninterrupted one.
pub fn mini_batches(
    groups: &[Vec<usize>],
    groups_per_mini_batch: usize,
    shuffle: bool,
    seed: u64,
    step: u64,
    epoch: u32,
) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..groups.len()).collect();
    if shuffle {
        let mixed =
            seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(epoch).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
        order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(mixed));
    }
    let per = if groups_per_mini_batch == 0 { groups.len().max(1) } else { groups_per_mini_batch };
    order.chunks(per).map(|chunk| chunk.iter().flat_map(|&g| groups[g].iter().copied()).collect()).collect()
}

/// Row `i` of a `[rows, width]` host matrix, cut to `len`.
pub fn row_of(matrix: &[f32], width: usize, i: usize, len: usize) -> &[f32] {
    &matrix[i * width..i * width + len.min(width)]
}

/// Builds `[rows.len(), width]` from the rows `rows` of a host matrix of row width `src_width`, zero-padded.
pub fn gather_rows(
    matrix: &[f32],
    src_width: usize,
    rows: &[usize],
    width: usize,
    device: Device,
) -> Result<Tensor, tch::TchError> {
    let mut flat = vec![0f32; rows.len() * width];
    let copy = width.min(src_width);
    for (i, &row) in rows.iter().enumerate() {
        flat[i * width..i * width + copy].copy_from_slice(&matrix[row * src_width..row * src_width + copy]);
    }
    Tensor::f_from_slice(&flat)?.f_view([rows.len() as i64, width as i64])?.f_to_device(device)
}

/// A `[rows, width]` f32 tensor as a host matrix.
pub fn to_host(t: &Tensor) -> Result<Vec<f32>, tch::TchError> {
    Vec::<f32>::try_from(t.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?.f_contiguous()?.f_view([-1])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(uid: &str, p: usize, r: usize) -> Sample {
        Sample {
            uid: uid.into(),
            prompt: vec![5; p],
            response: vec![6; r],
            response_mask: vec![1; r],
            ..Sample::default()
        }
    }

    /// A trajectory whose routed experts are not whole tokens of their layout, or more tokens than it has, or not
    /// expert indices, is refused naming routed_experts; routes of whole tokens are kept with their layout.
    #[test]
    fn malformed_routed_experts_are_refused_at_the_boundary() {
        use jetrl_wire::{packed, v1};
        let limits = SampleLimits { vocab_size: 100, max_len: 64 };
        let traj = |routes: Vec<u32>, layers: u32, top_k: u32| v1::Trajectory {
            prompt_ids: packed::pack_u32(&[1, 2]),
            response_ids: packed::pack_u32(&[3, 4]),
            logprobs: packed::pack_f32(&[-1.0, -1.0]),
            routed_experts: routes,
            routed_experts_layers: layers,
            routed_experts_top_k: top_k,
            ..Default::default()
        };
        let reward = v1::Reward::default();
        let ok = Sample::from_wire(&traj(vec![0, 1, 2, 3, 4, 5], 1, 2), &reward, limits).unwrap();
        assert_eq!((ok.routed_experts.len(), ok.routes_layout), (6, (1, 2)));
        for bad in [
            traj(vec![0, 1, 2], 1, 2),   // not whole tokens
            traj(vec![0; 10], 1, 2),     // 5 tokens for 4
            traj(vec![0, 1], 0, 0),      // no layout
            traj(vec![0, 70_000], 1, 2), // not an expert index
        ] {
            let err = Sample::from_wire(&bad, &reward, limits).unwrap_err();
            assert!(err.contains("routed"), "{err}");
        }
    }

    #[test]
    fn micro_batch_left_pads_prompts_and_right_pads_responses() {
        let (a, b) = (sample("a", 2, 3), sample("b", 3, 1));
        let mb = MicroBatch::build(&[&a, &b], 0, Device::Cpu).unwrap();
        assert_eq!((mb.p, mb.r), (3, 3));
        let attn = Vec::<i64>::try_from(mb.attention_mask.view([-1])).unwrap();
        assert_eq!(attn, vec![0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]);
        let mask = Vec::<f32>::try_from(mb.response_mask.view([-1])).unwrap();
        assert_eq!(mask, vec![1., 1., 1., 1., 0., 0.]);
    }

    #[test]
    fn token_budget_counts_padded_tokens_and_keeps_row_order() {
        let samples = vec![sample("a", 4, 4), sample("a", 4, 4), sample("b", 8, 8), sample("b", 2, 2)];
        let mbs = split_by_token_budget(&[0, 1, 2, 3], &samples, 16);
        assert_eq!(mbs, vec![vec![0, 1], vec![2], vec![3]]);
    }

    #[test]
    fn a_rank_batch_splits_only_the_rows_it_holds_and_resamples_with_them() {
        let samples = vec![sample("a", 4, 4), sample("a", 4, 4), sample("b", 8, 8), sample("b", 2, 2)];
        let whole = RankBatch::whole(samples.clone());
        assert_eq!(whole.width(), 8);
        assert_eq!(whole.groups(), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(whole.local_micro_batches(&[0, 1, 2, 3], 16), split_by_token_budget(&[0, 1, 2, 3], &samples, 16));
        let mut part = whole.clone();
        part.local.retain(|&r, _| r >= 2);
        assert_eq!(part.local_micro_batches(&[0, 1, 2, 3], 100), vec![vec![2, 3]]);
        let resampled = part.resampled(&[2, 0, 2]);
        assert_eq!(resampled.rows.iter().map(|r| r.uid.as_str()).collect::<Vec<_>>(), vec!["b", "a", "b"]);
        assert_eq!(resampled.local_rows(), vec![0, 2]);
    }

    #[test]
    fn mini_batches_keep_groups_whole_and_shuffle_reproducibly() {
        let samples: Vec<Sample> = ["a", "b", "a", "c", "b", "c", "d", "d"].iter().map(|u| sample(u, 1, 1)).collect();
        let groups = groups_of(&samples);
        assert_eq!(groups, vec![vec![0, 2], vec![1, 4], vec![3, 5], vec![6, 7]]);
        let first = mini_batches(&groups, 2, true, 7, 3, 0);
        assert_eq!(first, mini_batches(&groups, 2, true, 7, 3, 0));
        assert_eq!(first.len(), 2);
        for mb in &first {
            assert_eq!(mb.len(), 4);
            for pair in mb.chunks(2) {
                assert_eq!(samples[pair[0]].uid, samples[pair[1]].uid);
            }
        }
        assert_eq!(mini_batches(&groups, 0, false, 7, 3, 0), vec![vec![0, 2, 1, 4, 3, 5, 6, 7]]);
    }
}
