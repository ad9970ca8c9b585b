//! The model-wide side of the MoE routing tape ([`crate::moe`]): replaying given routes in the next forward
//! passes, recording the routes a forward chose, and collecting router logits for the load-balancing loss. One
//! tensor per sparse layer, in layer order; a dense model has none and every call is a no-op.

use tch::Tensor;

use crate::decoder::FeedForward;
use crate::error::{ModelError, Result};
use crate::model::CausalLm;
use crate::moe::SparseMoe;

impl CausalLm {
    fn sparse_blocks(&self) -> impl Iterator<Item = &SparseMoe> {
        self.layers.iter().filter_map(|layer| match &layer.mlp {
            FeedForward::Sparse(moe) => Some(moe.as_ref()),
            FeedForward::Dense(_) => None,
        })
    }

    /// How many layers route (0 for a dense model).
    pub fn sparse_layer_count(&self) -> usize {
        self.sparse_blocks().count()
    }

    /// Routes every following forward pass by `routes` (router replay) until called with `None`: one `[N, top_k]`
    /// int64 tensor of expert ids per sparse layer, rows in the forward's flattened token order (`[B, T]` row-major
    /// for a padded batch, the packed row's order for a packed one). The routing weights still come from the
    /// current router, renormalised over the replayed experts as the model's config says.
    pub fn set_router_replay(&self, routes: Option<Vec<Tensor>>) -> Result<()> {
        let layers = self.sparse_layer_count();
        match routes {
            None => self.sparse_blocks().for_each(|moe| moe.tape().replay(None)),
            Some(routes) if routes.len() == layers => {
                for (moe, route) in self.sparse_blocks().zip(routes) {
                    moe.tape().replay(Some(route));
                }
            }
            Some(routes) => {
                return Err(ModelError::Input(format!(
                    "router replay was given routes for {} layers; the model has {layers} sparse layers",
                    routes.len()
                )))
            }
        }
        Ok(())
    }

    /// Starts (or stops and discards) recording the experts each forward pass routes to.
    pub fn record_routes(&self, on: bool) {
        self.sparse_blocks().for_each(|moe| moe.tape().record(on));
    }

    /// The routes recorded since [`Self::record_routes`] (or the last take): per sparse layer, the forwards'
    /// `[N, top_k]` routes one after another. Empty when nothing was recorded.
    pub fn take_routes(&self) -> Result<Vec<Tensor>> {
        let mut out = Vec::new();
        for moe in self.sparse_blocks() {
            match moe.tape().take_recorded()? {
                Some(routes) => out.push(routes),
                None => return Ok(Vec::new()),
            }
        }
        Ok(out)
    }

    /// Starts (or stops and discards) keeping every sparse layer's router logits, in the autograd graph, for
    /// [`crate::load_balancing_loss`].
    pub fn collect_router_logits(&self, on: bool) {
        self.sparse_blocks().for_each(|moe| moe.tape().collect_logits(on));
    }

    /// The router logits kept since the last take, `[N, experts]` per sparse layer and forward.
    pub fn take_router_logits(&self) -> Vec<Tensor> {
        self.sparse_blocks().flat_map(|moe| moe.tape().take_logits()).collect()
    }
}
