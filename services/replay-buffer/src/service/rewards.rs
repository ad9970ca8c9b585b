//! The REWARDS input: reward batches indexed and release markers applied as the stream's follower delivers them,
//! and the floor purge of what no group still needs.

use std::time::Instant;

use jetrl_bus::consume;
use jetrl_wire::v1::{ReleasedGroups, RewardBatch};
use jetrl_wire::Message;

use super::release::purge_payloads;
use super::{Buffer, MARKERS_KEPT, SERVICE};

impl Buffer {
    /// A message of the REWARDS stream: a reward batch (indexed), or a release marker. Returns whether it could
    /// let a waiting request be answered.
    ///
    /// A `replay` (a message a re-read reads again) only adds rewards the buffer lacks, and counts those of live
    /// groups; its release markers and malformed messages were handled when first read.
    pub(super) fn on_rewards_message(&mut self, msg: &async_nats::jetstream::Message, seq: u64, replay: bool) -> bool {
        let marker = msg.subject.as_str() == self.bus.names().released_subject();
        if replay && marker {
            return false;
        }
        if marker {
            match ReleasedGroups::decode(msg.payload.as_ref()) {
                Ok(marker) => {
                    // Live, this buffer released these groups itself and this finds none of them. After a
                    // restart it retires them, and purges their payloads again in case that was cut short.
                    let released = self.state.apply_release_marker(&marker.groups);
                    if !released.is_empty() {
                        tokio::spawn(purge_payloads(self.traj.clone(), self.bus.names().clone(), released));
                    }
                }
                Err(err) => {
                    let reason = format!("malformed release marker: {err}");
                    consume::dead_letter(
                        SERVICE,
                        self.bus.names().rewards_stream(),
                        &msg.subject,
                        &reason,
                        &msg.payload,
                    );
                    tracing::error!(subject = %msg.subject, error = %err, "malformed release marker ignored");
                }
            }
            return false;
        }
        let mut may_answer = false;
        match RewardBatch::decode(msg.payload.as_ref()) {
            Ok(batch) => {
                let mut found = 0;
                for reward in batch.rewards {
                    // a reward can only complete a group that is already terminal
                    let group = self.state.group(&reward.partition, &reward.uid);
                    let (live, terminal) = (group.is_some(), group.is_some_and(|g| g.state().is_terminal()));
                    let key = replay.then(|| (reward.uid.clone(), reward.session_id, reward.index));
                    if self.state.apply_reward(reward, seq) {
                        may_answer |= terminal;
                        if let Some((uid, session, index)) = key.filter(|_| live) {
                            tracing::warn!(%uid, session, index, seq, "re-read found a reward the rewards consumer had not delivered");
                            found += 1;
                        }
                    }
                }
                self.reread.found_rewards(found);
            }
            Err(_) if replay => {}
            Err(err) => {
                let reason = format!("malformed reward batch: {err}");
                consume::dead_letter(SERVICE, self.bus.names().rewards_stream(), &msg.subject, &reason, &msg.payload);
                tracing::error!(subject = %msg.subject, error = %err, "malformed reward batch ignored");
            }
        }
        may_answer
    }

    /// Once a second, after the restart's replay: forgets orphan rewards (`RewardsInput::orphan_horizon`),
    /// then purges every reward batch below the oldest reward still indexed (in the background, one purge at a
    /// time), and release markers beyond the newest [`MARKERS_KEPT`]. One purge request per second, whatever the
    /// rate.
    pub(super) fn purge_rewards(&mut self) {
        if !self.replay_retired {
            return;
        }
        let horizon = self.rewards_input.orphan_horizon(
            Instant::now(),
            self.state.rewards_read(),
            self.groups_cursor.seen_through(),
        );
        let dropped = self.state.drop_orphans_below(horizon);
        if dropped > 0 {
            tracing::warn!(dropped, "rewards whose group record never came are forgotten");
            metrics::counter!("jetrl_buffer_orphan_rewards_dropped_total").increment(dropped as u64);
        }
        let floor = self.state.reward_floor().unwrap_or(self.state.rewards_read() + 1);
        if !self.rewards_input.purge_due(floor) {
            return;
        }
        let rewards = self.rewards.clone();
        let (batches, markers) =
            (self.bus.names().reward_batches_filter(), self.bus.names().released_subject().to_string());
        self.rewards_input.start_purge(floor, async move {
            let purged = match rewards.purge().filter(batches).sequence(floor).await {
                Ok(purged) => {
                    metrics::counter!("jetrl_buffer_purged_reward_messages_total").increment(purged.purged);
                    true
                }
                Err(err) => {
                    tracing::warn!(floor, error = %err, "rewards below the floor not purged; retrying");
                    false
                }
            };
            if let Err(err) = rewards.purge().filter(markers).keep(MARKERS_KEPT).await {
                tracing::warn!(error = %err, "old release markers not purged");
            }
            purged
        });
    }
}
