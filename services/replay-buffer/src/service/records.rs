//! The GROUPS input: a record applied to the state as the watch delivers it (or again, by a re-read), and what a
//! finished re-read found. How far the watch has read the bucket is [`GroupsCursor`](super::groups_cursor).

use jetrl_bus::consume;
use jetrl_bus::groups::decode_entry;
use jetrl_wire::subjects;
use jetrl_wire::v1::GroupState;

use super::{Buffer, SERVICE};
use crate::reread::Pass;

impl Buffer {
    /// A GROUPS entry from the watch: the record applied (or the group forgotten, for a delete). Returns whether it
    /// could let a waiting request be answered.
    pub(super) fn on_group_entry(&mut self, entry: &async_nats::jetstream::kv::Entry) -> bool {
        match decode_entry(entry) {
            Some(Ok(status)) => {
                if status.state().is_terminal() && jetrl_telemetry::crash::missed_input("buffer.terminal_record") {
                    return false;
                }
                // terminal (may complete a batch) or evicted (leaves the in-flight set, which `wait` and sync
                // DAPO's refill room look at)
                let may_answer = status.state().is_terminal() || status.state() == GroupState::Evicted;
                self.state.apply_group_at(status, entry.revision);
                may_answer
            }
            Some(Err(err)) => {
                let reason = format!("malformed group record: {err}");
                let bucket = self.bus.names().groups_bucket();
                consume::dead_letter(SERVICE, bucket, &entry.key, &reason, &entry.value);
                tracing::error!(key = %entry.key, error = %err, "malformed group record ignored");
                false
            }
            None => {
                if let Some((partition, uid)) = subjects::parse_group_key(&entry.key) {
                    self.state.remove_group(partition, uid);
                }
                true
            }
        }
    }

    /// A GROUPS entry a re-read reads again: applied only when it is news (a record the watch had not delivered),
    /// then counted and logged. Deletes and malformed records were handled when first read.
    pub(super) fn on_replayed_record(&mut self, entry: &async_nats::jetstream::kv::Entry) -> bool {
        let Some(Ok(status)) = decode_entry(entry) else { return false };
        if !self.state.is_news(&status.partition, &status.uid, entry.revision) {
            return false;
        }
        tracing::warn!(
            key = %entry.key,
            revision = entry.revision,
            state = status.state().label(),
            "re-read found a group record the watch had not delivered"
        );
        self.reread.found_record();
        self.on_group_entry(entry)
    }

    /// Says what a finished re-read found: a warning and a count when the inputs had missed something, otherwise
    /// what the waiting request waits on (the stores hold nothing more).
    pub(super) fn report_reread(&self, pass: &Pass) {
        let view = self.state.waiting_view(self.waiting.partition());
        let waited_s = self.waiting.waiting_since().map_or(0, |t| t.elapsed().as_secs());
        if pass.found() > 0 {
            metrics::counter!("jetrl_buffer_reread_found_total", "kind" => "records").increment(pass.found_records);
            metrics::counter!("jetrl_buffer_reread_found_total", "kind" => "rewards").increment(pass.found_rewards);
            tracing::warn!(
                found_records = pass.found_records,
                found_rewards = pass.found_rewards,
                complete = view.complete,
                generating = view.generating,
                scoring = view.scoring,
                "reading the inputs again found updates the buffer had missed; applied"
            );
        } else {
            tracing::info!(
                waited_s,
                complete = view.complete,
                generating = view.generating,
                scoring = view.scoring,
                orphan_rewards = view.orphan_rewards,
                "a sample request is still waiting; the buffer holds every group record and reward the stores hold"
            );
        }
    }
}
