//! The actor's thread: libtorch stays off the async reactor, so rank 0's [`Actor`] lives on a thread of its own,
//! fed closures over a bounded channel ([`ActorHandle::call`]). The thread also owns rank 0's command channel to
//! the other ranks ([`Leader`]): it is built here once, sends the `Init` that makes the followers build their
//! actors, and is handed to every closure with the actor ([`LeadingActor`]).

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use jetrl_config::JobConfig;
use tokio::sync::oneshot;

use super::Actor;
use crate::checkpoint::ActorState;
use crate::command::{Command, Leader};
use crate::dist::Comm;
use crate::error::ActorError;

/// Rank 0's actor and its command channel to the other ranks: what the closures of [`ActorHandle::call`] get.
pub struct LeadingActor {
    pub actor: Actor,
    /// rank 0's commands to the other ranks (nothing is sent with one rank)
    leader: Leader,
}

impl LeadingActor {
    /// Tells every other rank to do what this rank is about to do (nothing with one rank).
    pub fn lead(&mut self, command: &Command) -> Result<(), ActorError> {
        self.leader.send(command)
    }
}

type Job = Box<dyn FnOnce(&mut LeadingActor) + Send>;

/// Handle to the actor thread: closures run on the thread, in order, with exclusive access. The thread blocks on
/// its bounded channel; callers wait for room without blocking the reactor.
#[derive(Clone)]
pub struct ActorHandle {
    tx: tokio::sync::mpsc::Sender<Job>,
    /// the message of the panic that ended the thread, if one did
    panicked: Arc<Mutex<Option<String>>>,
}

impl ActorHandle {
    /// Builds the actor on a new thread; returns once the models are loaded (or failed to load).
    /// With several ranks this is rank 0: it tells the others to build theirs (the same horizon, checkpoint and pad
    /// id) before it builds its own, as loading the optimizer state is a collective.
    pub fn spawn(
        cfg: JobConfig,
        total_steps: u64,
        resume: Option<(PathBuf, ActorState)>,
        comm: Comm,
        pad_id: u32,
    ) -> Result<Self, ActorError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Job>(16);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("trainer-actor".into())
            .spawn(move || {
                let mut leader = Leader::new(comm.clone());
                let init = Command::Init { horizon: total_steps, resume: resume.clone(), pad_id };
                if let Err(e) = leader.send(&init) {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
                let resume_ref = resume.as_ref().map(|(dir, state)| (dir.as_path(), state));
                let built = Actor::new(&cfg, total_steps, resume_ref, comm).map(|mut actor| {
                    actor.set_pad_id(pad_id);
                    LeadingActor { actor, leader }
                });
                let mut rank0 = match built {
                    Ok(rank0) => {
                        let _ = ready_tx.send(Ok(()));
                        rank0
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Some(job) = rx.blocking_recv() {
                    job(&mut rank0);
                }
            })
            .map_err(ActorError::Spawn)?;
        ready_rx.recv().map_err(|_| ActorError::Stopped)??;
        Ok(Self { tx, panicked: Arc::default() })
    }

    /// Runs `f` on the actor thread and returns its result.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut LeadingActor) -> R + Send + 'static,
    ) -> Result<R, ActorError> {
        let (reply, rx) = oneshot::channel();
        let panicked = self.panicked.clone();
        let job: Job = Box::new(move |rank0| match std::panic::catch_unwind(AssertUnwindSafe(|| f(rank0))) {
            Ok(result) => {
                let _ = reply.send(result);
            }
            // the caller gets the message, then the thread unwinds as it would have (its state is not to be trusted)
            Err(payload) => {
                let message = panic_message(payload.as_ref());
                *panicked.lock().unwrap_or_else(PoisonError::into_inner) = Some(message);
                drop(reply);
                std::panic::resume_unwind(payload);
            }
        });
        let stopped = || match self.panicked.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            Some(message) => ActorError::Panicked(message),
            None => ActorError::Stopped,
        };
        self.tx.send(job).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }
}

/// The text a panic was raised with (`panic!("...")` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(text), _) => (*text).to_string(),
        (_, Some(text)) => text.clone(),
        _ => "a panic without a message".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::panic_message;

    #[test]
    fn a_panic_message_is_read_from_either_payload_type() {
        let text = std::panic::catch_unwind(|| panic!("static text")).unwrap_err();
        assert_eq!(panic_message(text.as_ref()), "static text");
        let formatted = std::panic::catch_unwind(|| panic!("step {}", 3)).unwrap_err();
        assert_eq!(panic_message(formatted.as_ref()), "step 3");
        let other = std::panic::catch_unwind(|| std::panic::panic_any(7u32)).unwrap_err();
        assert_eq!(panic_message(other.as_ref()), "a panic without a message");
    }
}
