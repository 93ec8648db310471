//! A mixture-of-experts block (vLLM's `FusedMoE` with its router): the router's logits
//! (a replicated linear layer), then the experts through [`Device::fused_moe`], and, where
//! the model has one, a shared expert under a sigmoid gate (Qwen2-MoE's). Each expert's
//! gate and up projections are stacked into `[experts, 2·inter, hidden]` and its down
//! projections into `[experts, hidden, inter]`; under tensor parallelism every rank keeps
//! its share of each expert's intermediate size, as vLLM splits them.

use super::{MergedColumnParallelLinear, RowParallelLinear, shard};
use crate::kernels::{Activation, DevResult, Device, HostTensor, MoeSpec};
use crate::models::ModelError;
use crate::models::config::unsupported;
use crate::models::loader::{ParamView, Part};

/// How a checkpoint names its expert block and the experts' projections: Mixtral's
/// `block_sparse_moe` with `w1`/`w3`/`w2`, or the Qwen MoE families' `mlp` with
/// `gate_proj`/`up_proj`/`down_proj`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    pub block: &'static str,
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl ExpertNames {
    pub const MIXTRAL: Self = Self { block: "block_sparse_moe", gate: "w1", up: "w3", down: "w2" };
    pub const QWEN: Self = Self { block: "mlp", gate: "gate_proj", up: "up_proj", down: "down_proj" };
}

/// The shape of a model's expert blocks.
#[derive(Debug, Clone)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    pub renormalize: bool,
    /// Each expert's intermediate size.
    pub inter: usize,
    /// A shared expert's intermediate size (Qwen2-MoE), 0 for none.
    pub shared_inter: usize,
    pub names: ExpertNames,
    /// Per layer: whether its MLP is an expert block (else a dense MLP).
    pub sparse: Vec<bool>,
}

/// The most experts a token may take (the GPU's router keeps them in registers).
pub const MAX_TOP_K: usize = 8;

impl MoeConfig {
    /// Refuses expert counts the engine cannot route, naming the field.
    pub fn check(&self, arch: &str) -> Result<(), ModelError> {
        if self.experts == 0 || self.experts > 512 {
            return Err(unsupported(arch, "the number of experts", self.experts, "1 to 512"));
        }
        if self.top_k == 0 || self.top_k > self.experts.min(MAX_TOP_K) {
            let range = format!("1 to {}", self.experts.min(MAX_TOP_K));
            return Err(unsupported(arch, "num_experts_per_tok", self.top_k, &range));
        }
        Ok(())
    }
    /// Parameters of one expert block (router, experts, shared expert and its gate).
    pub fn block_params(&self, hidden: usize) -> usize {
        let shared = match self.shared_inter {
            0 => 0,
            s => 3 * hidden * s + hidden,
        };
        self.experts * (hidden + 3 * hidden * self.inter) + shared
    }
    /// Parameters of the experts one token does not take, in one block.
    pub fn idle_params(&self, hidden: usize) -> usize {
        (self.experts - self.top_k) * 3 * hidden * self.inter
    }
}

/// A shared expert and its gate (`shared_expert`, `shared_expert_gate`).
struct SharedExpert<D: Device> {
    gate_up: MergedColumnParallelLinear<D>,
    down: RowParallelLinear<D>,
    gate: D::Weight,
}

pub struct SparseMoeBlock<D: Device> {
    /// `[experts, hidden]`, replicated.
    router: D::Weight,
    gate_up: D::Weight,
    down: D::Weight,
    spec: MoeSpec,
    shared: Option<SharedExpert<D>>,
    act: Activation,
}

impl<D: Device> SparseMoeBlock<D> {
    /// From the block's weights `w`: `gate` (the router), `experts.{e}` (their gate and up
    /// projections stacked as `gate_up_proj` by the model's stacked params), and
    /// `shared_expert`, `shared_expert_gate` where the model has them.
    pub fn load(
        dev: &D,
        w: &ParamView,
        hidden: usize,
        c: &MoeConfig,
        act: Activation,
    ) -> Result<Self, ModelError> {
        let tp = dev.tp();
        if !c.inter.is_multiple_of(tp.world) {
            return Err(ModelError::Config(format!(
                "the experts' intermediate size {} does not split over {} ranks",
                c.inter, tp.world
            )));
        }
        let pick = shard(c.inter, tp);
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        let down_part = if tp.world == 1 { Part::Whole } else { Part::Cols(pick.clone()) };
        for e in 0..c.experts {
            let x = w.pp("experts").pp(e);
            let rows = [c.inter, c.inter];
            let picks = [pick.clone(), pick.clone()];
            let names = [c.names.gate, c.names.up];
            gate_up.push(x.get_stacked("gate_up_proj.weight", &names, &rows, &picks, Some(hidden))?);
            down.push(x.pp(c.names.down).get_part("weight", &[hidden, c.inter], down_part.clone())?);
        }
        let shared = match c.shared_inter {
            0 => None,
            s => Some(SharedExpert {
                gate_up: MergedColumnParallelLinear::load(dev, &w.pp("shared_expert"), hidden, s)?,
                down: RowParallelLinear::load(dev, &w.pp("shared_expert").pp("down_proj"), s, hidden)?,
                gate: dev.upload(w.pp("shared_expert_gate").get("weight", &[1, hidden])?)?,
            }),
        };
        Ok(Self {
            router: dev.upload(w.pp("gate").get("weight", &[c.experts, hidden])?)?,
            gate_up: dev.upload(stack(gate_up))?,
            down: dev.upload(stack(down))?,
            spec: MoeSpec { experts: c.experts, top_k: c.top_k, renormalize: c.renormalize, act },
            shared,
            act,
        })
    }

    /// `[n, hidden]` → `[n, hidden]`, summed over the ranks.
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> DevResult<D::Tensor> {
        let logits = dev.linear(x, &self.router, None)?; // [n, experts]
        let mut out = dev.fused_moe(x, &logits, &self.gate_up, &self.down, self.spec)?;
        dev.all_reduce(&mut out)?;
        if let Some(s) = &self.shared {
            let act = s.gate_up.forward_act_mul(dev, x, None, self.act, false)?;
            let y = s.down.forward(dev, &act, None)?;
            let gate = dev.linear(x, &s.gate, None)?; // [n, 1]
            dev.add_sigmoid_gated(&mut out, &y, &gate)?;
        }
        Ok(out)
    }
}

/// The experts' 2-D tensors as one `[experts, rows, cols]` tensor.
fn stack(parts: Vec<HostTensor<'_>>) -> HostTensor<'static> {
    let shape = vec![parts.len(), parts[0].shape[0], parts[0].shape[1]];
    let dtype = parts[0].dtype;
    let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
    for p in &parts {
        data.extend_from_slice(&p.data);
    }
    HostTensor { dtype, shape, data: data.into() }
}
