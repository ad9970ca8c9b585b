//! A decoder layer: attention and the feed-forward (dense, or an MoE layer's sparse block), each behind its
//! pre-norm and residual.

use tch::nn::Path;
use tch::Tensor;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::{Attend, Attention, KvWrite, Mlp, RmsNorm};
use crate::moe::SparseMoe;

/// A decoder layer's feed-forward: the dense MLP, or an MoE layer's sparse block (both under `mlp.` in the
/// checkpoint).
#[derive(Debug)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(Box<SparseMoe>),
}

impl FeedForward {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x),
            FeedForward::Sparse(moe) => moe.forward(x),
        }
    }
}

/// Pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
#[derive(Debug)]
pub struct DecoderLayer {
    pub(crate) self_attn: Attention,
    pub(crate) mlp: FeedForward,
    pub(crate) input_layernorm: RmsNorm,
    pub(crate) post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// Decoder layer `index` of a model of this configuration.
    pub fn new(vs: Path, cfg: &ModelConfig, index: usize) -> Result<Self> {
        let mlp = match &cfg.moe {
            Some(moe) if moe.is_sparse(index) => FeedForward::Sparse(Box::new(SparseMoe::new(&vs / "mlp", cfg, moe)?)),
            _ => FeedForward::Dense(Mlp::new(&vs / "mlp", cfg)?),
        };
        Ok(DecoderLayer {
            self_attn: Attention::new(&vs / "self_attn", cfg)?,
            mlp,
            input_layernorm: RmsNorm::new(&vs / "input_layernorm", cfg.hidden_size, cfg.rms_norm_eps)?,
            post_attention_layernorm: RmsNorm::new(
                &vs / "post_attention_layernorm",
                cfg.hidden_size,
                cfg.rms_norm_eps,
            )?,
        })
    }

    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        attend: Attend<'_>,
        cache: Option<KvWrite<'_>>,
    ) -> Result<Tensor> {
        let attn = self.self_attn.forward(&self.input_layernorm.forward(x)?, cos, sin, attend, cache)?;
        let x = x.f_add(&attn)?;
        let mlp = self.mlp.forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok(x.f_add(&mlp)?)
    }
}
