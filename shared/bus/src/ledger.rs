//! The exactly-once ledger: what became of every dataset row a job drew, from the group records in GROUPS.
//!
//! The unit is the row, `(epoch, dataset_row)`: a row may have had several groups (a group re-created after a
//! resume, a trained step rolled back). Groups retired by the trainer's own bookkeeping — superseded by a resume or
//! rolled back ([`Eviction::is_bookkeeping`](jetrl_wire::v1::Eviction::is_bookkeeping)) — do not decide a row's fate when another group of the row exists; of the rest a
//! row must have exactly one, whose state is the row's fate: trained (sampled at a step), evicted or failed (with
//! the reason and the step), or in flight. Two deciding groups for one row is a duplicate: the ledger reports it
//! instead of hiding it.

use std::collections::BTreeMap;

use jetrl_wire::v1::{GroupState, GroupStatus};

/// What became of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    Trained,
    Evicted,
    Failed,
    InFlight,
}

/// One row of the ledger (`jetrl status --ledger --json`, `<run.dir>/ledger.jsonl`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LedgerRow {
    pub epoch: u64,
    pub row: u64,
    pub uid: String,
    pub fate: Fate,
    /// the step it was trained or evicted at (0 while in flight)
    pub step: u64,
    /// why it was evicted or failed, with its detail (`off_policy: submission span 3`; empty otherwise)
    pub reason: String,
}

/// The ledger of one partition's records, ordered by (epoch, row): one entry per row, except that a row decided
/// by more than one group (trained twice, or trained and evicted) appears once per deciding group, so a reader
/// of `ledger.jsonl` sees it; those rows are also returned apart.
pub fn ledger(records: &[GroupStatus]) -> (Vec<LedgerRow>, Vec<Vec<LedgerRow>>) {
    let mut by_row: BTreeMap<(u64, u64), Vec<&GroupStatus>> = BTreeMap::new();
    for g in records {
        by_row.entry((g.epoch, g.dataset_row)).or_default().push(g);
    }
    let mut rows = Vec::with_capacity(by_row.len());
    let mut duplicates = Vec::new();
    for ((epoch, row), groups) in by_row {
        let deciding: Vec<&GroupStatus> = groups.iter().copied().filter(|g| !is_bookkeeping(g)).collect();
        let chosen: Vec<&GroupStatus> = if deciding.is_empty() {
            // only superseded groups: the row is decided by the newest of them (in flight until re-created)
            groups.iter().copied().max_by_key(|g| g.updated_unix_ms).into_iter().collect()
        } else {
            deciding
        };
        let mut entries: Vec<LedgerRow> = chosen.iter().map(|g| row_of(epoch, row, g)).collect();
        entries.sort_by_key(|e| (e.fate != Fate::Trained, e.step));
        if entries.len() > 1 {
            duplicates.push(entries.clone());
        }
        rows.extend(entries);
    }
    (rows, duplicates)
}

/// A group retired by the trainer's bookkeeping (superseded by a resume, rolled back).
pub fn is_bookkeeping(g: &GroupStatus) -> bool {
    g.state() == GroupState::Evicted && g.eviction().is_bookkeeping()
}

fn row_of(epoch: u64, row: u64, g: &GroupStatus) -> LedgerRow {
    let (fate, step, reason) = match g.state() {
        GroupState::Sampled => (Fate::Trained, g.sampled_step, String::new()),
        GroupState::Evicted => {
            let fate = if g.eviction().is_failure() { Fate::Failed } else { Fate::Evicted };
            (fate, g.evicted_step, g.eviction().describe(&g.evicted_reason))
        }
        _ => (Fate::InFlight, 0, String::new()),
    };
    LedgerRow { epoch, row, uid: g.uid.clone(), fate, step, reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jetrl_wire::v1::Eviction;

    fn group(uid: &str, row: u64, state: GroupState, step: u64, eviction: Eviction, updated: i64) -> GroupStatus {
        let mut g = GroupStatus {
            uid: uid.into(),
            partition: "train".into(),
            dataset_row: row,
            sampled_step: if state == GroupState::Sampled { step } else { 0 },
            evicted_step: if state == GroupState::Evicted { step } else { 0 },
            updated_unix_ms: updated,
            ..Default::default()
        };
        g.set_state(state);
        g.set_eviction(eviction);
        g
    }

    #[test]
    fn a_row_superseded_by_a_resume_takes_the_fate_of_its_replacement() {
        let records = vec![
            group("a", 0, GroupState::Sampled, 1, Eviction::Unspecified, 1),
            group("b", 1, GroupState::Evicted, 2, Eviction::SupersededByResume, 2),
            group("c", 1, GroupState::Sampled, 3, Eviction::Unspecified, 3),
            group("d", 2, GroupState::Evicted, 4, Eviction::RolledBack, 4),
            group("e", 2, GroupState::Running, 0, Eviction::Unspecified, 5),
            {
                let mut f = group("f", 3, GroupState::Evicted, 2, Eviction::OffPolicy, 6);
                f.evicted_reason = "submission span 3".into();
                f
            },
            group("g", 4, GroupState::Evicted, 2, Eviction::RolloutFailure, 7),
            group("h", 5, GroupState::Evicted, 3, Eviction::Rejected, 8),
        ];
        let (rows, duplicates) = ledger(&records);
        assert!(duplicates.is_empty(), "{duplicates:?}");
        let fates: Vec<(u64, &str, Fate, u64)> = rows.iter().map(|r| (r.row, r.uid.as_str(), r.fate, r.step)).collect();
        assert_eq!(
            fates,
            vec![
                (0, "a", Fate::Trained, 1),
                (1, "c", Fate::Trained, 3),
                (2, "e", Fate::InFlight, 0),
                (3, "f", Fate::Evicted, 2),
                (4, "g", Fate::Failed, 2),
                (5, "h", Fate::Failed, 3),
            ]
        );
        assert_eq!(rows[3].reason, "off_policy: submission span 3");
        assert_eq!(rows[4].reason, "rollout_failure");
    }

    #[test]
    fn a_row_trained_twice_is_reported_as_a_duplicate() {
        let records = vec![
            group("a", 7, GroupState::Sampled, 3, Eviction::Unspecified, 1),
            group("b", 7, GroupState::Sampled, 5, Eviction::Unspecified, 2),
        ];
        let (rows, duplicates) = ledger(&records);
        assert_eq!(rows.len(), 2, "the row appears once per group that decided it");
        assert_eq!(duplicates.len(), 1);
        assert_eq!(duplicates[0].len(), 2);
    }
}
