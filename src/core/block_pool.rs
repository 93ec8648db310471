//! The paged KV cache's block accounting: a pool of fixed-size blocks, per-sequence block
//! tables and reference counts (children of an n > 1 request share their prompt's full
//! blocks), and the prefix cache: a full block whose tokens are computed is keyed by a
//! chained hash of (the blocks before it, its tokens, its LoRA adapter), so that a later
//! sequence starting with the same tokens adopts it instead of computing it again. A block
//! no sequence holds keeps its key, and its contents, until it is evicted (least recently
//! freed first) to serve an allocation when no uncached block is free. A plain struct,
//! owned by the BlockManager actor, mirrored by the Scheduler (which plans against a replica
//! fed the same operations), and unit-tested directly.

use std::collections::{BTreeMap, HashMap};

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
    /// Starts `seq`'s table with the cached blocks of `keys`, in order (a prefix-cache hit).
    Adopt { seq: SeqId, keys: Vec<BlockKey> },
    /// Block `index` of `seq`'s table holds `key`'s tokens, computed: later sequences may
    /// adopt it.
    Cache { seq: SeqId, index: usize, key: BlockKey },
}

/// What a cached block holds: `hash` chains the hashes of the blocks before it with its
/// own tokens and adapter ([`BlockKey::chain`]); the tokens and adapter themselves are kept
/// too, so that two blocks whose hashes collide are never confused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockKey {
    pub hash: u64,
    pub tokens: Box<[u32]>,
    pub lora: Option<u64>,
}

impl BlockKey {
    /// The key of the block of `tokens` after a block hashed `parent` (0 for the first).
    pub fn chain(parent: u64, tokens: &[u32], lora: Option<u64>) -> Self {
        use std::hash::{Hash, Hasher};
        // SipHash with fixed keys: the same tokens hash alike in every process.
        let mut h = std::hash::DefaultHasher::new();
        (parent, lora, tokens).hash(&mut h);
        Self { hash: h.finish(), tokens: tokens.into(), lora }
    }
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
    #[error("no cached block holds hash {0:016x}")]
    NotCached(u64),
}

pub struct BlockPool {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Free blocks that hold no cached key.
    free: Vec<BlockId>,
    tables: HashMap<SeqId, Vec<BlockId>>,
    /// Each block's key while it is cached.
    keys: Vec<Option<BlockKey>>,
    /// Cached blocks by hash (more than one only when hashes collide).
    cached: HashMap<u64, Vec<BlockId>>,
    /// Cached blocks no sequence holds, by when they were freed: the first is evicted first.
    evictable: BTreeMap<u64, BlockId>,
    /// Each evictable block's place in `evictable`.
    freed_at: Vec<u64>,
    clock: u64,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        // Reversed so that blocks are handed out from 0 upwards.
        let free = (0..num_blocks as BlockId).rev().collect();
        Self {
            block_size,
            ref_counts: vec![0; num_blocks],
            free,
            tables: HashMap::new(),
            keys: vec![None; num_blocks],
            cached: HashMap::new(),
            evictable: BTreeMap::new(),
            freed_at: vec![0; num_blocks],
            clock: 0,
        }
    }

    pub fn num_total(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks an allocation can have: the free ones and the cached ones no sequence holds.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Cached blocks, held or not.
    pub fn num_cached(&self) -> usize {
        self.keys.iter().filter(|k| k.is_some()).count()
    }

    /// The cached block holding `key`, if any.
    pub fn lookup(&self, key: &BlockKey) -> Option<BlockId> {
        let blocks = self.cached.get(&key.hash)?;
        blocks.iter().copied().find(|&b| self.keys[b as usize].as_ref() == Some(key))
    }

    /// Whether adopting `block` takes one from the free count (no sequence holds it).
    pub fn is_evictable(&self, block: BlockId) -> bool {
        self.ref_counts[block as usize] == 0
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
                BlockOp::Adopt { seq, ref keys } => self.adopt(seq, keys)?,
                BlockOp::Cache { seq, index, ref key } => self.cache(seq, index, key)?,
            }
        }
        Ok(())
    }

    /// A block for a new holder: a free one, else the least recently freed cached one,
    /// whose key goes.
    fn take_block(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                let key = self.keys[b as usize].take().expect("evictable blocks are cached");
                if let Some(list) = self.cached.get_mut(&key.hash) {
                    list.retain(|&x| x != b);
                    if list.is_empty() {
                        self.cached.remove(&key.hash);
                    }
                }
                b
            }
        };
        self.ref_counts[b as usize] = 1;
        Some(b)
    }

    fn adopt(&mut self, seq: SeqId, keys: &[BlockKey]) -> Result<(), BlockError> {
        if self.tables.contains_key(&seq) {
            return Err(BlockError::AlreadyExists(seq));
        }
        let blocks = keys
            .iter()
            .map(|k| self.lookup(k).ok_or(BlockError::NotCached(k.hash)))
            .collect::<Result<Vec<_>, _>>()?;
        for &b in &blocks {
            if self.ref_counts[b as usize] == 0 {
                self.evictable.remove(&self.freed_at[b as usize]);
            }
            self.ref_counts[b as usize] += 1;
        }
        self.tables.insert(seq, blocks);
        Ok(())
    }

    fn cache(&mut self, seq: SeqId, index: usize, key: &BlockKey) -> Result<(), BlockError> {
        let b = *self
            .tables
            .get(&seq)
            .ok_or(BlockError::UnknownSeq(seq))?
            .get(index)
            .ok_or(BlockError::UnknownSeq(seq))?;
        // A block keyed already (shared by forks), or tokens another block holds: one copy
        // is enough.
        if self.keys[b as usize].is_some() || self.lookup(key).is_some() {
            return Ok(());
        }
        self.cached.entry(key.hash).or_default().push(b);
        self.keys[b as usize] = Some(key.clone());
        Ok(())
    }

    fn grow(&mut self, seq: SeqId, num_tokens: usize) -> Result<(), BlockError> {
        let want = num_tokens.div_ceil(self.block_size);
        let have = self.tables.get(&seq).map_or(0, Vec::len);
        let need = want.saturating_sub(have);
        if need > self.num_free() {
            return Err(BlockError::OutOfBlocks { need, free: self.num_free() });
        }
        let new: Vec<BlockId> =
            (0..need).map(|_| self.take_block().expect("free count checked above")).collect();
        self.tables.entry(seq).or_default().extend(new);
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
        for &b in &table {
            let rc = &mut self.ref_counts[b as usize];
            *rc -= 1;
            if *rc == 0 && self.keys[b as usize].is_none() {
                self.free.push(b);
            }
        }
        // Cached blocks stay, last block first: of a freed prefix, the tail is evicted
        // before the head.
        for &b in table.iter().rev() {
            if self.ref_counts[b as usize] == 0 && self.keys[b as usize].is_some() {
                self.clock += 1;
                self.freed_at[b as usize] = self.clock;
                self.evictable.insert(self.clock, b);
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

    /// Beams fork from beams that were forked themselves: a prompt block then has three
    /// holders, and comes back only when the last beam lets it go, whatever the order.
    #[test]
    fn beams_forked_from_forks_share_blocks_until_the_last_beam_goes() {
        let mut p = BlockPool::new(8, 4);
        p.apply(&[
            BlockOp::Grow { seq: 1, num_tokens: 6 },
            BlockOp::Fork { parent: 1, child: 2, num_blocks: 1 },
            BlockOp::Grow { seq: 2, num_tokens: 6 },
            BlockOp::Grow { seq: 2, num_tokens: 9 },
            BlockOp::Fork { parent: 2, child: 3, num_blocks: 2 },
            BlockOp::Grow { seq: 3, num_tokens: 9 },
        ])
        .unwrap();
        let (t1, t2, t3) = (p.table(1).unwrap(), p.table(2).unwrap(), p.table(3).unwrap());
        assert!(t1[0] == t2[0] && t2[0] == t3[0], "the prompt block is everyone's");
        assert_eq!(t2[1], t3[1], "the grandchild shares its parent's second block");
        assert!(t1[1] != t2[1] && t2[2] != t3[2]);
        assert_eq!(p.num_free(), 8 - 5);
        p.apply(&[BlockOp::Free(2)]).unwrap();
        assert_eq!(p.num_free(), 4, "only beam 2's last block was its alone");
        p.apply(&[BlockOp::Free(1)]).unwrap();
        assert_eq!(p.num_free(), 5, "beam 3 still holds the prompt block");
        p.apply(&[BlockOp::Free(3)]).unwrap();
        assert_eq!(p.num_free(), 8);
    }

    fn key(parent: u64, tokens: &[u32]) -> BlockKey {
        BlockKey::chain(parent, tokens, None)
    }

    /// A sequence of two full blocks caches them; a later one adopts them, and they are
    /// held twice, then cached again, evictable, once both are gone.
    #[test]
    fn cached_blocks_are_adopted_and_stay_after_their_holders_go() {
        let mut p = BlockPool::new(4, 2);
        let (a, b) = (key(0, &[1, 2]), key(key(0, &[1, 2]).hash, &[3, 4]));
        p.apply(&[
            BlockOp::Grow { seq: 1, num_tokens: 5 },
            BlockOp::Cache { seq: 1, index: 0, key: a.clone() },
            BlockOp::Cache { seq: 1, index: 1, key: b.clone() },
        ])
        .unwrap();
        assert_eq!((p.num_free(), p.num_cached()), (1, 2));
        p.apply(&[BlockOp::Adopt { seq: 2, keys: vec![a.clone(), b.clone()] }]).unwrap();
        assert_eq!(p.table(2).unwrap(), &p.table(1).unwrap()[..2]);
        assert_eq!(p.num_free(), 1, "held blocks adopted take nothing from the free count");
        p.apply(&[BlockOp::Free(1), BlockOp::Free(2)]).unwrap();
        assert_eq!((p.num_free(), p.num_cached()), (4, 2), "freed, and still cached");
        // Adopting an unheld cached block takes it from the free count.
        p.apply(&[BlockOp::Adopt { seq: 3, keys: vec![a.clone()] }]).unwrap();
        assert_eq!(p.num_free(), 3);
        assert!(!p.is_evictable(p.table(3).unwrap()[0]));
        // A key no block holds is an error, not a silent miss.
        let missing = key(7, &[9, 9]);
        assert_eq!(
            p.apply(&[BlockOp::Adopt { seq: 4, keys: vec![missing.clone()] }]),
            Err(BlockError::NotCached(missing.hash))
        );
    }

    /// Two keys with the same hash and different tokens (a collision) are two entries: a
    /// lookup finds only the block whose tokens and adapter match.
    #[test]
    fn colliding_hashes_never_confuse_two_blocks() {
        let mut p = BlockPool::new(4, 2);
        let a = key(0, &[1, 2]);
        let forged = BlockKey { hash: a.hash, tokens: vec![5, 6].into(), lora: None };
        let adapter = BlockKey { lora: Some(3), ..a.clone() };
        p.apply(&[
            BlockOp::Grow { seq: 1, num_tokens: 2 },
            BlockOp::Cache { seq: 1, index: 0, key: a.clone() },
            BlockOp::Grow { seq: 2, num_tokens: 2 },
            BlockOp::Cache { seq: 2, index: 0, key: forged.clone() },
        ])
        .unwrap();
        assert_eq!(p.lookup(&a), Some(p.table(1).unwrap()[0]));
        assert_eq!(p.lookup(&forged), Some(p.table(2).unwrap()[0]));
        assert_eq!(p.lookup(&adapter), None, "another adapter's block is another block");
        assert_ne!(BlockKey::chain(0, &[1, 2], Some(3)).hash, a.hash);
        // Evicting one leaves the other's entry.
        let held = p.table(2).unwrap()[0];
        p.apply(&[BlockOp::Free(1), BlockOp::Free(2), BlockOp::Grow { seq: 3, num_tokens: 6 }]).unwrap();
        assert_eq!(p.lookup(&a), None, "the least recently freed went");
        assert_eq!(p.lookup(&forged), Some(held));
    }

    /// Uncached free blocks go first; then cached ones, least recently freed first and, of
    /// one sequence's, its last block before its first.
    #[test]
    fn eviction_takes_the_least_recently_freed_tail_first() {
        let mut p = BlockPool::new(5, 1);
        let keys: Vec<BlockKey> = (0..4).map(|i| key(i, &[i as u32])).collect();
        let mut ops = vec![BlockOp::Grow { seq: 1, num_tokens: 2 }, BlockOp::Grow { seq: 2, num_tokens: 2 }];
        ops.extend((0..4).map(|i| BlockOp::Cache {
            seq: 1 + i as u64 / 2,
            index: i % 2,
            key: keys[i].clone(),
        }));
        p.apply(&ops).unwrap();
        let (t1, t2) = (p.table(1).unwrap().to_vec(), p.table(2).unwrap().to_vec());
        p.apply(&[BlockOp::Free(2), BlockOp::Free(1)]).unwrap();
        assert_eq!(p.num_free(), 5);
        // One uncached block, then seq 2's tail, seq 2's head, seq 1's tail.
        p.apply(&[BlockOp::Grow { seq: 3, num_tokens: 4 }]).unwrap();
        assert_eq!(&p.table(3).unwrap()[1..], &[t2[1], t2[0], t1[1]]);
        assert_eq!(p.lookup(&keys[0]), Some(t1[0]), "the least recently evictable stays");
        assert_eq!(p.lookup(&keys[1]), None);
        assert_eq!(p.num_cached(), 1);
    }

    /// Blocks shared by the children of an n > 1 request are cached once, and stay held
    /// until the last child frees them.
    #[test]
    fn forked_blocks_cache_once_and_stay_held_until_the_last_child() {
        let mut p = BlockPool::new(6, 2);
        let a = key(0, &[1, 2]);
        p.apply(&[
            BlockOp::Grow { seq: 1, num_tokens: 3 },
            BlockOp::Fork { parent: 1, child: 2, num_blocks: 1 },
            BlockOp::Grow { seq: 2, num_tokens: 3 },
            BlockOp::Cache { seq: 1, index: 0, key: a.clone() },
            BlockOp::Cache { seq: 2, index: 0, key: a.clone() },
        ])
        .unwrap();
        assert_eq!(p.num_cached(), 1);
        p.apply(&[BlockOp::Free(1)]).unwrap();
        assert!(!p.is_evictable(p.lookup(&a).unwrap()), "the child still holds it");
        p.apply(&[BlockOp::Free(2)]).unwrap();
        assert!(p.is_evictable(p.lookup(&a).unwrap()));
        assert_eq!(p.num_free(), 6);
    }
}
