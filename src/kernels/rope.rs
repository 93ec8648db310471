//! The rotary embedding a device applies: frequencies, their scaling, and how they follow
//! the length of the forward a token is computed in (transformers' dynamic and LongRoPE
//! types re-derive them from that length).

use std::borrow::Cow;

use super::attn::AttnMetadata;

/// Rotary embedding of one attention layer: `inv_freq` has `rotary_dim / 2` entries (the
/// first `rotary_dim` dims of each head rotate, rotate-half style; none when it is empty),
/// and cos and sin are multiplied by `attention_scaling` (1 but for yarn and longrope).
/// `by_len` says which frequencies a token takes at the length it is computed at
/// ([`RopeSpec::lens`]): `inv_freq` at any length for most rope types.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    pub inv_freq: Vec<f32>,
    pub head_dim: usize,
    pub attention_scaling: f32,
    pub by_len: RopeByLen,
}

/// How a rotary embedding's frequencies follow the length of the forward a token is computed
/// in, as transformers' `dynamic_rope_update` re-derives them in each forward of `generate`.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeByLen {
    /// `inv_freq` at every length.
    Fixed,
    /// LongRoPE: at lengths beyond `original`, `long` replace `inv_freq` (the short
    /// factors'). transformers' Phi-3 computes a sequence's whole context again when it
    /// first grows past `original`, so all of a sequence's tokens take the frequencies of
    /// its length: a model with these frequencies asks the runner for that recompute
    /// ([`RopeSpec::recompute_past`]). A cached block's keys therefore depend on the length
    /// its sequence had reached, not on its tokens alone: blocks may be shared only between
    /// sequences on the same side of `original`.
    Long { original: u32, long: Vec<f32> },
    /// Dynamic NTK: beyond `original` (the config's `max_position_embeddings`) the base
    /// `theta` grows with the length L to `theta · (factor · L / original − (factor − 1))^(d / (d − 2))`,
    /// d the rotary dims. A token keeps the frequencies of the forward that computed it.
    Ntk { original: u32, theta: f64, factor: f64 },
}

impl RopeSpec {
    /// No rotation (models with learned positions).
    pub fn none(head_dim: usize) -> Self {
        Self { inv_freq: Vec::new(), head_dim, attention_scaling: 1.0, by_len: RopeByLen::Fixed }
    }

    /// Whether tokens of one step may need different frequencies.
    pub fn varies(&self) -> bool {
        self.by_len != RopeByLen::Fixed
    }

    /// The length past which a sequence's whole context must be computed again, once, for
    /// its cached keys to take these frequencies (LongRoPE's switch); None for most.
    pub fn recompute_past(&self) -> Option<u32> {
        match self.by_len {
            RopeByLen::Long { original, .. } => Some(original),
            _ => None,
        }
    }

    /// The length each token of a step is computed at, as transformers' `generate` runs
    /// it: a prompt's tokens at the whole prompt's length (however the prompt is split
    /// into chunks), a generated token at its position + 1 (dynamic NTK) or, for LongRoPE,
    /// every token of a sequence at the length the step takes the sequence to.
    pub fn lens(&self, meta: &AttnMetadata) -> Vec<u32> {
        let prompt = |t: usize| {
            let seq = meta.token_seq.get(t).map_or(usize::MAX, |&s| s as usize);
            meta.prompt_lens.get(seq).copied().unwrap_or(0)
        };
        let own = |t: usize| meta.positions[t] + 1;
        let n = meta.positions.len();
        match self.by_len {
            RopeByLen::Fixed => vec![0; n],
            RopeByLen::Ntk { .. } => (0..n).map(|t| prompt(t).max(own(t))).collect(),
            RopeByLen::Long { .. } => {
                let mut end = vec![0u32; meta.block_tables.len().max(1)];
                for t in 0..n {
                    let seq = meta.token_seq.get(t).map_or(0, |&s| s as usize);
                    if let Some(e) = end.get_mut(seq) {
                        *e = (*e).max(own(t));
                    }
                }
                (0..n)
                    .map(|t| {
                        let seq = meta.token_seq.get(t).map_or(0, |&s| s as usize);
                        prompt(t).max(end.get(seq).copied().unwrap_or(own(t)))
                    })
                    .collect()
            }
        }
    }

    /// The frequencies of a token computed at length `len`, in f32 as transformers
    /// computes them.
    pub fn inv_freq_at(&self, len: u32) -> Cow<'_, [f32]> {
        match &self.by_len {
            RopeByLen::Long { original, long } if len > *original => Cow::Borrowed(long),
            RopeByLen::Ntk { original, theta, factor } if len > *original => {
                let d = 2 * self.inv_freq.len();
                // transformers computes the new base from a tensor length, in f32.
                let grown = (*factor as f32 * len as f32) / *original as f32 - (*factor - 1.0) as f32;
                let base = *theta as f32 * grown.powf((d as f64 / (d as f64 - 2.0)) as f32);
                let f = (0..d / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32));
                Cow::Owned(f.collect())
            }
            _ => Cow::Borrowed(&self.inv_freq),
        }
    }

    /// Each token's frequencies for a step whose tokens are computed at `lens`
    /// ([`Self::lens`]), one row of `inv_freq.len()` after another: what a device reads
    /// where they vary ([`Self::varies`]).
    pub fn rows(&self, lens: &[u32]) -> Vec<f32> {
        let mut rows = Vec::with_capacity(lens.len() * self.inv_freq.len());
        let mut last: Option<(u32, Cow<'_, [f32]>)> = None;
        for &len in lens {
            if last.as_ref().is_none_or(|(l, _)| *l != len) {
                last = Some((len, self.inv_freq_at(len)));
            }
            rows.extend_from_slice(last.as_ref().map_or(&[][..], |(_, f)| f));
        }
        rows
    }
}
