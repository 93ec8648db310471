//! The paged KV cache's block accounting: a pool of fixed-size blocks, per-sequence block
//! tables and reference counts (children of an n > 1 request share their prompt's full
//! blocks). A plain struct, owned by the BlockManager actor and unit-tested directly.

use std::collections::HashMap;

pub type SeqId = u64;
pub type BlockId = u32;

/// One change to the pool, applied in order by [`BlockPool::apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockOp {
    /// Releases every block of the sequence (shared blocks when their last holder goes).
    Free(SeqId),
    /// Ensures the sequence's table covers `num_tokens` tokens, allocating blocks as needed.
    Grow { seq: SeqId, num_tokens: usize },
    /// Starts `child`'s table with the first `num_blocks` blocks of `parent`'s, shared.
    Fork { parent: SeqId, child: SeqId, num_blocks: usize },
}

/// Whether a number of new blocks can be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocStatus {
    Ok,
    /// Not now; blocks will be freed by running sequences.
    Later,
    /// Never: more than the whole pool.
    Never,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("out of KV cache blocks: {need} needed, {free} free")]
    OutOfBlocks { need: usize, free: usize },
    #[error("sequence {0} holds no blocks (double free or unknown sequence)")]
    UnknownSeq(SeqId),
    #[error("sequence {0} already has a block table")]
    AlreadyExists(SeqId),
}

pub struct BlockPool {
    block_size: usize,
    ref_counts: Vec<u32>,
    free: Vec<BlockId>,
    tables: HashMap<SeqId, Vec<BlockId>>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        // Reversed so that blocks are handed out from 0 upwards.
        let free = (0..num_blocks as BlockId).rev().collect();
        Self { block_size, ref_counts: vec![0; num_blocks], free, tables: HashMap::new() }
    }

    pub fn num_total(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn can_allocate(&self, blocks: usize) -> AllocStatus {
        if blocks > self.num_total() {
            AllocStatus::Never
        } else if blocks > self.num_free() {
            AllocStatus::Later
        } else {
            AllocStatus::Ok
        }
    }

    pub fn table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.tables.get(&seq).map(Vec::as_slice)
    }

    pub fn apply(&mut self, ops: &[BlockOp]) -> Result<(), BlockError> {
        for op in ops {
            match *op {
                BlockOp::Free(seq) => self.free_seq(seq)?,
                BlockOp::Grow { seq, num_tokens } => self.grow(seq, num_tokens)?,
                BlockOp::Fork { parent, child, num_blocks } => self.fork(parent, child, num_blocks)?,
            }
        }
        Ok(())
    }

    fn grow(&mut self, seq: SeqId, num_tokens: usize) -> Result<(), BlockError> {
        let want = num_tokens.div_ceil(self.block_size);
        let have = self.tables.get(&seq).map_or(0, Vec::len);
        let need = want.saturating_sub(have);
        if need > self.free.len() {
            return Err(BlockError::OutOfBlocks { need, free: self.free.len() });
        }
        let table = self.tables.entry(seq).or_default();
        for _ in 0..need {
            let b = self.free.pop().expect("free count checked above");
            self.ref_counts[b as usize] = 1;
            table.push(b);
        }
        Ok(())
    }

    fn fork(&mut self, parent: SeqId, child: SeqId, num_blocks: usize) -> Result<(), BlockError> {
        if self.tables.contains_key(&child) {
            return Err(BlockError::AlreadyExists(child));
        }
        let shared: Vec<BlockId> =
            self.tables.get(&parent).ok_or(BlockError::UnknownSeq(parent))?[..num_blocks].to_vec();
        for &b in &shared {
            self.ref_counts[b as usize] += 1;
        }
        self.tables.insert(child, shared);
        Ok(())
    }

    fn free_seq(&mut self, seq: SeqId) -> Result<(), BlockError> {
        let table = self.tables.remove(&seq).ok_or(BlockError::UnknownSeq(seq))?;
        for b in table {
            let rc = &mut self.ref_counts[b as usize];
            *rc -= 1;
            if *rc == 0 {
                self.free.push(b);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_free_and_double_free() {
        let mut p = BlockPool::new(4, 16);
        p.apply(&[BlockOp::Grow { seq: 1, num_tokens: 17 }]).unwrap();
        assert_eq!(p.table(1).unwrap(), &[0, 1]);
        p.apply(&[BlockOp::Grow { seq: 1, num_tokens: 32 }]).unwrap();
        assert_eq!(p.num_free(), 2);
        p.apply(&[BlockOp::Grow { seq: 1, num_tokens: 33 }]).unwrap();
        assert_eq!(p.num_free(), 1);
        assert_eq!(p.can_allocate(2), AllocStatus::Later);
        assert_eq!(p.can_allocate(5), AllocStatus::Never);
        assert_eq!(
            p.apply(&[BlockOp::Grow { seq: 2, num_tokens: 40 }]),
            Err(BlockError::OutOfBlocks { need: 3, free: 1 })
        );
        p.apply(&[BlockOp::Free(1)]).unwrap();
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.apply(&[BlockOp::Free(1)]), Err(BlockError::UnknownSeq(1)));
    }

    #[test]
    fn forked_blocks_are_shared_until_the_last_holder_frees() {
        let mut p = BlockPool::new(8, 4);
        p.apply(&[
            BlockOp::Grow { seq: 1, num_tokens: 10 },
            BlockOp::Fork { parent: 1, child: 2, num_blocks: 2 },
            BlockOp::Grow { seq: 2, num_tokens: 10 },
        ])
        .unwrap();
        assert_eq!(p.table(2).unwrap()[..2], p.table(1).unwrap()[..2]);
        assert_ne!(p.table(2).unwrap()[2], p.table(1).unwrap()[2]);
        assert_eq!(p.num_free(), 4);
        p.apply(&[BlockOp::Free(1)]).unwrap();
        assert_eq!(p.num_free(), 5, "shared blocks stay while the child holds them");
        p.apply(&[BlockOp::Free(2)]).unwrap();
        assert_eq!(p.num_free(), 8);
    }
}
