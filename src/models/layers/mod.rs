//! Layers shared by model files, with vLLM's names and meaning. Each has `load` (from a
//! prefix-scoped weight view) and `forward` (on a [`Device`]): linear layers split for
//! tensor parallelism, norms, rotary embedding and paged attention, the vocabulary
//! embedding and LM head, learned positions, mixture-of-experts blocks, and a layer's LoRA
//! buffers.

mod attention;
mod linear;
pub mod lora;
mod moe;
mod norm;

pub use attention::{PagedAttention, RotaryEmbedding};
pub use linear::{
    ColumnParallelLinear, MergedColumnParallelLinear, ProjLora, QKVParallelLinear, RowParallelLinear,
    qkv_heads, shard,
};
pub use moe::{ExpertNames, MoeConfig, SparseMoeBlock};
pub use norm::{LayerNorm, Norm, RMSNorm};

use super::ModelError;
use super::loader::{ParamView, Part};
use crate::kernels::{DevResult, Device};

/// This rank's rows of a `[vocab, hidden]` table: `shard = ⌈vocab / world⌉` rows from
/// `rank · shard`, zero-padded to `shard + 1` rows under tensor parallelism (the last row
/// stays zero: tokens of other shards look it up). The whole table for a single rank.
fn load_vocab_shard<D: Device>(
    dev: &D,
    w: &ParamView,
    vocab: usize,
    hidden: usize,
) -> Result<VocabShard<D>, ModelError> {
    let tp = dev.tp();
    if tp.world == 1 {
        return Ok(VocabShard {
            weight: dev.upload(w.get("weight", &[vocab, hidden])?)?,
            start: 0,
            len: vocab,
        });
    }
    let len = vocab.div_ceil(tp.world);
    let start = (tp.rank * len).min(vocab);
    let end = (start + len).min(vocab);
    let mut t = w.get_part("weight", &[vocab, hidden], Part::Rows(start..end))?;
    t.data.to_mut().resize((len + 1) * t.dtype.row_bytes(hidden), 0);
    t.shape[0] = len + 1;
    Ok(VocabShard { weight: dev.upload(t)?, start, len })
}

pub struct VocabShard<D: Device> {
    weight: D::Weight,
    /// First vocabulary id of this rank's rows, and how many ids each rank owns.
    start: usize,
    len: usize,
}

/// Token embedding table `[vocab, hidden]`, split by vocabulary rows over the ranks: each
/// rank embeds the ids it owns (zeros for the others) and an all-reduce joins them.
pub struct VocabParallelEmbedding<D: Device> {
    table: VocabShard<D>,
}

impl<D: Device> VocabParallelEmbedding<D> {
    pub fn load(dev: &D, w: &ParamView, vocab: usize, hidden: usize) -> Result<Self, ModelError> {
        Ok(Self { table: load_vocab_shard(dev, w, vocab, hidden)? })
    }
    pub fn forward(&self, dev: &D, ids: &[u32]) -> DevResult<D::Tensor> {
        if dev.tp().world == 1 {
            return dev.embedding(&self.table.weight, ids);
        }
        let (start, len) = (self.table.start as u32, self.table.len as u32);
        let local: Vec<u32> =
            ids.iter().map(|&id| if id >= start && id - start < len { id - start } else { len }).collect();
        let mut out = dev.embedding(&self.table.weight, &local)?;
        dev.all_reduce(&mut out)?;
        Ok(out)
    }
}

/// The output projection to vocabulary logits (shares the embedding table when tied), split
/// by vocabulary rows like the embedding; the ranks' logits are gathered side by side.
pub enum ParallelLMHead<D: Device> {
    Own(VocabShard<D>),
    Tied,
}

impl<D: Device> ParallelLMHead<D> {
    pub fn load(dev: &D, w: &ParamView, vocab: usize, hidden: usize, tied: bool) -> Result<Self, ModelError> {
        if tied {
            return Ok(Self::Tied);
        }
        Ok(Self::Own(load_vocab_shard(dev, w, vocab, hidden)?))
    }
    /// `[n, hidden]` → `[n, vocab]` on every rank.
    pub fn forward(
        &self,
        dev: &D,
        hidden: &D::Tensor,
        embed: &VocabParallelEmbedding<D>,
        vocab: usize,
    ) -> DevResult<D::Tensor> {
        let t = match self {
            Self::Own(t) => t,
            Self::Tied => &embed.table,
        };
        let logits = dev.linear(hidden, &t.weight, None)?;
        if dev.tp().world == 1 {
            return Ok(logits);
        }
        dev.all_gather_cols(&logits, t.len, vocab)
    }
}

/// The rows of each sequence's last token, gathered, or None when they are every row in
/// order (decode steps not padded, such as batch 1's): the hidden states then serve as they
/// are, with the 16-bit copy the final norm wrote for the GEMM. Gathered, they would be
/// copied, and converted again for a 16-bit lm_head: on the H200 two kernels between the
/// last layer and lm_head at batch 1.
pub fn gather_last_rows<D: Device>(
    dev: &D,
    hidden: &D::Tensor,
    meta: &crate::kernels::attn::AttnMetadata,
) -> DevResult<Option<D::Tensor>> {
    let rows = &meta.last_token_rows;
    let all = dev.shape(hidden).0 == rows.len() && rows.iter().enumerate().all(|(i, &r)| i == r);
    match all {
        true => Ok(None),
        false => dev.gather_rows(hidden, rows).map(Some), // [num_seqs, hidden]
    }
}

/// Learned absolute position embeddings (OPT's), `[max_positions + offset, hidden]`,
/// replicated on every rank: position p reads row p + offset.
pub struct LearnedPositions<D: Device> {
    weight: D::Weight,
    offset: u32,
}

impl<D: Device> LearnedPositions<D> {
    pub fn load(dev: &D, w: &ParamView, rows: usize, hidden: usize, offset: u32) -> Result<Self, ModelError> {
        Ok(Self { weight: dev.upload(w.get("weight", &[rows, hidden])?)?, offset })
    }
    /// `[n]` positions → `[n, hidden]`.
    pub fn forward(&self, dev: &D, positions: &[u32]) -> DevResult<D::Tensor> {
        dev.embed_positions(&self.weight, positions, self.offset)
    }
}
