//! The subjects the server refused one connection ([`Refusals`]), read from its permissions-violation reports, so
//! that a refused publish or request fails at once instead of timing out.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Whether a refused publish was a reply: an inbox subject (`_INBOX.…`, or `_INBOX_<user>.…` under gen.sh's
/// per-identity inbox prefixes).
pub(crate) fn refused_reply(operation: &str, subject: &str) -> bool {
    operation == "publish" && subject.starts_with("_INBOX")
}

/// `Permissions Violation for Publish to "subject"` → ("publish", "subject"); subscriptions likewise.
pub(crate) fn parse_violation(text: &str) -> Option<(&'static str, &str)> {
    let rest = text.strip_prefix("Permissions Violation for ")?;
    let operation = if rest.starts_with("Publish") {
        "publish"
    } else if rest.starts_with("Subscription") {
        "subscribe"
    } else {
        "other"
    };
    let subject = rest.split('"').nth(1)?;
    Some((operation, subject))
}

/// The last permissions violations the server reported on one connection, and a way to wait for one.
#[derive(Clone, Default)]
pub(crate) struct Refusals {
    inner: Arc<RefusalsInner>,
}

#[derive(Default)]
struct RefusalsInner {
    recent: Mutex<VecDeque<Refusal>>,
    changed: tokio::sync::Notify,
}

struct Refusal {
    at: Instant,
    operation: &'static str,
    subject: String,
}

/// Refusals kept: a waiter only looks for refusals since it sent, so a short history is enough.
const REFUSALS_KEPT: usize = 64;

impl Refusals {
    pub(crate) fn record(&self, operation: &'static str, subject: &str) {
        if let Ok(mut recent) = self.inner.recent.lock() {
            if recent.len() == REFUSALS_KEPT {
                recent.pop_front();
            }
            recent.push_back(Refusal { at: Instant::now(), operation, subject: subject.to_string() });
        }
        self.inner.changed.notify_waiters();
    }

    fn find(&self, matches: impl Fn(&str) -> bool, since: Instant) -> Option<String> {
        let recent = self.inner.recent.lock().ok()?;
        recent.iter().rev().take_while(|r| r.at >= since).find(|r| matches(&r.subject)).map(|r| {
            format!("permissions violation: the server refuses {} on {:?} for this identity", r.operation, r.subject)
        })
    }

    /// Resolves (with a description) once the server reports a permissions violation for `subject` after
    /// `since`; pending forever otherwise.
    pub(crate) async fn refused(&self, subject: &str, since: Instant) -> String {
        self.refused_where(|s| s == subject, since).await
    }

    /// Like [`Refusals::refused`], for any subject starting with `prefix` (a JetStream API call made of several
    /// requests).
    pub(crate) async fn refused_under(&self, prefix: &str, since: Instant) -> String {
        self.refused_where(|s| s.starts_with(prefix), since).await
    }

    async fn refused_where(&self, matches: impl Fn(&str) -> bool, since: Instant) -> String {
        loop {
            // registered before the check, so a refusal recorded between the two still wakes us
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(description) = self.find(&matches, since) {
                return description;
            }
            changed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permission_violations_are_parsed_from_the_server_error() {
        assert_eq!(
            parse_violation("Permissions Violation for Publish to \"jetrl.prompts.train\""),
            Some(("publish", "jetrl.prompts.train"))
        );
        assert_eq!(
            parse_violation("Permissions Violation for Subscription to \"_INBOX.x.*\""),
            Some(("subscribe", "_INBOX.x.*"))
        );
        assert_eq!(parse_violation("Maximum Payload Violation"), None);
    }

    #[test]
    fn a_refused_publish_to_an_inbox_is_a_refused_reply() {
        assert!(refused_reply("publish", "_INBOX_jetrl-trainer.abc.def"));
        assert!(refused_reply("publish", "_INBOX.abc.def"));
        assert!(!refused_reply("publish", "jetrl.job.prompts.train"));
        assert!(!refused_reply("subscribe", "_INBOX_jetrl-trainer.>"));
    }

    #[tokio::test]
    async fn a_waiter_sees_a_refusal_of_its_subject_recorded_after_it_sent_and_no_other() {
        let refusals = Refusals::default();
        let before = Instant::now();
        refusals.record("publish", "jetrl.old");
        let since = Instant::now();
        let waiter = {
            let refusals = refusals.clone();
            tokio::spawn(async move { refusals.refused("jetrl.a", since).await })
        };
        refusals.record("publish", "jetrl.b");
        refusals.record("subscribe", "jetrl.a");
        let description = tokio::time::timeout(std::time::Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert!(description.contains("subscribe") && description.contains("\"jetrl.a\""), "{description}");
        assert!(refusals.find(|s| s == "jetrl.old", since).is_none(), "a refusal before `since` is not this sender's");
        assert!(refusals.find(|s| s == "jetrl.old", before).is_some());
        let under = refusals.refused_under("jetrl.", since).await;
        assert!(under.contains("jetrl."), "{under}");
    }
}
