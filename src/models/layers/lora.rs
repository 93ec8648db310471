//! A decoder layer's LoRA buffers, built from the targets its model declares
//! ([`ModelConfig::lora_targets`]): device buffers for every adapter slot, grouped by the
//! projection that applies them, each with its column offset in that projection's output
//! and the share of an adapter's weights this rank holds.

use std::borrow::Cow;
use std::ops::Range;

use super::linear::{ProjLora, qkv_heads, shard};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{DevResult, Device, LoraShape, LoraSlotWeights};
use crate::models::config::ModelConfig;
use crate::models::lora::{LoraAdapter, LoraSplit, Proj, Shard};
use crate::models::{LoraCapacity, ModelError};

/// The share of one target's adapter weights a tensor-parallel rank holds, following its
/// base layer: a column-parallel layer's output rows (rows of B, possibly from several
/// sections), a row-parallel layer's input columns (columns of A, whose delta joins the
/// partial product before the sum).
#[derive(Debug, Clone)]
enum LoraPart {
    Out(Vec<Range<usize>>),
    In { cols: Range<usize>, of: usize },
}

impl LoraPart {
    /// (A, B) of this rank from an adapter's full `a` `[rank, in]` and `b` `[out, rank]`.
    fn slice<'w>(&self, a: &'w [f32], b: &'w [f32], rank: usize) -> (Cow<'w, [f32]>, Cow<'w, [f32]>) {
        match self {
            LoraPart::Out(rows) if rows.len() == 1 => {
                (a.into(), b[rows[0].start * rank..rows[0].end * rank].into())
            }
            LoraPart::Out(rows) => {
                let b: Vec<f32> =
                    rows.iter().flat_map(|r| &b[r.start * rank..r.end * rank]).copied().collect();
                (a.into(), b.into())
            }
            LoraPart::In { cols, of } => {
                let a: Vec<f32> = a.chunks_exact(*of).flat_map(|row| &row[cols.clone()]).copied().collect();
                (a.into(), b.into())
            }
        }
    }
    fn len(&self) -> usize {
        match self {
            LoraPart::Out(rows) => rows.iter().map(Range::len).sum(),
            LoraPart::In { cols, .. } => cols.len(),
        }
    }
}

/// This rank's features of a section of `size` split as `shard`.
fn rank_features(
    cfg: &ModelConfig,
    shard_kind: Shard,
    size: usize,
    tp: crate::kernels::TpRank,
) -> Range<usize> {
    let (q, kv) = qkv_heads(cfg.num_heads, cfg.num_kv_heads, tp);
    let d = cfg.head_dim;
    match shard_kind {
        Shard::QHeads => q.start * d..q.end * d,
        Shard::KvHeads => kv.start * d..kv.end * d,
        Shard::Even => shard(size, tp),
    }
}

pub struct LayerLora<D: Device> {
    /// Per target: its buffers and its first column in its projection's (fused) output.
    modules: Vec<(D::Lora, usize)>,
    /// Per target: the projection applying it, and this rank's part of its weights.
    procs: Vec<Proj>,
    parts: Vec<LoraPart>,
}

impl<D: Device> LayerLora<D> {
    pub fn new(dev: &D, cfg: &ModelConfig, cap: LoraCapacity) -> Result<Self, ModelError> {
        let tp = dev.tp();
        let parts: Vec<LoraPart> = cfg
            .lora_targets
            .iter()
            .map(|t| match &t.split {
                LoraSplit::Out(sections) => {
                    let mut base = 0;
                    let rows = sections
                        .iter()
                        .map(|&(size, kind)| {
                            let r = rank_features(cfg, kind, size, tp);
                            let r = base + r.start..base + r.end;
                            base += size;
                            r
                        })
                        .collect();
                    LoraPart::Out(rows)
                }
                LoraSplit::In(kind) => {
                    LoraPart::In { cols: rank_features(cfg, *kind, t.in_features, tp), of: t.in_features }
                }
            })
            .collect();
        let mut modules: Vec<Option<(D::Lora, usize)>> = cfg.lora_targets.iter().map(|_| None).collect();
        // Each projection's targets (they read the same x) are allocated as one group, their
        // outputs side by side in declaration order.
        for proj in [Proj::Qkv, Proj::Out, Proj::Up, Proj::Down] {
            let members: Vec<usize> =
                (0..parts.len()).filter(|&i| cfg.lora_targets[i].proj == proj).collect();
            if members.is_empty() {
                continue;
            }
            let shapes: Vec<LoraShape> = members
                .iter()
                .map(|&i| {
                    let t = &cfg.lora_targets[i];
                    let (fin, fout) = match &parts[i] {
                        LoraPart::Out(_) => (t.in_features, parts[i].len()),
                        LoraPart::In { .. } => (parts[i].len(), t.out_features),
                    };
                    LoraShape {
                        slots: cap.slots,
                        max_rank: cap.max_rank,
                        in_features: fin,
                        out_features: fout,
                        bf16: cap.bf16,
                    }
                })
                .collect();
            let mut offset = 0;
            for ((&i, shape), buf) in members.iter().zip(&shapes).zip(dev.alloc_lora(&shapes)?) {
                modules[i] = Some((buf, offset));
                offset += shape.out_features;
            }
        }
        let modules = modules
            .into_iter()
            .map(|m| m.ok_or_else(|| ModelError::Config("LoRA target without a projection".into())));
        Ok(Self {
            modules: modules.collect::<Result<_, _>>()?,
            procs: cfg.lora_targets.iter().map(|t| t.proj).collect(),
            parts,
        })
    }

    /// The targets of `proj`, with their column offsets in its output, when the batch has
    /// adapter slots.
    pub fn modules(&self, proj: Proj, meta: &AttnMetadata) -> Vec<(&D::Lora, usize)> {
        match meta.lora_slots.is_empty() {
            true => Vec::new(),
            false => self
                .modules
                .iter()
                .zip(&self.procs)
                .filter(|(_, p)| **p == proj)
                .map(|((l, off), _)| (l, *off))
                .collect(),
        }
    }

    /// Whether [`Self::modules`] of `proj` would apply any adapter to this batch.
    pub fn applies(&self, proj: Proj, meta: &AttnMetadata) -> bool {
        !meta.lora_slots.is_empty() && self.procs.contains(&proj)
    }

    /// Places `adapter`'s weights of layer `layer` (this rank's part) in `slot`, or clears
    /// the slot.
    pub fn set_slot(
        &mut self,
        dev: &D,
        layer: usize,
        slot: usize,
        adapter: Option<&LoraAdapter>,
    ) -> DevResult<()> {
        for (m, ((buf, _), part)) in self.modules.iter_mut().zip(&self.parts).enumerate() {
            let w = adapter.and_then(|a| a.weights.get(&(layer, m)).map(|w| (a, w)));
            let sliced = w.map(|(a, w)| (part.slice(&w.a, &w.b, a.rank), a.rank, a.scale));
            let slot_weights = sliced.as_ref().map(|((a, b), rank, scale)| LoraSlotWeights {
                a,
                b,
                rank: *rank,
                scale: *scale,
            });
            dev.set_lora_slot(buf, slot, slot_weights)?;
        }
        Ok(())
    }
}

/// A projection's LoRA as the linear layers take it: `modules` (from
/// [`LayerLora::modules`]) and the batch's slots, or none without modules.
pub fn proj_lora<'a, D: Device>(
    modules: &'a [(&'a D::Lora, usize)],
    meta: &'a AttnMetadata,
) -> ProjLora<'a, D> {
    (!modules.is_empty()).then_some((modules, &meta.lora_slots[..]))
}

/// The targets of `proj` for a layer that may have none.
pub fn layer_modules<'a, D: Device>(
    lora: Option<&'a LayerLora<D>>,
    proj: Proj,
    meta: &AttnMetadata,
) -> Vec<(&'a D::Lora, usize)> {
    lora.map(|l| l.modules(proj, meta)).unwrap_or_default()
}

/// Whether `proj` of a layer applies no adapters this step (then only its GEMM reads the
/// norm before it).
pub fn plain<D: Device>(lora: Option<&LayerLora<D>>, proj: Proj, meta: &AttnMetadata) -> bool {
    lora.is_none_or(|l| !l.applies(proj, meta))
}

/// Places `adapter`'s weights (or clears `slot`) in every layer's buffers, in layer order:
/// a model's `CausalLM::set_lora_slot`.
pub fn set_slot_in_layers<'a, D: Device>(
    dev: &D,
    layers: impl Iterator<Item = Option<&'a mut LayerLora<D>>>,
    slot: usize,
    adapter: Option<&LoraAdapter>,
) -> DevResult<()> {
    for (i, lora) in layers.enumerate() {
        if let Some(l) = lora {
            l.set_slot(dev, i, slot, adapter)?;
        }
    }
    Ok(())
}
