//! The engine's KV cache: one preallocated row ("slot") per running sequence, written in place.
//!
//! Layout per layer: keys and values `[slots, kv_heads, max_len, head_dim]`. The running sequences always occupy
//! rows `0..B` (the engine compacts when one leaves), so a decode step works on a narrowed view, never a gather.

use tch::Tensor;

use crate::error::{ModelError, Result};
use crate::layers::LayerKv;
use crate::model::CausalLm;

#[derive(Debug)]
pub(crate) struct SlotCache {
    pub(crate) layers: Vec<LayerKv>,
    pub(crate) slots: i64,
    pub(crate) max_len: i64,
}

impl SlotCache {
    /// Zero-filled: slots beyond a sequence's length are masked out of attention, but a masked value still
    /// multiplies a zero weight, so it must be finite (uninitialised memory could hold NaN).
    pub(crate) fn new(model: &CausalLm, slots: i64, max_len: i64) -> Result<Self> {
        if slots <= 0 || max_len <= 1 {
            return Err(ModelError::Generation(format!(
                "the KV cache needs at least one slot of two positions, got {slots} slots of {max_len}"
            )));
        }
        let cfg = model.config();
        let shape = [slots, cfg.num_key_value_heads, max_len, cfg.head_dim];
        let options = (model.dtype().kind(), model.device());
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| Ok(LayerKv { k: Tensor::f_zeros(shape, options)?, v: Tensor::f_zeros(shape, options)? }))
            .collect::<Result<Vec<_>>>()?;
        Ok(SlotCache { layers, slots, max_len })
    }

    /// Bytes a cache of this shape takes, to size the budget before allocating.
    pub(crate) fn bytes_for(model: &CausalLm, slots: i64, max_len: i64) -> u64 {
        let cfg = model.config();
        let per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim;
        let elem = match model.dtype() {
            crate::device::DType::F32 => 4,
            crate::device::DType::BF16 => 2,
        };
        (per_token * elem) as u64 * slots.max(0) as u64 * max_len.max(0) as u64
    }

    /// Copies the first `len` positions of row `src` into row `dst`: forking a shared prompt, or moving a
    /// sequence into a freed row.
    pub(crate) fn copy_row(&mut self, src: i64, dst: i64, len: i64) -> Result<()> {
        if src == dst || len == 0 {
            return Ok(());
        }
        for kv in &mut self.layers {
            for t in [&mut kv.k, &mut kv.v] {
                let from = t.f_narrow(0, src, 1)?.f_narrow(2, 0, len)?;
                t.f_narrow(0, dst, 1)?.f_narrow(2, 0, len)?.f_copy_(&from)?;
            }
        }
        Ok(())
    }
}
