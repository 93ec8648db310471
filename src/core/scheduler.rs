//! Continuous batching, as a plain struct: waiting and running queues, a token budget per
//! step, first come first served (or, with the priority policy, by each request's priority
//! and then arrival, a waiting request preempting worse running ones), chunked prefill, preemption by recompute when the KV
//! cache runs out, and automatic prefix caching: a sequence admitted with a prompt whose
//! leading full blocks are cached adopts them and computes only the rest, and every full
//! block a sequence computes is offered to the cache. It plans block operations against a
//! replica of the pool fed the same operations in the same order (it is the pool's only
//! client), so that the BlockManager can apply each step's plan in one message.

use std::collections::{HashMap, HashSet, VecDeque};

use super::block_pool::{AllocStatus, BlockId, BlockKey, BlockOp, BlockPool, SeqId};
use super::lora_slots::LoraSlots;

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Adapter slots (`--max-loras`); 0 when LoRA is off.
    pub max_loras: usize,
    /// Automatic prefix caching (`--enable-prefix-caching`).
    pub prefix_caching: bool,
    /// `--scheduling-policy priority`: queues ordered by (priority, arrival), lower first.
    pub priority: bool,
}

/// A request's sequences (n > 1 gives several), which share its full prompt blocks when
/// admitted together.
#[derive(Debug)]
struct Group {
    seqs: Vec<SeqId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    Finished,
}

#[derive(Debug)]
pub struct Sequence {
    pub id: SeqId,
    pub group: u64,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub num_computed: usize,
    pub status: SeqStatus,
    /// The adapter (by load id) this sequence runs with.
    pub lora: Option<u64>,
    /// Whether the ModelRunner holds this sequence's state (set false on preemption).
    pub registered: bool,
    /// Prompt tokens whose blocks came from the prefix cache when it was first admitted.
    pub cached_tokens: usize,
    /// Full blocks of `tokens` offered to the prefix cache, and the last one's hash.
    hashed: usize,
    last_hash: u64,
    /// Never preempted: may share its group's prompt blocks on admission.
    fresh: bool,
    /// Tokens (prompt included) at which it ends whatever it samples (`max_tokens`, the
    /// context length): once that many are known or pending, it needs no further step.
    max_len: usize,
    /// The request's priority (lower goes first) under the priority policy.
    priority: i64,
    /// A beam of a beam search: its next token is chosen by the host from its step's
    /// log-probabilities, so it takes no step while one is out (`awaiting`: the tokens that
    /// step computed), and none is planned ahead with a pending token. Once it has
    /// `answered` it takes no step until the search extends it: it holds its blocks, but a
    /// sibling that cannot otherwise be admitted may preempt it.
    beam: bool,
    awaiting: Option<usize>,
    answered: bool,
    /// Its prompt is computed whole, reading nothing from the prefix cache: the runner
    /// reports each prompt position's logprobs as it computes it (`prompt_logprobs`).
    whole_prompt: bool,
}

impl Sequence {
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// One sequence's work in a step: tokens `start..start + len` of its token list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq: SeqId,
    pub start: usize,
    pub len: usize,
    /// The chunk reaches the end of the sequence: a token is sampled.
    pub sample: bool,
    /// Adapter slot, -1 for the base model.
    pub lora_slot: i32,
}

/// A step's plan: block operations to apply first, then the sequences to run.
#[derive(Debug, Default)]
pub struct StepPlan {
    pub ops: Vec<BlockOp>,
    pub seqs: Vec<ScheduledSeq>,
    /// Sequences the runner should forget (finished, aborted or preempted).
    pub dropped: Vec<SeqId>,
    pub num_preempted: usize,
    /// (slot, adapter) pairs whose weights must be loaded before this step runs.
    pub lora_loads: Vec<(usize, u64)>,
    /// (source, destination) blocks whose keys and values are copied before this step runs:
    /// a forked beam's copy of its parent's last, partly filled block.
    pub copies: Vec<(BlockId, BlockId)>,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    seqs: HashMap<SeqId, Sequence>,
    groups: HashMap<u64, Group>,
    /// The pool as the BlockManager will have it once it has applied `pending_ops`.
    pool: BlockPool,
    pending_ops: Vec<BlockOp>,
    pending_dropped: Vec<SeqId>,
    pending_copies: Vec<(BlockId, BlockId)>,
    next_seq: SeqId,
    lora_slots: LoraSlots,
    /// Preemptions since start.
    pub total_preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and those found (vLLM's
    /// `prefix_cache_queries` and `prefix_cache_hits`).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Self {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            seqs: HashMap::new(),
            groups: HashMap::new(),
            pool: BlockPool::new(cfg.num_blocks, cfg.block_size),
            pending_ops: Vec::new(),
            pending_dropped: Vec::new(),
            pending_copies: Vec::new(),
            next_seq: 0,
            lora_slots: LoraSlots::new(cfg.max_loras),
            total_preemptions: 0,
            prefix_queries: 0,
            prefix_hits: 0,
        }
    }

    /// Applies `op` to the replica and queues it for the BlockManager, in the same order.
    fn op(&mut self, op: BlockOp) {
        self.pool
            .apply(std::slice::from_ref(&op))
            .expect("the scheduler plans within its replica of the pool");
        self.pending_ops.push(op);
    }

    fn table_len(&self, id: SeqId) -> usize {
        self.pool.table(id).map_or(0, <[_]>::len)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Whether a prompt can ever be admitted.
    pub fn check_prompt(&self, prompt_len: usize) -> AllocStatus {
        if self.blocks_for(prompt_len + 1) > self.cfg.num_blocks {
            AllocStatus::Never
        } else {
            AllocStatus::Ok
        }
    }

    /// Queues a group of `n` sequences with the same prompt; returns their ids.
    pub fn add(&mut self, group: u64, prompt: &[u32], n: usize, lora: Option<u64>) -> Vec<SeqId> {
        let ids: Vec<SeqId> = (0..n as u64).map(|i| self.next_seq + i).collect();
        self.next_seq += n as u64;
        for &id in &ids {
            self.seqs.insert(
                id,
                Sequence {
                    id,
                    group,
                    tokens: prompt.to_vec(),
                    prompt_len: prompt.len(),
                    num_computed: 0,
                    status: SeqStatus::Waiting,
                    lora,
                    registered: false,
                    cached_tokens: 0,
                    hashed: 0,
                    last_hash: 0,
                    fresh: true,
                    max_len: usize::MAX,
                    priority: 0,
                    beam: false,
                    awaiting: None,
                    answered: false,
                    whole_prompt: false,
                },
            );
            self.waiting.push_back(id);
        }
        self.groups.insert(group, Group { seqs: ids.clone() });
        ids
    }

    /// Sets the token count at which the group's sequences end for certain.
    pub fn set_max_len(&mut self, group: u64, max_len: usize) {
        let Some(g) = self.groups.get(&group) else { return };
        for id in &g.seqs {
            if let Some(s) = self.seqs.get_mut(id) {
                s.max_len = max_len;
            }
        }
    }

    /// Sets the group's priority (lower goes first); under the priority policy the waiting
    /// queue takes it into account at once.
    /// The group's first sequence computes its whole prompt (it reports the prompt's
    /// logprobs; the others, sharing its prompt, report none).
    pub fn set_whole_prompt(&mut self, group: u64) {
        let Some(&first) = self.groups.get(&group).and_then(|g| g.seqs.first()) else { return };
        if let Some(s) = self.seqs.get_mut(&first) {
            s.whole_prompt = true;
        }
    }

    pub fn set_priority(&mut self, group: u64, priority: i64) {
        let Some(g) = self.groups.get(&group) else { return };
        for id in &g.seqs {
            if let Some(s) = self.seqs.get_mut(id) {
                s.priority = priority;
            }
        }
        if self.cfg.priority {
            let seqs = &self.seqs;
            self.waiting.make_contiguous().sort_by_key(|id| (seqs[id].priority, *id));
        }
    }

    /// Where a sequence stands in the priority policy's order: lower goes first (ids rise
    /// with arrival).
    fn rank(&self, id: SeqId) -> (i64, SeqId) {
        (self.seqs[&id].priority, id)
    }

    /// Puts `id` back in the waiting queue: at its head (first come first served: it came
    /// before every waiting one), or at its place in the priority order.
    fn requeue(&mut self, id: SeqId) {
        if !self.cfg.priority {
            self.waiting.push_front(id);
            return;
        }
        let at =
            self.waiting.iter().position(|&w| self.rank(w) > self.rank(id)).unwrap_or(self.waiting.len());
        self.waiting.insert(at, id);
    }

    /// Under the priority policy, preempts the worst running sequences while the best
    /// waiting one ranks above them and cannot start for want of a batch place or blocks.
    fn preempt_for_priority(&mut self, plan: &mut StepPlan) {
        while let (Some(&w), Some(&r)) = (self.waiting.front(), self.running.last()) {
            if self.rank(w) >= self.rank(r) {
                break;
            }
            let chunk = self.seqs[&w].tokens.len().min(self.cfg.max_num_batched_tokens);
            let no_place = self.running.len() >= self.cfg.max_num_seqs;
            if !no_place && self.blocks_for(chunk) <= self.pool.num_free() {
                break;
            }
            self.preempt(r);
            plan.num_preempted += 1;
        }
    }

    pub fn seq(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Blocks an allocation can have (free, or cached and held by no sequence).
    pub fn free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Adapter slots holding an adapter.
    pub fn lora_slots_used(&self) -> usize {
        self.lora_slots.occupied()
    }

    /// The adapters (by load id) of the running sequences and of the waiting ones, each
    /// once, in ascending order.
    pub fn adapters_in_use(&self) -> (Vec<u64>, Vec<u64>) {
        let of = |ids: &mut dyn Iterator<Item = &SeqId>| {
            let set: std::collections::BTreeSet<u64> = ids.filter_map(|id| self.seqs[id].lora).collect();
            set.into_iter().collect::<Vec<_>>()
        };
        (of(&mut self.running.iter()), of(&mut self.waiting.iter()))
    }

    fn slot_of(&self, id: SeqId) -> i32 {
        self.seqs[&id].lora.and_then(|a| self.lora_slots.slot_of(a)).map_or(-1, |s| s as i32)
    }

    /// Adapters pinned by running sequences.
    fn pinned(&self) -> HashSet<u64> {
        self.running.iter().filter_map(|id| self.seqs[id].lora).collect()
    }

    /// A slot for `adapter` ahead of any request (adapters named at start-up): the slot its
    /// weights must be loaded into, or None when it holds one already or none is free of
    /// running sequences' adapters.
    pub fn preload_lora(&mut self, adapter: u64) -> Option<usize> {
        let pinned = self.pinned();
        self.lora_slots.acquire(adapter, &pinned).filter(|a| a.load).map(|a| a.slot)
    }

    /// Makes sure `id`'s adapter has a slot; false when every slot is pinned by others.
    fn claim_lora(&mut self, id: SeqId, plan: &mut StepPlan) -> bool {
        let Some(adapter) = self.seqs[&id].lora else { return true };
        let pinned = self.pinned();
        match self.lora_slots.acquire(adapter, &pinned) {
            Some(a) => {
                if a.load {
                    plan.lora_loads.retain(|(s, _)| *s != a.slot);
                    plan.lora_loads.push((a.slot, adapter));
                }
                true
            }
            None => false,
        }
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Pending block operations or runner drops that a step must deliver even with no work.
    pub fn has_pending(&self) -> bool {
        !self.pending_ops.is_empty() || !self.pending_dropped.is_empty() || !self.pending_copies.is_empty()
    }

    /// Frees a sequence's blocks (cached ones stay cached until evicted).
    fn release(&mut self, id: SeqId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.hashed = 0;
            seq.last_hash = 0;
        }
        if self.pool.table(id).is_some() {
            self.op(BlockOp::Free(id));
        }
    }

    fn forget_on_runner(&mut self, id: SeqId) {
        if let Some(seq) = self.seqs.get_mut(&id)
            && seq.registered
        {
            seq.registered = false;
            self.pending_dropped.push(id);
        }
    }

    /// Ends a sequence (stop condition or abort): frees its blocks at the next step.
    pub fn finish(&mut self, id: SeqId) {
        self.release(id);
        self.forget_on_runner(id);
        self.running.retain(|&s| s != id);
        self.waiting.retain(|&s| s != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.status = SeqStatus::Finished;
        }
    }

    /// Forgets a group whose sequences have all finished.
    pub fn remove_group(&mut self, group: u64) {
        if let Some(g) = self.groups.remove(&group) {
            for id in g.seqs {
                self.finish(id);
                self.seqs.remove(&id);
            }
        }
    }

    pub(crate) fn preempt(&mut self, id: SeqId) {
        self.release(id);
        self.forget_on_runner(id);
        self.running.retain(|&s| s != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.num_computed = 0;
            seq.status = SeqStatus::Waiting;
            seq.fresh = false;
            // A beam samples again once readmitted; the step out now may still answer.
            seq.awaiting = None;
        }
        self.requeue(id);
        self.total_preemptions += 1;
    }

    /// Reserves `tokens` of cache for `id`; false if the pool lacks the blocks.
    fn reserve(&mut self, id: SeqId, tokens: usize) -> bool {
        let need = self.blocks_for(tokens).saturating_sub(self.table_len(id));
        if need > self.pool.num_free() {
            return false;
        }
        self.op(BlockOp::Grow { seq: id, num_tokens: tokens });
        true
    }

    /// Offers `id`'s full blocks of known tokens below `upto` to the prefix cache: those
    /// computed, or computed by the step being planned. A sequence admitted later adopts
    /// them; steps run in order, and within one forward every key and value is written
    /// before attention reads any, so a block is there for whoever reads it.
    fn offer_blocks(&mut self, id: SeqId, upto: usize) {
        if !self.cfg.prefix_caching {
            return;
        }
        let bs = self.cfg.block_size;
        loop {
            let seq = &self.seqs[&id];
            let (i, end) = (seq.hashed, (seq.hashed + 1) * bs);
            if end > upto || end > seq.tokens.len() || seq.tokens[i * bs..end].contains(&PENDING) {
                return;
            }
            let key = BlockKey::chain(seq.last_hash, &seq.tokens[i * bs..end], seq.lora);
            let hash = key.hash;
            self.op(BlockOp::Cache { seq: id, index: i, key });
            let seq = self.seqs.get_mut(&id).expect("looked up above");
            seq.hashed += 1;
            seq.last_hash = hash;
        }
    }

    /// The keys of the leading full blocks of `id`'s tokens that the cache holds, leaving
    /// at least its last token to compute (the one whose logits are sampled).
    fn prefix_hits(&self, id: SeqId) -> Vec<BlockKey> {
        let seq = &self.seqs[&id];
        let bs = self.cfg.block_size;
        let mut keys = Vec::new();
        if !self.cfg.prefix_caching || seq.whole_prompt {
            return keys;
        }
        let mut parent = 0;
        for block in seq.tokens[..seq.tokens.len() - 1].chunks_exact(bs) {
            if block.contains(&PENDING) {
                break;
            }
            let key = BlockKey::chain(parent, block, seq.lora);
            if self.pool.lookup(&key).is_none() {
                break;
            }
            parent = key.hash;
            keys.push(key);
        }
        keys
    }

    /// Plans the next step. Returns None when there is nothing to run or deliver.
    pub fn schedule(&mut self) -> Option<StepPlan> {
        let mut plan = StepPlan::default();
        // Blocks whose tokens became known since they were computed (sampled tokens).
        if self.cfg.prefix_caching {
            for i in 0..self.running.len() {
                let id = self.running[i];
                self.offer_blocks(id, self.seqs[&id].num_computed);
            }
        }
        if self.cfg.priority {
            self.preempt_for_priority(&mut plan);
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        let before = plan.num_preempted;
        self.schedule_running(&mut plan, &mut budget);
        // Out of blocks for the running ones: nothing new starts this step.
        if plan.num_preempted == before {
            self.schedule_waiting(&mut plan, &mut budget);
        }
        plan.ops = std::mem::take(&mut self.pending_ops);
        plan.dropped = std::mem::take(&mut self.pending_dropped);
        plan.copies = std::mem::take(&mut self.pending_copies);
        if plan.seqs.is_empty() && plan.ops.is_empty() && plan.dropped.is_empty() && plan.copies.is_empty() {
            return None;
        }
        Some(plan)
    }

    fn schedule_running(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            if self.seqs[&id].awaiting.is_some() || self.seqs[&id].answered {
                i += 1;
                continue;
            }
            let (start, total) = (self.seqs[&id].num_computed, self.seqs[&id].tokens.len());
            // Its last token is pending (a step planned before the last one's tokens came
            // back): it ends there, so it is given no step more.
            if total >= self.seqs[&id].max_len && start + 1 >= total {
                i += 1;
                continue;
            }
            let len = (total - start).min(*budget);
            let mut scheduled = false;
            loop {
                if self.reserve(id, start + len) {
                    scheduled = true;
                    break;
                }
                // Out of blocks: preempt the lowest-priority (last) running sequence (the
                // latest admitted, or the worst ranked under the priority policy).
                let victim = *self.running.last().expect("running holds at least `id`");
                self.preempt(victim);
                plan.num_preempted += 1;
                if victim == id {
                    break;
                }
            }
            if !scheduled {
                break;
            }
            let lora_slot = self.slot_of(id);
            plan.seqs.push(ScheduledSeq { seq: id, start, len, sample: start + len == total, lora_slot });
            self.offer_blocks(id, start + len);
            *budget -= len;
            i += 1;
        }
    }

    fn schedule_waiting(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let mut i = 0;
        while let Some(&id) = self.waiting.get(i) {
            // A beam that has answered waits for the search to extend it.
            if self.seqs[&id].answered {
                i += 1;
                continue;
            }
            if *budget == 0 {
                break;
            }
            if self.running.len() >= self.cfg.max_num_seqs {
                if self.preempt_answered_beam(plan) {
                    i = 0;
                    continue;
                }
                break;
            }
            // Every adapter slot is pinned by other adapters: this one waits, later ones
            // (base model or a resident adapter) may still go.
            if !self.claim_lora(id, plan) {
                i += 1;
                continue;
            }
            if self.try_admit_group(id, plan, budget) {
                continue;
            }
            let total = self.seqs[&id].tokens.len();
            let hits = self.prefix_hits(id);
            let start = hits.len() * self.cfg.block_size;
            let len = (total - start).min(*budget);
            // Cached blocks no one holds leave the free count when adopted.
            let idle = hits
                .iter()
                .filter(|k| self.pool.lookup(k).is_some_and(|b| self.pool.is_evictable(b)))
                .count();
            // A prompt whose first chunk cannot fit now waits (FCFS: nobody overtakes it).
            if self.blocks_for(start + len) - hits.len() + idle > self.pool.num_free() {
                if self.preempt_answered_beam(plan) {
                    i = 0;
                    continue;
                }
                break;
            }
            if self.cfg.prefix_caching {
                self.prefix_queries += total as u64;
                self.prefix_hits += start as u64;
            }
            let (n, last) = (hits.len(), hits.last().map_or(0, |k| k.hash));
            if n > 0 {
                self.op(BlockOp::Adopt { seq: id, keys: hits });
            }
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.num_computed = start;
                seq.hashed = n;
                seq.last_hash = last;
                if seq.fresh {
                    seq.cached_tokens = start;
                }
            }
            self.reserve(id, start + len);
            self.admit(id);
            let lora_slot = self.slot_of(id);
            plan.seqs.push(ScheduledSeq { seq: id, start, len, sample: start + len == total, lora_slot });
            self.offer_blocks(id, start + len);
            *budget -= len;
        }
    }

    /// When every running sequence is a beam that has answered (none can take a step
    /// until a sibling, waiting here, answers too), preempts the last of them to make room:
    /// beam searches that together outgrow the cache go on by computing beams again.
    fn preempt_answered_beam(&mut self, plan: &mut StepPlan) -> bool {
        let stuck = self.running.iter().all(|s| self.seqs[s].answered);
        let Some(&victim) = self.running.last().filter(|_| stuck) else { return false };
        self.preempt(victim);
        plan.num_preempted += 1;
        true
    }

    fn admit(&mut self, id: SeqId) {
        self.waiting.retain(|&s| s != id);
        self.running.push(id);
        if self.cfg.priority {
            let seqs = &self.seqs;
            self.running.sort_by_key(|id| (seqs[id].priority, *id));
        }
        if let Some(s) = self.seqs.get_mut(&id) {
            s.status = SeqStatus::Running;
        }
    }

    /// Admits a fresh n > 1 group at once, the children sharing the parent's full prompt
    /// blocks and computing only the prompt's tail. Only when the whole group fits this step
    /// (the parent writes the shared blocks in the same forward the children read them).
    fn try_admit_group(&mut self, parent: SeqId, plan: &mut StepPlan, budget: &mut usize) -> bool {
        let seq = &self.seqs[&parent];
        let group = &self.groups[&seq.group];
        let n = group.seqs.len();
        if n < 2 || group.seqs[0] != parent || !group.seqs.iter().all(|s| self.seqs[s].fresh) {
            return false;
        }
        let p = seq.prompt_len;
        // Full blocks strictly before the last prompt token: each child computes at least
        // that token, whose logits it samples from.
        let shared = (p - 1) / self.cfg.block_size;
        let tail = p - shared * self.cfg.block_size;
        let tokens = p + (n - 1) * tail;
        let blocks = self.blocks_for(p) + (n - 1) * (self.blocks_for(p) - shared);
        if shared == 0
            || tokens > *budget
            || blocks > self.pool.num_free()
            || self.running.len() + n > self.cfg.max_num_seqs
        {
            return false;
        }
        let ids = group.seqs.clone();
        self.reserve(parent, p);
        for &child in &ids[1..] {
            self.op(BlockOp::Fork { parent, child, num_blocks: shared });
            if let Some(c) = self.seqs.get_mut(&child) {
                c.num_computed = shared * self.cfg.block_size;
            }
            self.reserve(child, p);
        }
        for &id in &ids {
            self.admit(id);
            let start = self.seqs[&id].num_computed;
            let lora_slot = self.slot_of(id);
            plan.seqs.push(ScheduledSeq { seq: id, start, len: p - start, sample: true, lora_slot });
            self.offer_blocks(id, p);
        }
        *budget -= tokens;
        true
    }

    /// Records that a step ran: each scheduled chunk is now in the cache.
    pub fn on_computed(&mut self, s: &ScheduledSeq) {
        if let Some(seq) = self.seqs.get_mut(&s.seq)
            && seq.status == SeqStatus::Running
        {
            seq.num_computed = s.start + s.len;
            seq.registered = true;
        }
    }

    /// Appends a sampled token to a running sequence.
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(seq) = self.seqs.get_mut(&id)
            && seq.status == SeqStatus::Running
        {
            seq.tokens.push(token);
        }
    }

    /// Records a step as sent to the runner: its chunks count as computed, and each
    /// sampling sequence gets a [`PENDING`] token, so that the next step can be planned
    /// before this one's tokens are known (the runner feeds it the real ones).
    /// [`Self::resolve_token`] puts each token in its place, in step order.
    pub fn on_launched(&mut self, s: &ScheduledSeq) {
        self.on_computed(s);
        if !s.sample {
            return;
        }
        match self.seqs.get_mut(&s.seq) {
            Some(seq) if seq.beam => seq.awaiting = Some(s.start + s.len),
            _ => self.append_token(s.seq, PENDING),
        }
    }

    /// Puts a sampled token in place of the sequence's oldest pending one (pending tokens
    /// are always the last ones) and returns where; None when it has none left (it ended).
    pub fn resolve_token(&mut self, id: SeqId, token: u32) -> Option<usize> {
        let seq = self.seqs.get_mut(&id)?;
        let first_pending = seq.tokens.iter().rposition(|&t| t != PENDING).map_or(0, |i| i + 1);
        let at = first_pending.max(seq.prompt_len);
        *seq.tokens.get_mut(at)? = token;
        Some(at)
    }
}

/// Beam search: the host chooses each beam's next token from the beams' step results, then
/// continues, forks and drops beams. A beam's runner state is taken afresh every step (the
/// runner's copy holds the token it sampled itself, not the one chosen).
impl Scheduler {
    /// Marks the group's sequences as beams.
    pub fn set_beam(&mut self, group: u64) {
        let Some(g) = self.groups.get(&group) else { return };
        for id in &g.seqs {
            if let Some(s) = self.seqs.get_mut(id) {
                s.beam = true;
            }
        }
    }

    /// Takes the result of a beam's step that computed its first `at` tokens: true when it
    /// is the beam's current one (the beam has `at` tokens), false for a step planned before
    /// the beam was preempted or extended (which, once answered, no longer holds it back).
    pub fn take_beam_result(&mut self, id: SeqId, at: usize) -> bool {
        let Some(s) = self.seqs.get_mut(&id) else { return false };
        if s.awaiting != Some(at) {
            return false;
        }
        s.awaiting = None;
        s.answered = s.tokens.len() == at;
        s.answered
    }

    /// Continues beam `id` with `token`.
    pub fn extend_beam(&mut self, id: SeqId, token: u32) {
        self.forget_on_runner(id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens.push(token);
            seq.answered = false;
        }
    }

    /// A new beam of `parent`'s tokens and `token`, to be made before `parent` is extended.
    /// It shares the parent's full blocks and gets a copy of its last, partly filled one
    /// (copy-on-write); with no block free it computes that block's tokens again instead.
    pub fn fork_beam(&mut self, parent: SeqId, token: u32) -> SeqId {
        let child = self.next_seq;
        self.next_seq += 1;
        let bs = self.cfg.block_size;
        let p = &self.seqs[&parent];
        let (group, computed) = (p.group, p.num_computed);
        let full = computed / bs;
        let mut tokens = p.tokens.clone();
        tokens.push(token);
        let seq = Sequence {
            id: child,
            group,
            tokens,
            prompt_len: p.prompt_len,
            num_computed: full * bs,
            status: SeqStatus::Waiting,
            lora: p.lora,
            registered: false,
            cached_tokens: 0,
            hashed: p.hashed,
            last_hash: p.last_hash,
            fresh: false,
            max_len: p.max_len,
            priority: p.priority,
            beam: true,
            awaiting: None,
            answered: false,
            whole_prompt: false,
        };
        self.seqs.insert(child, seq);
        if let Some(g) = self.groups.get_mut(&group) {
            g.seqs.push(child);
        }
        if self.pool.table(parent).is_none() {
            // The parent was preempted: the new beam computes its tokens from the start.
            if let Some(c) = self.seqs.get_mut(&child) {
                c.num_computed = 0;
            }
            self.requeue(child);
            return child;
        }
        self.op(BlockOp::Fork { parent, child, num_blocks: full });
        if computed % bs != 0 && self.pool.num_free() > 0 {
            self.op(BlockOp::Grow { seq: child, num_tokens: computed });
            let src = self.pool.table(parent).map(|t| t[full]);
            let dst = self.pool.table(child).map(|t| t[full]);
            if let (Some(src), Some(dst)) = (src, dst) {
                self.pending_copies.push((src, dst));
            }
            if let Some(c) = self.seqs.get_mut(&child) {
                c.num_computed = computed;
            }
        }
        self.admit(child);
        child
    }

    /// Ends a beam the search let go, and forgets it.
    pub fn drop_beam(&mut self, id: SeqId) {
        self.finish(id);
        let Some(seq) = self.seqs.remove(&id) else { return };
        if let Some(g) = self.groups.get_mut(&seq.group) {
            g.seqs.retain(|&s| s != id);
        }
    }
}

/// A sampled token the scheduler does not know yet (no vocabulary reaches this id).
pub const PENDING: u32 = u32::MAX;

#[cfg(test)]
mod tests;
