//! What rank 0 tells the other ranks, and how: the [`Command`]s of a step and rank 0's side of the channel that
//! carries them ([`Leader`], built once, by the actor thread of rank 0). A leaf: the actor, the ranks and the
//! learner import it; it imports none of them. The followers' side is `ranks::follow`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::batch::RowInfo;
use crate::checkpoint::ActorState;
use crate::dist::Comm;
use crate::error::ActorError;

/// π_old as a command carries it (the actor's `OldPolicy`; `ranks` converts).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum PiOld {
    Current,
    CycleStart,
}

/// What rank 0 asks of every rank, in order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Command {
    /// build the actor: the LR horizon, and the checkpoint to resume from (the same for every rank)
    Init { horizon: u64, resume: Option<(PathBuf, ActorState)>, pad_id: u32 },
    /// one training step: every row in the order all ranks use, and per follower the rows it holds with the
    /// reward records (protobuf) of their payloads, which it fetches itself
    Train { step: u64, pi_old: PiOld, rows: Vec<RowInfo>, shares: BTreeMap<usize, Vec<(usize, Vec<u8>)>> },
    /// copy the current weights as π_old of the step's local updates (separate_async)
    Snapshot,
    /// write this rank's part of the checkpoint being staged in `dir`
    SaveCheckpoint { dir: PathBuf },
    /// training is over: leave the group
    Stop,
}

/// Rank 0's side of the command channel. Commands are deleted from the store once every follower has read
/// them: rank 0 sends a command, then runs it itself; a command with a collective (`Train`, `SaveCheckpoint`)
/// completes on rank 0 only when every rank has joined it, so when rank 0 sends the next one, every follower has
/// read everything up to the last such command.
#[derive(Debug)]
pub struct Leader {
    comm: Comm,
    sent: u64,
    /// commands up to this number are deleted from the store
    deleted: u64,
    /// the number of the last command sent, when it has a collective (all ranks have read it once rank 0 ran it)
    synced: Option<u64>,
}

impl Leader {
    pub fn new(comm: Comm) -> Self {
        Self { comm, sent: 0, deleted: 0, synced: None }
    }

    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// Writes the next command for every follower (nothing with one rank).
    pub fn send(&mut self, command: &Command) -> Result<(), ActorError> {
        if self.comm.world() == 1 {
            return Ok(());
        }
        if let Some(read) = self.synced.take() {
            for n in self.deleted + 1..=read {
                self.comm.store_delete(&format!("cmd/{n}"))?;
            }
            self.deleted = read;
        }
        self.sent += 1;
        let bytes =
            serde_json::to_vec(command).map_err(|source| ActorError::RankMessage { what: "command".into(), source })?;
        self.comm.store_set(&format!("cmd/{}", self.sent), &bytes)?;
        if matches!(command, Command::Train { .. } | Command::SaveCheckpoint { .. }) {
            self.synced = Some(self.sent);
        }
        Ok(())
    }
}
