//! Fuzzing every decoder of the wire contract with proptest: each protobuf message of
//! `proto/jetrl/v1/jetrl.proto` (as the services decode it, followed by what they do next with it: packed arrays
//! unpacked, keys parsed, shared prompt fields expanded), the packed arrays, trajectory keys and group subjects.
//!
//! Inputs are random bytes and valid messages of every type mutated at the protobuf field level (fields
//! swapped, dropped, duplicated, renumbered, given another wire type or another field's payload, length
//! prefixes lying, nested messages edited the same way) and at the byte level. Properties: no panic, an error
//! that names what was wrong, and exact round trips (encode then decode; format then parse).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

#[path = "fuzz_support/bytes.rs"]
mod mutate;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;

use jetrl_wire::keys::{self, KeyError, TrajectoryKey};
use jetrl_wire::v1::*;
use jetrl_wire::{packed, score, subjects, Message};
use proptest::prelude::*;
use proptest::sample::Index;

fn config() -> ProptestConfig {
    mutate::fuzz_config(concat!(env!("CARGO_MANIFEST_DIR"), "/proptest-regressions/fuzz.txt"))
}

// ---------------------------------------------------------------------------------------------------------------
// Valid examples of every message, every field set.

fn chat() -> Vec<ChatMessage> {
    vec![
        ChatMessage { role: "system".into(), content: "You are terse.".into() },
        ChatMessage { role: "user".into(), content: "What is 7 times 6?".into() },
    ]
}

fn sampling() -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 50,
        repetition_penalty: 1.1,
        max_new_tokens: 128,
        stop_token_ids: vec![2, 151_643],
        stop: vec!["</answer>".into()],
        seed: Some(17),
    }
}

fn prompt_task() -> PromptTask {
    PromptTask {
        uid: "0b6c1f9e-3f5a-4c1e-9a53-7f3c2d1e0a11".into(),
        partition: "train".into(),
        n: 8,
        submit_step: 41,
        sampling: Some(sampling()),
        prompt_ids: packed::pack_u32(&[1, 2, 3, 151_643]),
        messages: chat(),
        data_source: "openai/gsm8k".into(),
        ground_truth: "42".into(),
        extra_info_json: r#"{"index": 5, "split": "train"}"#.into(),
        agent_name: "tool_agent".into(),
        row_index: 5,
        min_policy_version: 40,
        epoch: 1,
        dataset_row: 5,
        greedy_baseline: true,
    }
}

fn trajectory() -> Trajectory {
    Trajectory {
        key: "0b6c1f9e_3_1".into(),
        uid: "0b6c1f9e".into(),
        session_id: 3,
        index: 1,
        partition: "train".into(),
        submit_step: 41,
        prompt_ids: packed::pack_u32(&[1, 2, 3]),
        response_ids: packed::pack_u32(&[4, 5, 6, 2]),
        response_mask: packed::pack_u8(&[1, 1, 0, 1]),
        logprobs: packed::pack_f32(&[-0.1, -2.5, 0.0, -0.01]),
        min_version: 6,
        max_version: 7,
        finish_reason: FinishReason::Stop as i32,
        timings: Some(Timings { time_to_first_token_s: 0.05, generate_s: 1.5, completed_unix_ms: 1_721_739_909_000 }),
        response_text: "6 * 7 = 42".into(),
        data_source: "openai/gsm8k".into(),
        ground_truth: "42".into(),
        extra_info_json: r#"{"index": 5}"#.into(),
        worker_id: "rollout-0".into(),
        num_turns: 2,
        tool_rewards: vec![0.5, 0.0],
        agent_name: "tool_agent".into(),
        stop_reason: "eos".into(),
        raw_prompt: chat(),
        stored_seq: 1234,
        prompt_len: 3,
        response_len: 4,
        epoch: 1,
        dataset_row: 5,
        version_runs: vec![VersionRun { first_token: 0, version: 6 }, VersionRun { first_token: 2, version: 7 }],
        greedy_baseline: true,
        routed_experts: vec![3, 0, 7, 1, 2, 5],
        routed_experts_layers: 1,
        routed_experts_top_k: 2,
    }
}

fn score_request() -> ScoreRequest {
    let mut request = ScoreRequest {
        uid: "0b6c1f9e".into(),
        partition: "train".into(),
        trajectories: vec![
            score::score_view(&trajectory(), 10),
            score::score_view(&Trajectory { key: "0b6c1f9e_4_0".into(), ..trajectory() }, 11),
        ],
        common: None,
    };
    score::factor_common(&mut request);
    request
}

fn reward() -> Reward {
    Reward {
        key: "0b6c1f9e_3_1".into(),
        uid: "0b6c1f9e".into(),
        partition: "train".into(),
        traj_seq: 1234,
        score: 0.75,
        extra: BTreeMap::from([("acc".to_string(), 1.0), ("overlong".to_string(), -0.25)]),
        extra_text: BTreeMap::from([("pred".to_string(), "42".to_string())]),
        failure_reason: String::new(),
        prompt_len: 3,
        response_len: 4,
        min_version: 6,
        max_version: 7,
        submit_step: 41,
        session_id: 3,
        index: 1,
        data_source: "openai/gsm8k".into(),
        greedy_baseline: true,
    }
}

fn group_status() -> GroupStatus {
    GroupStatus {
        uid: "0b6c1f9e".into(),
        partition: "train".into(),
        state: GroupState::Finished as i32,
        submit_step: 41,
        n: 2,
        trajectory_keys: vec!["0b6c1f9e_0_0".into(), "0b6c1f9e_1_0".into()],
        worker_id: "rollout-0".into(),
        failure_reason: "engine: out of memory".into(),
        sampled_step: 42,
        evicted_reason: "submission span 3".into(),
        eviction: Eviction::OffPolicy as i32,
        task: Some(prompt_task()),
        updated_unix_ms: 1_721_739_909_000,
        sample_request_id: "train-42".into(),
        epoch: 1,
        dataset_row: 5,
        evicted_step: 43,
    }
}

fn manifest() -> WeightManifest {
    WeightManifest {
        version: 7,
        tensors: vec![
            TensorInfo {
                name: "model.embed_tokens.weight".into(),
                dtype: "BF16".into(),
                shape: vec![65, 128],
                crc32: 0xdead_beef,
                offset: 0,
                nbytes: 16_640,
            },
            TensorInfo {
                name: "model.norm.weight".into(),
                dtype: "F32".into(),
                shape: vec![128],
                crc32: 7,
                offset: 16_640,
                nbytes: 512,
            },
        ],
        location: "object://JETRL_WEIGHT_BLOBS/v7".into(),
        total_bytes: 17_152,
        step: 42,
        created_unix_ms: 1_721_739_909_000,
        blob_crc32: 99,
    }
}

/// The encoding of one valid example of every message type: each decoder is fed all of them, so a message of
/// one type arriving where another is expected is covered too.
fn examples() -> Vec<Vec<u8>> {
    let messages: Vec<Vec<u8>> = vec![
        sampling().encode_to_vec(),
        chat()[1].encode_to_vec(),
        prompt_task().encode_to_vec(),
        trajectory().encode_to_vec(),
        score_request().encode_to_vec(),
        score_request().common.unwrap_or_default().encode_to_vec(),
        RewardBatch { rewards: vec![reward(), Reward { key: "0b6c1f9e_4_0".into(), ..reward() }] }.encode_to_vec(),
        group_status().encode_to_vec(),
        reward().encode_to_vec(),
        SampleRequest {
            request_id: "train-42".into(),
            step: 42,
            partition: "train".into(),
            batch_size: 32,
            wait_ms: 500,
            refilled: 3,
            incarnation: 1_721_739_909_000,
            groups_revision: 8_191,
        }
        .encode_to_vec(),
        SampledGroup {
            uid: "0b6c1f9e".into(),
            state: GroupState::Sampled as i32,
            submit_step: 41,
            trajectories: vec![reward()],
        }
        .encode_to_vec(),
        SampleResponse {
            request_id: "train-42".into(),
            groups: vec![SampledGroup { uid: "0b6c1f9e".into(), trajectories: vec![reward()], ..Default::default() }],
            metrics: HashMap::from([("training/off_policy/mean".to_string(), 0.5)]),
            not_ready: true,
            error: "no such partition".into(),
            refill: 2,
            code: ErrorCode::Invalid as i32,
        }
        .encode_to_vec(),
        ReleaseRequest { step: 42, request_ids: vec!["train-42".into(), "train-41".into()] }.encode_to_vec(),
        ReleaseResponse { released_trajectories: 256, error: "late".into(), code: ErrorCode::Unavailable as i32 }
            .encode_to_vec(),
        ReleasedGroups { step: 42, request_ids: vec!["train-42".into()], groups: vec!["train.0b6c1f9e".into()] }
            .encode_to_vec(),
        LedgerRequest { partition: "val".into(), uids: vec!["0b6c1f9e".into()], limit: 100 }.encode_to_vec(),
        LedgerResponse {
            entries: vec![LedgerEntry {
                uid: "0b6c1f9e".into(),
                partition: "train".into(),
                state: GroupState::Evicted as i32,
                submit_step: 41,
                sampled_step: 0,
                evicted_reason: String::new(),
                trajectories: 8,
                eviction: Eviction::FilterGroups as i32,
            }],
            counts: HashMap::from([("pending".to_string(), 3), ("evicted".to_string(), 1)]),
            error: String::new(),
            code: ErrorCode::None as i32,
        }
        .encode_to_vec(),
        manifest().encode_to_vec(),
        WeightAnnounce { manifest: Some(manifest()) }.encode_to_vec(),
        WeightAnnounceResponse { version: 7, error: "crc mismatch".into(), code: ErrorCode::Invalid as i32 }
            .encode_to_vec(),
        Heartbeat {
            service: "rollout-worker".into(),
            instance_id: "w0".into(),
            policy_version: 7,
            unix_ms: 1_721_739_909_000,
            state: WorkerState::Ready as i32,
            message: "loading v8".into(),
            inflight: 3,
            tokens_per_s: 1234.5,
            host: "node-1".into(),
            running_sequences: 12,
            waiting_sequences: 4,
            kv_cache_usage: 0.8,
            slots: 256,
            engine_idle_seconds: 1.5,
            pid: 4242,
            step: 7,
            total_steps: 100,
            step_seconds: 2.5,
            reward: 0.25,
        }
        .encode_to_vec(),
    ];
    messages
}

// ---------------------------------------------------------------------------------------------------------------
// Protobuf field-level mutation.

#[derive(Debug, Clone, PartialEq)]
enum Payload {
    Varint(u64),
    Fixed64([u8; 8]),
    Len(Vec<u8>),
    Fixed32([u8; 4]),
}

#[derive(Debug, Clone, PartialEq)]
struct Field {
    number: u64,
    payload: Payload,
}

fn read_varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

fn write_varint(mut value: u64, out: &mut Vec<u8>) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn take<'a>(bytes: &'a [u8], at: &mut usize, n: usize) -> Option<&'a [u8]> {
    let slice = bytes.get(*at..at.checked_add(n)?)?;
    *at += n;
    Some(slice)
}

/// The top-level fields of a message, or `None` when the bytes are not a sequence of fields (groups, which
/// proto3 does not use, count as not).
fn split_fields(bytes: &[u8]) -> Option<Vec<Field>> {
    let mut fields = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let key = read_varint(bytes, &mut at)?;
        let payload = match key & 7 {
            0 => Payload::Varint(read_varint(bytes, &mut at)?),
            1 => Payload::Fixed64(take(bytes, &mut at, 8)?.try_into().ok()?),
            2 => {
                let len = usize::try_from(read_varint(bytes, &mut at)?).ok()?;
                Payload::Len(take(bytes, &mut at, len)?.to_vec())
            }
            5 => Payload::Fixed32(take(bytes, &mut at, 4)?.try_into().ok()?),
            _ => return None,
        };
        fields.push(Field { number: key >> 3, payload });
    }
    Some(fields)
}

fn join_fields(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::new();
    for field in fields {
        let wire_type = match field.payload {
            Payload::Varint(_) => 0,
            Payload::Fixed64(_) => 1,
            Payload::Len(_) => 2,
            Payload::Fixed32(_) => 5,
        };
        write_varint(field.number << 3 | wire_type, &mut out);
        match &field.payload {
            Payload::Varint(v) => write_varint(*v, &mut out),
            Payload::Fixed64(b) => out.extend_from_slice(b),
            Payload::Len(b) => {
                write_varint(b.len() as u64, &mut out);
                out.extend_from_slice(b);
            }
            Payload::Fixed32(b) => out.extend_from_slice(b),
        }
    }
    out
}

/// One edit of a message's field list.
#[derive(Debug, Clone)]
enum FieldEdit {
    SwapOrder(Index, Index),
    Drop(Index),
    Duplicate(Index),
    Renumber(Index, u64),
    /// Field `a` keeps its number and takes field `b`'s payload (and so possibly its wire type).
    TakePayload(Index, Index),
    /// The same value under another wire type.
    ChangeWireType(Index, u8),
    Varint(Index, u64),
    /// A length-delimited field whose length prefix says `delta` more (or fewer) bytes than follow.
    LyingLength(Index, i64),
    /// The edit applied to the fields of a length-delimited field's payload (a nested message).
    Nested(Index, Box<FieldEdit>),
}

fn field_edit() -> impl Strategy<Value = FieldEdit> {
    let index = any::<Index>;
    let leaf = prop_oneof![
        (index(), index()).prop_map(|(a, b)| FieldEdit::SwapOrder(a, b)),
        index().prop_map(FieldEdit::Drop),
        index().prop_map(FieldEdit::Duplicate),
        (index(), prop_oneof![0u64..40, Just(536_870_911), any::<u64>()]).prop_map(|(a, n)| FieldEdit::Renumber(a, n)),
        (index(), index()).prop_map(|(a, b)| FieldEdit::TakePayload(a, b)),
        (index(), prop_oneof![Just(0u8), Just(1), Just(2), Just(5)]).prop_map(|(a, t)| FieldEdit::ChangeWireType(a, t)),
        (index(), prop_oneof![Just(0u64), Just(u64::MAX), Just(u64::from(u32::MAX) + 1), Just(7), any::<u64>()])
            .prop_map(|(a, v)| FieldEdit::Varint(a, v)),
        (index(), prop_oneof![-8i64..8, Just(i64::MAX), Just(1 << 32)]).prop_map(|(a, d)| FieldEdit::LyingLength(a, d)),
    ];
    leaf.prop_recursive(3, 8, 1, |inner| (any::<Index>(), inner).prop_map(|(a, e)| FieldEdit::Nested(a, Box::new(e))))
}

/// Applies `edit` to `bytes` seen as a message; bytes that are not a field list come back unchanged.
fn apply_field_edit(bytes: &[u8], edit: &FieldEdit) -> Vec<u8> {
    let Some(mut fields) = split_fields(bytes) else { return bytes.to_vec() };
    if fields.is_empty() {
        return bytes.to_vec();
    }
    let pick = |i: &Index| i.index(fields.len());
    match edit {
        FieldEdit::SwapOrder(a, b) => {
            let (a, b) = (pick(a), pick(b));
            fields.swap(a, b);
        }
        FieldEdit::Drop(a) => {
            fields.remove(pick(a));
        }
        FieldEdit::Duplicate(a) => {
            let field = fields[pick(a)].clone();
            fields.push(field);
        }
        FieldEdit::Renumber(a, number) => {
            let a = pick(a);
            fields[a].number = *number & ((1 << 61) - 1);
        }
        FieldEdit::TakePayload(a, b) => {
            let (a, b) = (pick(a), pick(b));
            fields[a].payload = fields[b].payload.clone();
        }
        FieldEdit::ChangeWireType(a, wire_type) => {
            let a = pick(a);
            let raw: Vec<u8> = match &fields[a].payload {
                Payload::Varint(v) => v.to_le_bytes().to_vec(),
                Payload::Fixed64(b) => b.to_vec(),
                Payload::Len(b) => b.clone(),
                Payload::Fixed32(b) => b.to_vec(),
            };
            let mut eight = [0u8; 8];
            for (slot, byte) in eight.iter_mut().zip(&raw) {
                *slot = *byte;
            }
            fields[a].payload = match wire_type {
                0 => Payload::Varint(u64::from_le_bytes(eight)),
                1 => Payload::Fixed64(eight),
                5 => Payload::Fixed32([eight[0], eight[1], eight[2], eight[3]]),
                _ => Payload::Len(raw),
            };
        }
        FieldEdit::Varint(a, value) => {
            let a = pick(a);
            fields[a].payload = Payload::Varint(*value);
        }
        FieldEdit::LyingLength(a, delta) => return lying_length(&fields, pick(a), *delta),
        FieldEdit::Nested(a, inner) => {
            let a = pick(a);
            if let Payload::Len(body) = &fields[a].payload {
                fields[a].payload = Payload::Len(apply_field_edit(body, inner));
            }
        }
    }
    join_fields(&fields)
}

/// `fields` encoded with field `a` written as length-delimited with a length prefix `delta` off its true length
/// (by hand: [`join_fields`] writes true lengths).
fn lying_length(fields: &[Field], a: usize, delta: i64) -> Vec<u8> {
    let mut out = join_fields(&fields[..a]);
    let body = match &fields[a].payload {
        Payload::Len(b) => b.clone(),
        _ => Vec::new(),
    };
    write_varint(fields[a].number << 3 | 2, &mut out);
    write_varint((body.len() as i64).saturating_add(delta).max(0) as u64, &mut out);
    out.extend_from_slice(&body);
    out.extend_from_slice(&join_fields(&fields[a + 1..]));
    out
}

/// Protobuf bytes for a decoder: random bytes, or an example of any type mutated at the field level and then
/// possibly at the byte level.
fn wire_input() -> impl Strategy<Value = Vec<u8>> {
    let field_mutated = (
        proptest::sample::select(examples()),
        proptest::collection::vec(field_edit(), 1..=4),
        proptest::collection::vec(mutate::byte_edit(), 0..=2),
    )
        .prop_map(|(mut message, field_edits, byte_edits)| {
            for edit in &field_edits {
                message = apply_field_edit(&message, edit);
            }
            for edit in &byte_edits {
                mutate::apply(&mut message, edit, PROTO_TOKENS);
            }
            message
        });
    prop_oneof![
        1 => mutate::random_bytes(64),
        1 => mutate::mutated(examples(), PROTO_TOKENS),
        3 => field_mutated,
    ]
}

/// Byte strings that matter to protobuf: the longest varints, a key with every wire type, overlong lengths.
const PROTO_TOKENS: &[&[u8]] = &[
    &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01],
    &[0x08],
    &[0x0b],
    &[0x0c],
    &[0x0e],
    &[0x12, 0xff, 0xff, 0xff, 0xff, 0x0f],
    &[0x0a, 0x02, 0xc3, 0x28],
    &[0x0a, 0x00],
    &[0x00],
    &[0x1d, 0x00, 0x00, 0xc0, 0x7f],
];

// ---------------------------------------------------------------------------------------------------------------
// What a service does with a decoded message, exercised on whatever decoded.

/// The wire-crate steps a service runs on a decoded message before trusting it; each must report bad content
/// as an error, never panic.
trait AfterDecode {
    fn after_decode(&self) -> Result<(), TestCaseError> {
        Ok(())
    }
}

fn check_unpacked(bytes: &[u8]) -> Result<(), TestCaseError> {
    match packed::unpack_u32(bytes) {
        Ok(ids) => prop_assert_eq!(ids.len() * 4, bytes.len()),
        Err(err) => {
            prop_assert_eq!((err.len, err.width), (bytes.len(), 4));
            let expected = format!("{} bytes is not a multiple of 4", bytes.len());
            prop_assert!(err.to_string().contains(&expected), "{}", err);
        }
    }
    prop_assert_eq!(packed::u32_len(bytes), bytes.len() / 4);
    Ok(())
}

fn check_key(key: &str) -> Result<(), TestCaseError> {
    match TrajectoryKey::parse(key) {
        Ok(parsed) => prop_assert_eq!(parsed.to_string(), key, "a parsed key formats back to itself"),
        Err(err) => prop_assert!(err.to_string().contains(&format!("{key:?}")), "the error quotes the key: {}", err),
    }
    Ok(())
}

impl AfterDecode for Trajectory {
    fn after_decode(&self) -> Result<(), TestCaseError> {
        check_unpacked(&self.prompt_ids)?;
        check_unpacked(&self.response_ids)?;
        if let Err(err) = packed::unpack_f32(&self.logprobs) {
            prop_assert_eq!(err.width, 4);
        }
        check_key(&self.key)?;
        let view = score::score_view(self, 1);
        prop_assert_eq!(score::response_len(&view), score::response_len(self));
        Ok(())
    }
}

impl AfterDecode for ScoreRequest {
    fn after_decode(&self) -> Result<(), TestCaseError> {
        let _ = score::request_id(self);
        let mut expanded = self.clone();
        score::expand_common(&mut expanded, true);
        for traj in &expanded.trajectories {
            traj.after_decode()?;
        }
        let mut rules_only = self.clone();
        score::expand_common(&mut rules_only, false);
        Ok(())
    }
}

impl AfterDecode for RewardBatch {
    fn after_decode(&self) -> Result<(), TestCaseError> {
        let keys: Vec<&str> = self.rewards.iter().map(|r| r.key.as_str()).collect();
        let _ = score::reward_batch_id(&keys);
        for key in keys {
            check_key(key)?;
        }
        Ok(())
    }
}

impl AfterDecode for GroupStatus {
    fn after_decode(&self) -> Result<(), TestCaseError> {
        let _ = GroupState::try_from(self.state).map(|s| (s.label(), s.is_terminal(), s.is_inflight()));
        for key in &self.trajectory_keys {
            check_key(key)?;
        }
        if let Some(task) = &self.task {
            task.after_decode()?;
        }
        Ok(())
    }
}

impl AfterDecode for PromptTask {
    fn after_decode(&self) -> Result<(), TestCaseError> {
        check_unpacked(&self.prompt_ids)?;
        if let Err(KeyError::BadUid(uid)) = keys::validate_uid(&self.uid) {
            prop_assert_eq!(uid, self.uid.clone());
        }
        Ok(())
    }
}

impl AfterDecode for SampleResponse {
    fn after_decode(&self) -> Result<(), TestCaseError> {
        for group in &self.groups {
            let _ = GroupState::try_from(group.state);
            for reward in &group.trajectories {
                check_key(&reward.key)?;
            }
        }
        Ok(())
    }
}

impl AfterDecode for ReleasedGroups {
    fn after_decode(&self) -> Result<(), TestCaseError> {
        for group in &self.groups {
            let _ = subjects::parse_group_key(group);
        }
        Ok(())
    }
}

impl AfterDecode for SamplingParams {}
impl AfterDecode for ChatMessage {}
impl AfterDecode for Timings {}
impl AfterDecode for GroupPrompt {}
impl AfterDecode for Reward {}
impl AfterDecode for SampleRequest {}
impl AfterDecode for SampledGroup {}
impl AfterDecode for ReleaseRequest {}
impl AfterDecode for ReleaseResponse {}
impl AfterDecode for LedgerRequest {}
impl AfterDecode for LedgerEntry {}
impl AfterDecode for LedgerResponse {}
impl AfterDecode for TensorInfo {}
impl AfterDecode for WeightManifest {}
impl AfterDecode for WeightAnnounce {}
impl AfterDecode for WeightAnnounceResponse {}
impl AfterDecode for Heartbeat {}

/// Decodes `input` as `M`: an error must say it is a protobuf decode failure; a message must survive encode
/// then decode unchanged and then the service-side steps.
fn check_decoder<M: Message + Default + PartialEq + Debug + AfterDecode>(input: &[u8]) -> Result<(), TestCaseError> {
    match M::decode(input) {
        Err(err) => {
            let text = err.to_string();
            prop_assert!(text.starts_with("failed to decode Protobuf message: ") && text.len() > 36, "{}", text);
        }
        Ok(message) => {
            let encoded = message.encode_to_vec();
            prop_assert_eq!(encoded.len(), message.encoded_len());
            let again = M::decode(encoded.as_slice());
            prop_assert!(again.is_ok(), "re-encoded message does not decode: {:?}", again);
            let again = again.unwrap_or_default();
            assert_round_trip(&message, &again)?;
            message.after_decode()?;
        }
    }
    Ok(())
}

/// False for a value holding a NaN.
#[allow(clippy::eq_op)] // comparing a value with itself is the point
fn equals_itself<T: PartialEq>(value: &T) -> bool {
    value == value
}

/// `decoded == original`; for a message holding a NaN (never equal to itself) the same encoded size.
fn assert_round_trip<M: Message + PartialEq + Debug>(original: &M, decoded: &M) -> Result<(), TestCaseError> {
    if equals_itself(original) {
        prop_assert_eq!(decoded, original);
    } else {
        prop_assert_eq!(decoded.encoded_len(), original.encoded_len());
    }
    Ok(())
}

macro_rules! fuzz_decoders {
    ($($name:ident => $message:ty),* $(,)?) => {
        proptest! {
            #![proptest_config(config())]
            $(
                #[test]
                fn $name(input in wire_input()) {
                    check_decoder::<$message>(&input)?;
                }
            )*
        }
    };
}

fuzz_decoders! {
    decode_sampling_params => SamplingParams,
    decode_chat_message => ChatMessage,
    decode_prompt_task => PromptTask,
    decode_timings => Timings,
    decode_trajectory => Trajectory,
    decode_score_request => ScoreRequest,
    decode_group_prompt => GroupPrompt,
    decode_reward_batch => RewardBatch,
    decode_group_status => GroupStatus,
    decode_reward => Reward,
    decode_sample_request => SampleRequest,
    decode_sampled_group => SampledGroup,
    decode_sample_response => SampleResponse,
    decode_release_request => ReleaseRequest,
    decode_release_response => ReleaseResponse,
    decode_released_groups => ReleasedGroups,
    decode_ledger_request => LedgerRequest,
    decode_ledger_entry => LedgerEntry,
    decode_ledger_response => LedgerResponse,
    decode_tensor_info => TensorInfo,
    decode_weight_manifest => WeightManifest,
    decode_weight_announce => WeightAnnounce,
    decode_weight_announce_response => WeightAnnounceResponse,
    decode_heartbeat => Heartbeat,
}

// ---------------------------------------------------------------------------------------------------------------
// Round trips of generated values, and the parsers of keys, subjects and packed arrays.

/// Any text, cheaply: `any::<String>()` costs ten times as much per case.
fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>(), 0..12).prop_map(String::from_iter)
}

fn any_bytes() -> impl Strategy<Value = bytes::Bytes> {
    proptest::collection::vec(any::<u8>(), 0..24).prop_map(bytes::Bytes::from)
}

fn any_chat() -> impl Strategy<Value = Vec<ChatMessage>> {
    proptest::collection::vec((text(), text()).prop_map(|(role, content)| ChatMessage { role, content }), 0..3)
}

prop_compose! {
    fn any_trajectory()(
        (key, uid, partition, response_text, data_source, ground_truth, extra_info_json, worker_id, agent_name,
            stop_reason) in (text(), text(), text(), text(), text(),
            text(), text(), text(), text(), text()),
        (session_id, index, submit_step, min_version, max_version, finish_reason, num_turns, stored_seq, prompt_len,
            response_len) in (any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<i32>(),
            any::<u32>(), any::<u64>(), any::<u32>(), any::<u32>()),
        (prompt_ids, response_ids, response_mask, logprobs) in (any_bytes(), any_bytes(), any_bytes(), any_bytes()),
        timings in proptest::option::of((any::<f64>(), any::<f64>(), any::<i64>())),
        tool_rewards in proptest::collection::vec(any::<f64>(), 0..4),
        raw_prompt in any_chat(),
    ) -> Trajectory {
        Trajectory {
            key, uid, session_id, index, partition, submit_step, prompt_ids, response_ids, response_mask, logprobs,
            min_version, max_version, finish_reason,
            timings: timings.map(|(time_to_first_token_s, generate_s, completed_unix_ms)| Timings {
                time_to_first_token_s, generate_s, completed_unix_ms,
            }),
            response_text, data_source, ground_truth, extra_info_json, worker_id, num_turns, tool_rewards, agent_name,
            stop_reason, raw_prompt, stored_seq, prompt_len, response_len, epoch: u64::from(session_id),
            dataset_row: submit_step, version_runs: vec![VersionRun { first_token: index, version: min_version }],
            greedy_baseline: session_id % 2 == 1,
            routed_experts: vec![index, session_id], routed_experts_layers: 1, routed_experts_top_k: 2,
        }
    }
}

prop_compose! {
    fn any_reward()(
        (key, uid, partition, failure_reason, data_source) in
            (text(), text(), text(), text(), text()),
        (traj_seq, score, prompt_len, response_len, min_version, max_version, submit_step, session_id, index) in
            (any::<u64>(), any::<f64>(), any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>(), any::<u64>(),
            any::<u32>(), any::<u32>()),
        extra in proptest::collection::btree_map(text(), any::<f64>(), 0..4),
        extra_text in proptest::collection::btree_map(text(), text(), 0..4),
    ) -> Reward {
        Reward {
            key, uid, partition, traj_seq, score, extra, extra_text, failure_reason, prompt_len, response_len,
            min_version, max_version, submit_step, session_id, index, data_source,
            greedy_baseline: index % 2 == 1,
        }
    }
}

/// Encoding is deterministic for messages without hash maps, so comparing bytes is exact even with NaNs.
fn encode_decode_encode<M: Message + Default>(message: &M) -> Result<(Vec<u8>, Vec<u8>), TestCaseError> {
    let first = message.encode_to_vec();
    let decoded = M::decode(first.as_slice()).map_err(|e| TestCaseError::fail(e.to_string()))?;
    Ok((first, decoded.encode_to_vec()))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn trajectory_round_trips_exactly(traj in any_trajectory()) {
        let (first, second) = encode_decode_encode(&traj)?;
        prop_assert_eq!(first, second);
        if equals_itself(&traj) {
            prop_assert_eq!(Trajectory::decode(traj.encode_to_vec().as_slice()).ok(), Some(traj));
        }
    }

    #[test]
    fn reward_batch_round_trips_exactly(rewards in proptest::collection::vec(any_reward(), 0..4)) {
        let batch = RewardBatch { rewards };
        let (first, second) = encode_decode_encode(&batch)?;
        prop_assert_eq!(first, second);
    }

    #[test]
    fn shared_prompt_fields_factor_out_and_back_exactly(
        base in any_trajectory(),
        keys in proptest::collection::vec("[a-z0-9]{1,8}_[0-9]{1,3}_[0-9]", 1..5),
        differ in proptest::collection::vec(any::<bool>(), 5),
    ) {
        let trajectories: Vec<Trajectory> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let mut t = Trajectory { key: key.clone(), ..base.clone() };
                if differ[i % differ.len()] {
                    t.ground_truth = format!("{}{i}", t.ground_truth);
                }
                t
            })
            .collect();
        let original = ScoreRequest { uid: "u".into(), partition: "train".into(), trajectories, common: None };
        let mut request = original.clone();
        score::factor_common(&mut request);
        let mut back = request.clone();
        score::expand_common(&mut back, true);
        prop_assert_eq!(back.encode_to_vec(), original.encode_to_vec());
        prop_assert!(request.encoded_len() <= original.encoded_len() + 2);
    }

    #[test]
    fn packed_arrays_round_trip_bit_exactly(ids in proptest::collection::vec(any::<u32>(), 0..64)) {
        prop_assert_eq!(packed::unpack_u32(&packed::pack_u32(&ids)).ok(), Some(ids.clone()));
        let floats: Vec<f32> = ids.iter().map(|&bits| f32::from_bits(bits)).collect();
        let back: Vec<u32> = packed::unpack_f32(&packed::pack_f32(&floats))
            .map_err(|e| TestCaseError::fail(e.to_string()))?
            .iter()
            .map(|f| f.to_bits())
            .collect();
        prop_assert_eq!(back, ids);
    }

    #[test]
    fn packed_arrays_of_any_length_unpack_or_name_the_length(input in mutate::random_bytes(64)) {
        check_unpacked(&input)?;
        match packed::unpack_f32(&input) {
            Ok(values) => prop_assert_eq!(values.len() * 4, input.len()),
            Err(err) => prop_assert_eq!((err.what, err.len, err.width), ("f32", input.len(), 4)),
        }
    }

    #[test]
    fn trajectory_keys_round_trip(uid in "[A-Za-z0-9-]{1,40}", session_id in any::<u32>(), index in any::<u32>()) {
        let key = TrajectoryKey::new(uid.clone(), session_id, index);
        prop_assert_eq!(TrajectoryKey::parse(&key.to_string()), Ok(key));
        prop_assert_eq!(keys::validate_uid(&uid), Ok(()));
    }

    #[test]
    fn trajectory_key_parser_accepts_only_canonical_keys(input in key_input()) {
        check_key(&input)?;
        if let Ok(parsed) = TrajectoryKey::parse(&input) {
            prop_assert!(keys::validate_uid(&parsed.uid).is_ok());
        }
    }

    #[test]
    fn group_subjects_and_keys_round_trip(
        partition in "[A-Za-z0-9_-]{1,12}",
        uid in "[A-Za-z0-9-]{1,40}",
    ) {
        let names = subjects::Names::new("fuzz-job").unwrap();
        let (traj, score) = (names.traj_subject(&partition, &uid), names.score_subject(&partition, &uid));
        prop_assert_eq!(names.parse_group_subject(&traj), Some((partition.as_str(), uid.as_str())));
        prop_assert_eq!(names.parse_group_subject(&score), Some((partition.as_str(), uid.as_str())));
        let key = subjects::group_key(&partition, &uid);
        prop_assert_eq!(subjects::parse_group_key(&key), Some((partition.as_str(), uid.as_str())));
    }

    #[test]
    fn group_subject_parser_takes_any_subject(input in subject_input()) {
        let names = subjects::Names::new("fuzz-job").unwrap();
        if let Some((partition, uid)) = names.parse_group_subject(&input) {
            prop_assert!(!partition.is_empty() && !uid.is_empty() && !partition.contains('.'));
            let tail = format!(".{partition}.{uid}");
            prop_assert!(input.ends_with(&tail), "{:?} parsed as {:?}", input, (partition, uid));
        }
        if let Some((partition, uid)) = subjects::parse_group_key(&input) {
            prop_assert_eq!(format!("{partition}.{uid}"), input.clone());
        }
    }
}

const KEY_TOKENS: &[&[u8]] =
    &[b"_", b"-", b"+", b"0", b"00", b"4294967295", b"4294967296", b".", b"*", b">", b" ", b"\xc3\xa9", b""];

fn key_input() -> impl Strategy<Value = String> {
    let seeds = vec![b"0b6c1f9e-3f5a_3_1".to_vec(), b"u_0_0".to_vec(), b"a-b_4294967295_7".to_vec()];
    prop_oneof![
        1 => any::<String>(),
        1 => "[a-z0-9_+-]{0,12}",
        3 => mutate::mutated(seeds, KEY_TOKENS).prop_map(|b| mutate::lossy(&b)),
    ]
}

fn subject_input() -> impl Strategy<Value = String> {
    let seeds = vec![b"jetrl.traj.train.0b6c1f9e".to_vec(), b"jetrl.score.val.u-1".to_vec(), b"train.u".to_vec()];
    prop_oneof![
        1 => any::<String>(),
        3 => mutate::mutated(seeds, KEY_TOKENS).prop_map(|b| mutate::lossy(&b)),
    ]
}

// ---------------------------------------------------------------------------------------------------------------
// Every valid example decodes (so the mutations start from real messages), and the crashes found stay fixed.

#[test]
fn every_example_decodes_as_its_own_type() {
    assert_eq!(Trajectory::decode(trajectory().encode_to_vec().as_slice()).unwrap(), trajectory());
    assert_eq!(GroupStatus::decode(group_status().encode_to_vec().as_slice()).unwrap(), group_status());
    assert_eq!(ScoreRequest::decode(score_request().encode_to_vec().as_slice()).unwrap(), score_request());
    assert!(examples().iter().all(|e| split_fields(e).is_some_and(|f| join_fields(&f) == *e)));
}

#[test]
fn a_lying_length_prefix_is_an_error_naming_the_message() {
    let fields = split_fields(&trajectory().encode_to_vec()).unwrap();
    // the last length-delimited field (`routed_experts`, field 32, packed; two varints, fields 33 and 34, follow)
    // rewritten with a length running past the end
    let lying = lying_length(&fields, fields.len() - 3, 50);
    let err = Trajectory::decode(lying.as_slice()).unwrap_err().to_string();
    assert!(err.starts_with("failed to decode Protobuf message: Trajectory.routed_experts"), "{err}");
}
