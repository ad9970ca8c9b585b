//! Backoff delays for every loop that asks again: the bus's retries and reconnects, the reward service's
//! reward-model retries and user-function restarts.

use std::time::Duration;

/// Waits that double from `first` to `max`, for a loop that asks again until something changes (a broker comes
/// back, a weight version appears) rather than until a deadline; `jetrl_bus::retry::Backoff` adds the deadline
/// and the permanent-error rule for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delays {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Delays {
    pub fn new(first: Duration, max: Duration) -> Self {
        Self { first, max: max.max(first), next: first }
    }

    /// The wait the next [`Delays::next_delay`] returns.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// This wait, doubling the next one (up to `max`).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// The wait after the `n`th failure in a row (`first` after the first), for a loop that counts its failures
    /// rather than keeping a `Delays`.
    pub fn nth(&self, n: u32) -> Duration {
        self.first.saturating_mul(1 << n.saturating_sub(1).min(20)).min(self.max)
    }

    /// After a success: the next wait is `first` again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// Sleeps this wait.
    pub async fn sleep(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::Delays;
    use std::time::Duration;

    #[test]
    fn delays_double_up_to_their_cap_and_start_over_after_a_reset() {
        let ms = Duration::from_millis;
        let mut delays = Delays::new(ms(100), ms(500));
        let taken: Vec<_> = (0..5).map(|_| delays.next_delay()).collect();
        assert_eq!(taken, [ms(100), ms(200), ms(400), ms(500), ms(500)]);
        delays.reset();
        assert_eq!(delays.peek(), ms(100));
        // a cap below the first wait is the first wait
        assert_eq!(Delays::new(ms(300), ms(10)).next_delay(), ms(300));
        // counted instead of kept: the same waits
        let delays = Delays::new(ms(100), ms(500));
        assert_eq!((1..=5).map(|n| delays.nth(n)).collect::<Vec<_>>(), taken);
        assert_eq!(delays.nth(1000), ms(500));
    }
}
