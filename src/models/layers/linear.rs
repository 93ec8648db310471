//! Linear layers, sharded at load time for tensor parallelism as vLLM's parallel layers
//! are: column-parallel layers keep a slice of the output rows, row-parallel layers a slice
//! of the input columns followed by an all-reduce. Weights are `[out, in]` as in the
//! checkpoint; fused layers stack their shards' rows in the order of the model's
//! stacked-params table.

use std::ops::Range;

use super::Norm;
use crate::kernels::{Activation, DevResult, Device, LoraRows, TpRank};
use crate::models::ModelError;
use crate::models::loader::{ParamView, Part};

/// The `rank`'s equal share of `n` units.
pub fn shard(n: usize, tp: TpRank) -> Range<usize> {
    let per = n / tp.world;
    tp.rank * per..(tp.rank + 1) * per
}

/// This rank's query heads, and its KV heads: a share of them, or the one KV head its query
/// heads read when there are fewer KV heads than ranks (replicated).
pub fn qkv_heads(heads: usize, kv_heads: usize, tp: TpRank) -> (Range<usize>, Range<usize>) {
    let kv = if kv_heads >= tp.world {
        shard(kv_heads, tp)
    } else {
        let h = tp.rank * kv_heads / tp.world;
        h..h + 1
    };
    (shard(heads, tp), kv)
}

/// A projection's LoRA adapters for the step (see [`LoraRows`]).
pub type ProjLora<'a, D> = LoraRows<'a, <D as Device>::Lora>;

/// A linear layer split by output features: each rank computes its share of the outputs
/// (for a following row-parallel layer), or, with `gather_output`, every rank ends with all
/// of them. The fused layers below are its stacked forms.
pub struct ColumnParallelLinear<D: Device> {
    pub weight: D::Weight,
    pub bias: Option<D::Weight>,
    output: usize,
    gather_output: bool,
}

impl<D: Device> ColumnParallelLinear<D> {
    pub fn load(
        dev: &D,
        w: &ParamView,
        (input, output): (usize, usize),
        bias: bool,
        gather_output: bool,
    ) -> Result<Self, ModelError> {
        let tp = dev.tp();
        if !output.is_multiple_of(tp.world) {
            return Err(ModelError::Config(format!(
                "{} output features do not split over {} ranks",
                output, tp.world
            )));
        }
        let rows = shard(output, tp);
        let weight = dev.upload(w.get_part("weight", &[output, input], Part::Rows(rows.clone()))?)?;
        let bias = match bias {
            true => Some(dev.upload(w.get_part("bias", &[output], Part::Rows(rows))?)?),
            false => None,
        };
        Ok(Self { weight, bias, output, gather_output })
    }
    /// `[n, input]` → `[n, output / ranks]`, or `[n, output]` when gathering.
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> DevResult<D::Tensor> {
        let y = dev.linear(x, &self.weight, self.bias.as_ref())?;
        match self.gather_output && dev.tp().world > 1 {
            true => dev.all_gather_cols(&y, self.output / dev.tp().world, self.output),
            false => Ok(y),
        }
    }
}

/// Fused q/k/v projection: rows `[q (heads·d) | k (kv_heads·d) | v (kv_heads·d)]` of this
/// rank's heads. With fewer KV heads than ranks, each KV head is replicated on the ranks
/// whose query heads read it.
pub struct QKVParallelLinear<D: Device> {
    pub weight: D::Weight,
    pub bias: Option<D::Weight>,
    /// Query and KV heads on this rank.
    pub num_heads: usize,
    pub num_kv_heads: usize,
}

impl<D: Device> QKVParallelLinear<D> {
    pub fn load(
        dev: &D,
        w: &ParamView,
        hidden: usize,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        bias: bool,
    ) -> Result<Self, ModelError> {
        let (q, kv) = qkv_heads(heads, kv_heads, dev.tp());
        let rows_of = |r: &Range<usize>| r.start * head_dim..r.end * head_dim;
        let picks = [rows_of(&q), rows_of(&kv), rows_of(&kv)];
        let names = ["q_proj", "k_proj", "v_proj"];
        let rows = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim];
        let weight = dev.upload(w.get_stacked("qkv_proj.weight", &names, &rows, &picks, Some(hidden))?)?;
        let bias = match bias {
            true => Some(dev.upload(w.get_stacked("qkv_proj.bias", &names, &rows, &picks, None)?)?),
            false => None,
        };
        Ok(Self { weight, bias, num_heads: q.len(), num_kv_heads: kv.len() })
    }
    /// The same layer from a checkpoint that stores q, k and v fused already (`qkv_proj`,
    /// rows `[q | k | v]`, as Phi-3's): this rank's rows of each part.
    pub fn load_fused(
        dev: &D,
        w: &ParamView,
        hidden: usize,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        bias: bool,
    ) -> Result<Self, ModelError> {
        let (q, kv) = qkv_heads(heads, kv_heads, dev.tp());
        let (qn, kvn) = (heads * head_dim, kv_heads * head_dim);
        let rows_of = |base: usize, r: &Range<usize>| base + r.start * head_dim..base + r.end * head_dim;
        let picks = [rows_of(0, &q), rows_of(qn, &kv), rows_of(qn + kvn, &kv)];
        let total = qn + 2 * kvn;
        let weight = dev.upload(w.get_rows("qkv_proj.weight", &[total, hidden], &picks)?)?;
        let bias = match bias {
            true => Some(dev.upload(w.get_rows("qkv_proj.bias", &[total], &picks)?)?),
            false => None,
        };
        Ok(Self { weight, bias, num_heads: q.len(), num_kv_heads: kv.len() })
    }
    /// With `lora`, its q, k and v modules' deltas added.
    pub fn forward(&self, dev: &D, x: &D::Tensor, lora: ProjLora<D>) -> DevResult<D::Tensor> {
        dev.project(x, &self.weight, self.bias.as_ref(), lora)
    }
}

/// Fused gate/up projection: rows `[gate (i) | up (i)]` of this rank's share of the
/// intermediate size.
pub struct MergedColumnParallelLinear<D: Device> {
    pub weight: D::Weight,
}

impl<D: Device> MergedColumnParallelLinear<D> {
    pub fn load(dev: &D, w: &ParamView, hidden: usize, intermediate: usize) -> Result<Self, ModelError> {
        let names = ["gate_proj", "up_proj"];
        let pick = shard(intermediate, dev.tp());
        let t = w.get_stacked(
            "gate_up_proj.weight",
            &names,
            &[intermediate, intermediate],
            &[pick.clone(), pick],
            Some(hidden),
        )?;
        Ok(Self { weight: dev.upload(t)? })
    }
    /// The same layer from a checkpoint that stores gate and up fused already
    /// (`gate_up_proj`, rows `[gate | up]`, as Phi-3's): this rank's rows of each.
    pub fn load_fused(
        dev: &D,
        w: &ParamView,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self, ModelError> {
        let pick = shard(intermediate, dev.tp());
        let picks = [pick.clone(), intermediate + pick.start..intermediate + pick.end];
        let t = w.get_rows("gate_up_proj.weight", &[2 * intermediate, hidden], &picks)?;
        Ok(Self { weight: dev.upload(t)? })
    }
    /// `act(gate) · up` of the projection, with `lora`'s gate and up deltas added to it
    /// first: `[n, hidden]` → `[n, intermediate / ranks]`. `gemm_only`: the down projection
    /// that reads it applies no adapters ([`Device::gate_up_act`]).
    pub fn forward_act_mul(
        &self,
        dev: &D,
        x: &D::Tensor,
        lora: ProjLora<D>,
        act: Activation,
        gemm_only: bool,
    ) -> DevResult<D::Tensor> {
        dev.gate_up_act(x, &self.weight, lora, act, gemm_only)
    }
}

/// Output projections (o_proj, down_proj): each rank holds the columns of its share of the
/// input; the partial products are summed over the ranks (rank 0's with the bias, if any).
pub struct RowParallelLinear<D: Device> {
    pub weight: D::Weight,
    pub bias: Option<D::Weight>,
}

impl<D: Device> RowParallelLinear<D> {
    pub fn load(dev: &D, w: &ParamView, input: usize, output: usize) -> Result<Self, ModelError> {
        Self::load_with_bias(dev, w, (input, output), false)
    }
    pub fn load_with_bias(
        dev: &D,
        w: &ParamView,
        (input, output): (usize, usize),
        bias: bool,
    ) -> Result<Self, ModelError> {
        let tp = dev.tp();
        let part = if tp.world == 1 { Part::Whole } else { Part::Cols(shard(input, tp)) };
        let bias = match bias {
            true => Some(dev.upload(w.get("bias", &[output])?)?),
            false => None,
        };
        Ok(Self { weight: dev.upload(w.get_part("weight", &[output, input], part)?)?, bias })
    }
    /// `x @ wᵀ` summed over the ranks (plus the bias); with `lora`, its delta (from this
    /// rank's share of the input) joins the partial product before the sum.
    pub fn forward(&self, dev: &D, x: &D::Tensor, lora: ProjLora<D>) -> DevResult<D::Tensor> {
        // Rank 0's partial product carries the bias, so that the sum has it once.
        let bias = self.bias.as_ref().filter(|_| dev.tp().rank == 0);
        let mut out = dev.project(x, &self.weight, bias, lora)?;
        dev.all_reduce(&mut out)?;
        Ok(out)
    }
    /// [`Self::forward`] added to `residual`, then `norm` of the sum for the next projection
    /// ([`Norm::forward_to_proj`]). For an RMSNorm, without adapters or bias on one rank,
    /// the device does both in one call ([`Device::linear_add_rms_norm`]).
    pub fn forward_add_norm(
        &self,
        dev: &D,
        x: &D::Tensor,
        lora: ProjLora<D>,
        residual: &mut D::Tensor,
        norm: &Norm<D>,
        gemm_only: bool,
    ) -> DevResult<D::Tensor> {
        if let Norm::Rms(n) = norm
            && lora.is_none()
            && self.bias.is_none()
            && dev.tp().world == 1
        {
            return dev.linear_add_rms_norm(x, &self.weight, residual, &n.weight, n.eps, gemm_only);
        }
        let out = self.forward(dev, x, lora)?;
        norm.forward_to_proj(dev, &out, Some(residual), gemm_only)
    }
}
