//! Compaction: when the running sequences would fit a smaller batch, the highest ones move down into free slots
//! (on the CPU at every hole, where shapes are exact; with CUDA graphs only when the batch bucket can shrink).

use super::Engine;
use crate::error::Result;

impl Engine {
    /// Moves the sequences in the highest slots down into free ones until the batch a step needs is the one the
    /// running count needs (their keys and values, and their penalty row, go with them).
    pub(super) fn compact(&mut self) -> Result<()> {
        let running = self.running();
        if running == 0 {
            return Ok(());
        }
        let target = self.shapes.batch(running, self.slots);
        while let Some(high) = self.rows.iter().rposition(Option::is_some) {
            if high < target {
                break;
            }
            let Some(hole) = self.rows.iter().position(Option::is_none) else { break };
            if hole > high {
                break;
            }
            let len = self.rows[high].as_ref().map_or(0, |r| r.cached.max(0));
            if let Some(cache) = self.cache.as_mut() {
                cache.copy_row(high as i64, hole as i64, len)?;
            }
            if let Some(presence) = &mut self.presence {
                let from = presence.f_narrow(0, high as i64, 1)?;
                presence.f_narrow(0, hole as i64, 1)?.f_copy_(&from)?;
            }
            self.rows.swap(high, hole);
            self.stats.moved_rows += 1;
        }
        Ok(())
    }
}
