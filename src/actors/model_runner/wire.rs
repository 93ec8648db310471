//! A [`ShardStep`] as bytes, for ranks in other processes: the inputs as they are, and each
//! adapter to load by its name, path and id (the other node reads it from the same path and
//! keeps its share, as a local rank does).

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::messages::{RunnerError, ShardStep};
use crate::core::block_pool::BlockId;
use crate::kernels::attn::AttnMetadata;
use crate::models::lora::LoraAdapter;

/// An adapter a step places in a slot, as another process finds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireLora {
    pub slot: usize,
    pub id: u64,
    pub name: String,
    pub path: PathBuf,
}

#[derive(Serialize)]
struct Out<'a> {
    ids: &'a [u32],
    meta: &'a AttnMetadata,
    lora_loads: Vec<WireLora>,
    copies: &'a [(BlockId, BlockId)],
    prompt_rows: &'a [usize],
}

#[derive(Deserialize)]
struct In {
    ids: Vec<u32>,
    meta: AttnMetadata,
    lora_loads: Vec<WireLora>,
    copies: Vec<(BlockId, BlockId)>,
    prompt_rows: Vec<usize>,
}

impl ShardStep {
    pub fn encode(&self) -> Vec<u8> {
        let lora_loads = self
            .lora_loads
            .iter()
            .map(|(slot, a)| WireLora { slot: *slot, id: a.id, name: a.name.clone(), path: a.path.clone() })
            .collect();
        let out = Out {
            ids: &self.ids,
            meta: &self.meta,
            lora_loads,
            copies: &self.copies,
            prompt_rows: &self.prompt_rows,
        };
        serde_json::to_vec(&out).expect("a step's inputs serialize")
    }

    /// The step `bytes` encode, its adapters found by `adapter`.
    pub fn decode(
        bytes: &[u8],
        mut adapter: impl FnMut(&WireLora) -> Result<Arc<LoraAdapter>, RunnerError>,
    ) -> Result<ShardStep, RunnerError> {
        let i: In = serde_json::from_slice(bytes)
            .map_err(|e| RunnerError::Device(format!("a step from node 0 does not decode: {e}")))?;
        let lora_loads =
            i.lora_loads.iter().map(|w| Ok((w.slot, adapter(w)?))).collect::<Result<_, RunnerError>>()?;
        Ok(ShardStep {
            ids: i.ids.into(),
            meta: Arc::new(i.meta),
            lora_loads,
            copies: i.copies.into(),
            prompt_rows: i.prompt_rows.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_comes_back_as_it_was_sent() {
        let meta = AttnMetadata {
            positions: vec![0, 1, 7],
            slot_mapping: vec![16, 17, -1],
            token_seq: vec![0, 0, 1],
            block_tables: vec![vec![1], vec![2, 5]],
            last_token_rows: vec![1, 2],
            lora_slots: vec![-1, -1, 0],
            prompt_lens: vec![2, 5],
        };
        let adapter = Arc::new(LoraAdapter {
            id: 9,
            name: "sql".into(),
            path: "/adapters/sql".into(),
            rank: 8,
            scale: 2.0,
            targets: Vec::new(),
            weights: Default::default(),
        });
        let step = ShardStep {
            ids: vec![5, 6, 7].into(),
            meta: Arc::new(meta.clone()),
            lora_loads: vec![(0, adapter)],
            copies: vec![(3, 4)].into(),
            prompt_rows: vec![0].into(),
        };
        let mut asked = Vec::new();
        let back = ShardStep::decode(&step.encode(), |w| {
            asked.push(w.clone());
            Ok(Arc::new(LoraAdapter {
                id: w.id,
                name: w.name.clone(),
                path: w.path.clone(),
                rank: 8,
                scale: 2.0,
                targets: Vec::new(),
                weights: Default::default(),
            }))
        })
        .unwrap();
        assert_eq!(&*back.ids, &[5, 6, 7]);
        assert_eq!(format!("{:?}", back.meta), format!("{meta:?}"));
        assert_eq!(&*back.copies, &[(3, 4)]);
        assert_eq!(&*back.prompt_rows, &[0]);
        assert_eq!(asked.len(), 1);
        assert_eq!((asked[0].slot, asked[0].id, asked[0].name.as_str()), (0, 9, "sql"));
        assert_eq!(asked[0].path, PathBuf::from("/adapters/sql"));
        assert!(ShardStep::decode(b"{}", |_| unreachable!()).is_err());
    }
}
