//! The decode step as CUDA graphs: one graph per `(batch, width)` shape, captured the first time the engine
//! decodes at that shape and replayed afterwards (one launch instead of a few hundred kernels).
//!
//! Shapes come from buckets so a few graphs cover every step: the batch is the number of slots rounded up to a
//! power of two (capped at the slot count), the attention width the highest position rounded up to a power of two
//! (at least [`MIN_WIDTH`], capped at `max_model_len`). All graphs share one memory pool; each replay's logits are
//! consumed (gathered into a fresh tensor) before the next replay.
//!
//! A graph reads the KV cache, the weights and the decode inputs (`forward::DecodeInputs`) at the addresses it was captured with: weight
//! swaps copy in place, and freeing the cache drops every graph.

use std::collections::HashMap;

use jetrl_torch_ext::{CudaGraph, GraphPool};
use tch::Tensor;

use crate::error::{ModelError, Result};

/// The narrowest attention width a graph is captured at.
pub(crate) const MIN_WIDTH: i64 = 32;

/// Eager passes before a capture (cuBLAS and the allocator settle their workspaces on the capture stream).
const WARMUP: usize = 2;

/// How decode steps are shaped: exact on the CPU (no graph to reuse, padding would only cost), bucketed when
/// graphs replay them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shapes {
    Exact,
    Buckets,
}

impl Shapes {
    /// Slots a step decodes when the highest slot in use is `needed - 1`.
    pub(crate) fn batch(self, needed: usize, slots: usize) -> usize {
        match self {
            Shapes::Exact => needed,
            Shapes::Buckets => needed.next_power_of_two().min(slots),
        }
    }

    /// Key positions a step attends over when the furthest position written is `needed - 1`.
    pub(crate) fn width(self, needed: i64, max_len: i64) -> i64 {
        match self {
            Shapes::Exact => needed,
            Shapes::Buckets => (needed.max(MIN_WIDTH) as u64).next_power_of_two().min(max_len as u64) as i64,
        }
    }
}

/// The captured decode graphs of one engine, by `(batch, width)`, with each graph's output logits.
pub(crate) struct DecodeGraphs {
    device: usize,
    pool: GraphPool,
    graphs: HashMap<(i64, i64), (CudaGraph, Tensor)>,
}

impl std::fmt::Debug for DecodeGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraphs").field("device", &self.device).field("captured", &self.graphs.len()).finish()
    }
}

impl DecodeGraphs {
    pub(crate) fn new(device: usize) -> Result<Self> {
        let pool = GraphPool::new().map_err(|e| ModelError::Generation(e.to_string()))?;
        Ok(DecodeGraphs { device, pool, graphs: HashMap::new() })
    }

    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// Graphs captured so far.
    pub(crate) fn captured(&self) -> usize {
        self.graphs.len()
    }

    /// Runs one decode step at `(batch, width)`: replays its graph, capturing `step` first if this shape is new
    /// (the step must read and write only memory that outlives the graph). Returns the graph's logits `[batch, V]`,
    /// valid until the next replay.
    pub(crate) fn replay(&mut self, batch: i64, width: i64, step: impl FnMut() -> Result<Tensor>) -> Result<Tensor> {
        let key = (batch, width);
        if !self.graphs.contains_key(&key) {
            // The warm-up passes run this step for real; the replay below repeats it with the same inputs and
            // writes the same keys and values.
            let captured = CudaGraph::capture(self.device, self.pool, WARMUP, step)
                .map_err(|e| ModelError::Generation(format!("capturing the decode graph ({batch} x {width}): {e}")))?;
            self.graphs.insert(key, captured);
        }
        let (graph, logits) = self
            .graphs
            .get(&key)
            .ok_or_else(|| ModelError::Generation(format!("no decode graph for {batch} x {width}")))?;
        graph.replay().map_err(|e| ModelError::Generation(format!("replaying the decode graph: {e}")))?;
        Ok(logits.shallow_clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_capped_at_the_budget_and_exact_shapes_are_unchanged() {
        let b = Shapes::Buckets;
        let got: Vec<usize> = [1, 2, 3, 5, 17, 200, 256].iter().map(|&n| b.batch(n, 200)).collect();
        assert_eq!(got, [1, 2, 4, 8, 32, 200, 200]);
        let widths: Vec<i64> = [1, 32, 33, 100, 160].iter().map(|&w| b.width(w, 160)).collect();
        assert_eq!(widths, [32, 32, 64, 128, 160]);
        assert_eq!(Shapes::Exact.batch(3, 200), 3);
        assert_eq!(Shapes::Exact.width(33, 160), 33);
    }
}
