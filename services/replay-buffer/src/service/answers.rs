//! The answers remembered for retried sample requests: a trainer that timed out asks again with the same request
//! id, and gets the answer it missed instead of a second batch. Bounded: the oldest answer goes first.

use std::collections::{HashMap, VecDeque};

use jetrl_wire::v1::SampleResponse;

/// Answers by request id, at most `capacity`, oldest evicted first.
#[derive(Debug)]
pub(super) struct Answers {
    capacity: usize,
    by_request: HashMap<String, SampleResponse>,
    /// request ids in the order they were answered (a forgotten id stays until it is the oldest)
    order: VecDeque<String>,
}

impl Answers {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, by_request: HashMap::new(), order: VecDeque::new() }
    }

    /// The answer given to `request_id`, if it is remembered.
    pub fn get(&self, request_id: &str) -> Option<&SampleResponse> {
        self.by_request.get(request_id)
    }

    /// Keeps `response` for a retry of its request, evicting the oldest answers beyond the capacity.
    pub fn remember(&mut self, response: SampleResponse) {
        self.order.push_back(response.request_id.clone());
        self.by_request.insert(response.request_id.clone(), response);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.by_request.remove(&old);
            }
        }
    }

    /// Forgets the answer to a released request (its groups are gone: a retry must not get them).
    pub fn forget(&mut self, request_id: &str) {
        self.by_request.remove(request_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(id: &str) -> SampleResponse {
        SampleResponse { request_id: id.into(), ..Default::default() }
    }

    #[test]
    fn remembered_answers_are_bounded_and_the_oldest_go_first() {
        let mut answers = Answers::new(3);
        for i in 0..5 {
            answers.remember(answer(&format!("r{i}")));
        }
        let kept: Vec<bool> = (0..5).map(|i| answers.get(&format!("r{i}")).is_some()).collect();
        assert_eq!(kept, [false, false, true, true, true]);
        assert_eq!(answers.get("r4").map(|a| a.request_id.as_str()), Some("r4"));
    }

    #[test]
    fn a_forgotten_answer_is_not_given_to_a_retry() {
        let mut answers = Answers::new(3);
        answers.remember(answer("r0"));
        answers.remember(answer("r1"));
        answers.forget("r0");
        assert!(answers.get("r0").is_none());
        assert!(answers.get("r1").is_some());
    }
}
