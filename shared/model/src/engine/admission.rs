//! Admission: how waiting requests enter free slots between decode steps. The first admitted sample of a request
//! is prefilled (the contexts admitted in one step packed into as few forward passes as the prefill chunk
//! allows), the others fork its slot; a resumed sequence's random stream continues where it stopped.

use std::collections::VecDeque;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};

use super::cache::SlotCache;
use super::{forward, Engine, Row, Shared, Waiting};
use crate::error::{ModelError, Result};

/// A context to prefill: its slot, its request, and where its `(slot, first-token logits)` go.
type PrefillJob<'a> = (usize, Arc<Shared>, &'a mut Option<(usize, Tensor)>);

impl Engine {
    pub(super) fn new_row(shared: &Arc<Shared>, index: usize, cached: i64) -> Row {
        let mut rng = ChaCha8Rng::seed_from_u64(mix(shared.seed, index as u64));
        let (tokens, logprobs, min_version, max_version, version_runs) = match &shared.prefix {
            Some(p) => {
                // One draw per token already generated: a resumed stream continues where it stopped.
                for _ in 0..p.tokens.len() {
                    let _: f64 = rng.gen();
                }
                let known = (!p.tokens.is_empty()).then_some(p.min_version);
                (p.tokens.clone(), p.logprobs.clone(), known, p.max_version, p.version_runs.clone())
            }
            None => (Vec::new(), Vec::new(), None, 0, Vec::new()),
        };
        Row {
            shared: shared.clone(),
            index,
            rng,
            tokens,
            logprobs,
            cached,
            fresh: None,
            min_version,
            max_version,
            version_runs,
            first_token: None,
            serial: 0,
            sampled: 0,
            closing: false,
            routes: Vec::new(),
        }
        .with_sampled()
    }

    /// Fills free slots from the queue, lowest first: each request's first admitted sample is prefilled (the
    /// contexts of all requests admitted in this step packed into as few forward passes as the prefill chunk
    /// allows), the others fork its slot.
    pub(super) fn admit(&mut self) -> Result<()> {
        struct Admission {
            waiting: Waiting,
            targets: Vec<usize>,
            /// the slot whose keys and values the samples copy, and the first token's logits
            source: Option<(usize, Tensor)>,
        }
        let mut free: VecDeque<usize> = (0..self.slots).filter(|&s| self.rows[s].is_none()).collect();
        let mut admissions: Vec<Admission> = Vec::new();
        while !free.is_empty() {
            let Some(mut waiting) = self.waiting.pop_front() else { break };
            let take = free.len().min(waiting.n - waiting.next);
            let targets: Vec<usize> = free.drain(..take).collect();
            // A running sibling already holds the context's keys and values.
            let sibling = self.rows.iter().position(|r| r.as_ref().is_some_and(|r| r.shared.id == waiting.shared.id));
            let source = match (sibling, waiting.first_logits.take()) {
                (Some(src), Some(logits)) => Some((src, logits)),
                _ => None,
            };
            let partial = waiting.next + take < waiting.n;
            admissions.push(Admission { waiting, targets, source });
            if partial {
                break;
            }
        }
        self.prefill_admissions(admissions.iter_mut().filter(|a| a.source.is_none()).map(|a| {
            let slot = a.targets[0];
            (slot, a.waiting.shared.clone(), &mut a.source)
        }))?;
        for Admission { mut waiting, targets, source } in admissions {
            let (source, logits) =
                source.ok_or_else(|| ModelError::Generation("an admitted request was not prefilled".into()))?;
            let context_len = waiting.shared.context.len() as i64;
            let cache = self.cache.as_mut().ok_or_else(|| ModelError::Generation("the KV cache is freed".into()))?;
            for (i, &slot) in targets.iter().enumerate() {
                cache.copy_row(source as i64, slot as i64, context_len)?;
                let mut row = Self::new_row(&waiting.shared, waiting.first_sample + waiting.next + i, context_len);
                row.fresh = Some(logits.shallow_clone());
                row.serial = self.next_serial;
                self.next_serial += 1;
                self.rows[slot] = Some(row);
            }
            if waiting.shared.row.repetition_penalty != 1.0 || self.presence.is_some() {
                self.mark_presence(&targets)?;
            }
            waiting.next += targets.len();
            if waiting.next < waiting.n {
                waiting.first_logits = Some(logits);
                self.waiting.push_front(waiting);
            }
        }
        Ok(())
    }

    /// Prefills each `(slot, request)` and stores `(slot, logits)` in its place: contexts packed together up to
    /// `prefill_chunk` tokens a pass; a longer context alone, chunk by chunk.
    fn prefill_admissions<'a>(&mut self, jobs: impl Iterator<Item = PrefillJob<'a>>) -> Result<()> {
        let chunk = self.config.prefill_chunk.max(1);
        let cache = self.cache.as_mut().ok_or_else(|| ModelError::Generation("the KV cache is freed".into()))?;
        let mut group: Vec<PrefillJob<'a>> = Vec::new();
        let mut group_tokens = 0;
        let flush = |group: &mut Vec<PrefillJob<'a>>, cache: &mut SlotCache| -> Result<(u64, u64)> {
            if group.is_empty() {
                return Ok((0, 0));
            }
            let slots: Vec<i64> = group.iter().map(|(slot, _, _)| *slot as i64).collect();
            let contexts: Vec<&[u32]> = group.iter().map(|(_, shared, _)| shared.context.as_slice()).collect();
            let logits = forward::prefill_packed(&self.model, cache, &slots, &contexts)?;
            let tokens: u64 = contexts.iter().map(|c| c.len() as u64).sum();
            let routes = super::take_routes(&self.model, self.config.return_routed_experts)?;
            let per_token = routes.as_ref().map_or(0, |r| r.len() / (tokens as usize).max(1));
            let mut start = 0;
            for ((slot, shared, place), logits) in group.drain(..).zip(logits) {
                if let Some(routes) = &routes {
                    let end = start + shared.context.len() * per_token;
                    let _ = shared.context_routes.set(routes[start..end].to_vec());
                    start = end;
                }
                *place = Some((slot, logits));
            }
            Ok((tokens, 1))
        };
        for (slot, shared, place) in jobs {
            let len = shared.context.len();
            if len > chunk {
                let logits = forward::prefill(&self.model, cache, slot as i64, &shared.context, chunk)?;
                if let Some(routes) = super::take_routes(&self.model, self.config.return_routed_experts)? {
                    let _ = shared.context_routes.set(routes);
                }
                self.stats.prefill_tokens += len as u64;
                self.stats.prefill_passes += len.div_ceil(chunk) as u64;
                *place = Some((slot, logits));
                continue;
            }
            if group_tokens + len > chunk {
                let (tokens, passes) = flush(&mut group, cache)?;
                self.stats.prefill_tokens += tokens;
                self.stats.prefill_passes += passes;
                group_tokens = 0;
            }
            group_tokens += len;
            group.push((slot, shared, place));
        }
        let (tokens, passes) = flush(&mut group, cache)?;
        self.stats.prefill_tokens += tokens;
        self.stats.prefill_passes += passes;
        Ok(())
    }

    /// Records the context tokens of the sequences in `slots` for the repetition penalty.
    fn mark_presence(&mut self, slots: &[usize]) -> Result<()> {
        let vocab = self.model.config().vocab_size;
        let presence = match &mut self.presence {
            Some(p) => p,
            None => {
                self.presence.insert(Tensor::f_zeros([self.slots as i64, vocab], (Kind::Bool, self.model.device()))?)
            }
        };
        for &s in slots {
            let Some(row) = &self.rows[s] else { continue };
            let context: Vec<i64> = row.shared.context.iter().map(|&t| i64::from(t)).collect();
            let index = Tensor::from_slice(&context).f_unsqueeze(0)?.f_to_device(presence.device())?;
            let mut slot = presence.f_narrow(0, s as i64, 1)?;
            let _ = slot.f_zero_()?;
            let _ = slot.f_scatter_value_(1, &index, 1)?;
        }
        Ok(())
    }
}

/// splitmix64 of `a` combined with `b`: independent streams for (seed, sample) pairs.
pub(super) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
