//! Linear layers. Weights are `[out, in]` as in the checkpoint; fused layers stack their
//! shards' rows in the order of the model's stacked-params table.

use crate::kernels::Device;
use crate::models::ModelError;
use crate::models::loader::ParamView;

/// Fused q/k/v projection: rows `[q (heads·d) | k (kv_heads·d) | v (kv_heads·d)]`.
pub struct QKVParallelLinear<D: Device> {
    pub weight: D::Weight,
    pub bias: Option<D::Weight>,
    pub q_size: usize,
    pub kv_size: usize,
}

impl<D: Device> QKVParallelLinear<D> {
    pub fn load(
        dev: &D,
        w: &ParamView,
        hidden: usize,
        q_size: usize,
        kv_size: usize,
        bias: bool,
    ) -> Result<Self, ModelError> {
        let names = ["q_proj", "k_proj", "v_proj"];
        let rows = [q_size, kv_size, kv_size];
        let weight = dev.upload(w.get_stacked("qkv_proj.weight", &names, &rows, Some(hidden))?)?;
        let bias = match bias {
            true => Some(dev.upload(w.get_stacked("qkv_proj.bias", &names, &rows, None)?)?),
            false => None,
        };
        Ok(Self { weight, bias, q_size, kv_size })
    }
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> D::Tensor {
        dev.linear(x, &self.weight, self.bias.as_ref())
    }
}

/// Fused gate/up projection: rows `[gate (i) | up (i)]`.
pub struct MergedColumnParallelLinear<D: Device> {
    pub weight: D::Weight,
}

impl<D: Device> MergedColumnParallelLinear<D> {
    pub fn load(dev: &D, w: &ParamView, hidden: usize, intermediate: usize) -> Result<Self, ModelError> {
        let names = ["gate_proj", "up_proj"];
        let t = w.get_stacked("gate_up_proj.weight", &names, &[intermediate, intermediate], Some(hidden))?;
        Ok(Self { weight: dev.upload(t)? })
    }
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> D::Tensor {
        dev.linear(x, &self.weight, None)
    }
}

/// Output projections (o_proj, down_proj): the input is split across ranks under tensor
/// parallelism, followed by an all-reduce.
pub struct RowParallelLinear<D: Device> {
    pub weight: D::Weight,
}

impl<D: Device> RowParallelLinear<D> {
    pub fn load(dev: &D, w: &ParamView, input: usize, output: usize) -> Result<Self, ModelError> {
        Ok(Self { weight: dev.upload(w.get("weight", &[output, input])?)? })
    }
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> D::Tensor {
        dev.linear(x, &self.weight, None)
    }
}
