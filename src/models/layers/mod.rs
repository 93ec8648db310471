//! Layers shared by model files, with vLLM's names and meaning. Each has `load` (from a
//! prefix-scoped weight view) and `forward` (on a [`Device`]).

mod attention;
mod linear;

pub use attention::{PagedAttention, RotaryEmbedding};
pub use linear::{MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear};

use super::ModelError;
use super::loader::ParamView;
use crate::kernels::Device;

/// Token embedding table `[vocab, hidden]`.
pub struct VocabParallelEmbedding<D: Device> {
    pub weight: D::Weight,
}

impl<D: Device> VocabParallelEmbedding<D> {
    pub fn load(dev: &D, w: &ParamView, vocab: usize, hidden: usize) -> Result<Self, ModelError> {
        Ok(Self { weight: dev.upload(w.get("weight", &[vocab, hidden])?)? })
    }
    pub fn forward(&self, dev: &D, ids: &[u32]) -> D::Tensor {
        dev.embedding(&self.weight, ids)
    }
}

/// The output projection to vocabulary logits; shares the embedding table when tied.
pub enum ParallelLMHead<D: Device> {
    Own(D::Weight),
    Tied,
}

impl<D: Device> ParallelLMHead<D> {
    pub fn load(dev: &D, w: &ParamView, vocab: usize, hidden: usize, tied: bool) -> Result<Self, ModelError> {
        if tied {
            return Ok(Self::Tied);
        }
        Ok(Self::Own(dev.upload(w.get("weight", &[vocab, hidden])?)?))
    }
    pub fn forward(&self, dev: &D, hidden: &D::Tensor, embed: &VocabParallelEmbedding<D>) -> D::Tensor {
        let w = match self {
            Self::Own(w) => w,
            Self::Tied => &embed.weight,
        };
        dev.linear(hidden, w, None)
    }
}

pub struct RMSNorm<D: Device> {
    pub weight: D::Weight,
    pub eps: f32,
}

impl<D: Device> RMSNorm<D> {
    pub fn load(dev: &D, w: &ParamView, size: usize, eps: f32) -> Result<Self, ModelError> {
        Ok(Self { weight: dev.upload(w.get("weight", &[size])?)?, eps })
    }
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> D::Tensor {
        dev.rms_norm(x, &self.weight, self.eps)
    }
    /// `residual += x`, then the norm of the sum.
    pub fn forward_residual(&self, dev: &D, x: &D::Tensor, residual: &mut D::Tensor) -> D::Tensor {
        dev.add_rms_norm(x, residual, &self.weight, self.eps)
    }
}
