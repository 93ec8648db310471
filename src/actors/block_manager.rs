//! BlockManager actor: owns the KV cache's [`BlockPool`] (block tables, reference counts).
//! Its only client is the Scheduler, which sends one [`Reserve`] per step with the block
//! operations it planned and gets back the block tables of the step's sequences.

use actix::{Actor, Context, Handler, Message};

use crate::core::block_pool::{BlockError, BlockId, BlockOp, BlockPool, SeqId};

/// Applies `ops` in order, then returns the tables of `tables_for`.
#[derive(Message)]
#[rtype(result = "Result<Reserved, BlockError>")]
pub struct Reserve {
    pub ops: Vec<BlockOp>,
    pub tables_for: Vec<SeqId>,
}

#[derive(Debug)]
pub struct Reserved {
    pub tables: Vec<Vec<BlockId>>,
    pub num_free: usize,
}

#[derive(Message)]
#[rtype(result = "BlockStats")]
pub struct GetBlockStats;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStats {
    pub num_free: usize,
    pub num_total: usize,
}

impl BlockStats {
    /// Fraction of the blocks in use (0 to 1).
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.num_total.max(1) as f64
    }
}

pub struct BlockManager {
    pool: BlockPool,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self { pool: BlockPool::new(num_blocks, block_size) }
    }

    fn reserve(&mut self, msg: Reserve) -> Result<Reserved, BlockError> {
        self.pool.apply(&msg.ops)?;
        let tables = msg
            .tables_for
            .iter()
            .map(|&s| self.pool.table(s).map(<[BlockId]>::to_vec).ok_or(BlockError::UnknownSeq(s)))
            .collect::<Result<_, _>>()?;
        Ok(Reserved { tables, num_free: self.pool.num_free() })
    }
}

impl Actor for BlockManager {
    type Context = Context<Self>;
}

impl Handler<Reserve> for BlockManager {
    type Result = Result<Reserved, BlockError>;
    fn handle(&mut self, msg: Reserve, _: &mut Context<Self>) -> Self::Result {
        self.reserve(msg)
    }
}

impl Handler<GetBlockStats> for BlockManager {
    type Result = actix::MessageResult<GetBlockStats>;
    fn handle(&mut self, _: GetBlockStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(BlockStats { num_free: self.pool.num_free(), num_total: self.pool.num_total() })
    }
}
