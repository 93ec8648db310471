//! ModelRunner actor: one per device, on its own SyncArbiter thread. It owns that device's
//! weights, KV cache and the per-sequence state sampling needs (token ids for penalties,
//! seeds). The Scheduler sends it one [`ExecuteBatch`] per step; it turns the batch into
//! flat inputs and attention metadata, runs the model's forward, samples, and returns token
//! ids (and logprobs when asked). On a device that feeds sampled tokens (a GPU) it answers
//! a Scheduler's step only once the next message has issued its own step, whose token ids
//! name the places of the tokens still on the device: the device never waits for the host
//! between steps.
//!
//! Under tensor parallelism there is one ModelRunner per rank, each on its own thread with
//! its shard of the weights and KV cache. Rank 0 receives the Scheduler's batch, turns it
//! into flat inputs, hands the same inputs to the other ranks ([`ShardStep`]) and runs its
//! own shard; the collectives inside the forward keep the ranks in step, and rank 0 alone
//! samples and answers.
//!
//! A device error (a failed launch, copy or allocation) fails the step: the Scheduler hands
//! it to that step's requests. Under tensor parallelism the other ranks may then be left
//! waiting in a collective the failed rank never joined; aborting the NCCL group is not
//! done yet.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, Addr, Handler, SyncContext};

use crate::core::block_pool::{BlockId, SeqId};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{
    Device, DeviceError, FED_TOKEN, GemmTuning, KvDtype, KvScales, RemoteRanks, SampleTicket,
};
use crate::models::CausalLM;
use crate::request::SamplingParams;
use crate::sampling::{self, SampleInput, TokenHistory};
use crate::structured::GuideState;

mod messages;
mod wire;
pub use wire::WireLora;

use messages::ReplySlot;
pub use messages::{
    AllocateCache, BatchSeq, CaptureGraphs, ExecuteBatch, NewSeq, PromptOutput, ReleaseCache, RunnerError,
    RunnerTiming, Sampled, ShardStep, StepOutput, StepReply, TuneGemms,
};

struct RunnerSeq {
    tokens: Vec<u32>,
    prompt_len: usize,
    params: Arc<SamplingParams>,
    seed: u64,
    index: usize,
    /// Kept for sequences whose sampling applies penalties.
    history: Option<TokenHistory>,
    /// Where the sequence stands in its grammar (structured output).
    guide: Option<GuideState>,
    /// `allowed_token_ids` as a mask, made on the first step that samples it.
    allowed: Option<Vec<u32>>,
}

impl RunnerSeq {
    fn new(n: NewSeq, eos: u32) -> Self {
        let history = n.params.uses_penalties().then(|| TokenHistory::new(&n.tokens, n.prompt_len));
        let guide = n.params.guide.as_ref().map(|g| GuideState::new(g, g.after(), eos));
        Self {
            tokens: n.tokens,
            prompt_len: n.prompt_len,
            params: n.params,
            seed: n.seed,
            index: n.index,
            history,
            guide,
            allowed: None,
        }
    }

    /// Writes the tokens the sequence may take next into `mask`: its grammar's (brought up
    /// to its output), within `allowed_token_ids`, less the last token of each bad word
    /// whose other tokens end the output. False when nothing limits this step.
    fn token_mask(&mut self, mask: &mut [u32]) -> bool {
        let mut on = false;
        if let Some(g) = &mut self.guide {
            g.advance(&self.tokens[self.prompt_len..]);
            if g.active() {
                g.fill_mask(mask);
                on = true;
            }
        }
        if let Some(ids) = &self.params.allowed_token_ids {
            let bits = self.allowed.get_or_insert_with(|| {
                let mut bits = vec![0u32; mask.len()];
                for &t in ids {
                    if let Some(w) = bits.get_mut(t as usize / 32) {
                        *w |= 1 << (t % 32);
                    }
                }
                bits
            });
            if on {
                mask.iter_mut().zip(bits.iter()).for_each(|(m, b)| *m &= b);
            } else {
                mask.copy_from_slice(bits);
                on = true;
            }
        }
        if !self.params.bad_words_ids.is_empty() {
            if !on {
                mask.fill(u32::MAX);
                on = true;
            }
            let output = &self.tokens[self.prompt_len..];
            for word in &self.params.bad_words_ids {
                let (last, before) = word.split_last().expect("bad words are not empty");
                if output.ends_with(before)
                    && let Some(w) = mask.get_mut(*last as usize / 32)
                {
                    *w &= !(1 << (last % 32));
                }
            }
        }
        on
    }

    /// Holds the place of the token that row `row` of a step's sampling picks, until it
    /// is back on the host ([`Self::fill`]): the place holder, `FED_TOKEN | row`, is what a
    /// device that feeds sampled tokens reads as that token. Returns its index.
    fn hold(&mut self, row: usize) -> usize {
        self.tokens.push(FED_TOKEN | row as u32);
        self.tokens.len() - 1
    }

    /// Puts the token sampled for the place held at `at` (for row `row`), unless the
    /// sequence was registered anew since.
    fn fill(&mut self, at: usize, row: usize, token: u32) {
        if self.tokens.get(at) != Some(&(FED_TOKEN | row as u32)) {
            return;
        }
        self.tokens[at] = token;
        if let Some(h) = &mut self.history {
            h.push(token);
        }
    }

    fn sample_input<'a>(&'a self, eos_ids: &'a [u32], allowed: Option<&'a [u32]>) -> SampleInput<'a> {
        SampleInput {
            params: &self.params,
            seed: self.seed,
            index: self.index,
            tokens: &self.tokens,
            prompt_len: self.prompt_len,
            eos_ids,
            history: self.history.as_ref(),
            allowed,
        }
    }
}

/// KV cache geometry the runner was started with.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    /// The KV cache's element type (--kv-cache-dtype).
    pub kv_dtype: KvDtype,
    /// An FP8 cache's scales by layer (the checkpoint's), else scale 1.
    pub kv_scales: Option<Arc<[KvScales]>>,
    /// Each layer's FP8 cache takes its scales from the first keys and values it stores
    /// (--calculate-kv-scales), in place of `kv_scales`.
    pub calculate_kv_scales: bool,
}

pub struct ModelRunner<D: Device> {
    dev: D,
    model: Box<dyn CausalLM<D>>,
    caches: Vec<D::Cache>,
    block_size: usize,
    kv_dtype: KvDtype,
    kv_scales: Option<Arc<[KvScales]>>,
    calculate_kv_scales: bool,
    eos_ids: Arc<[u32]>,
    seqs: HashMap<SeqId, RunnerSeq>,
    /// Ranks 1.. of a tensor-parallel group (on rank 0 only).
    peers: Vec<Addr<ModelRunner<D>>>,
    /// Ranks of the group in other processes (on rank 0 of a group across nodes).
    remote: Option<Arc<dyn RemoteRanks>>,
    /// The step in progress was sent to the group's other ranks and not yet joined.
    in_group_step: bool,
    /// Decode forwards recorded as graphs, by (with adapters, batch size, context bound),
    /// ascending.
    graphs: Vec<((bool, usize, usize), D::Graph)>,
    /// When the last step's work on the device was done (its results read back).
    last_done: Option<std::time::Instant>,
    /// The step issued last, whose sampled tokens are still on the device, and where its
    /// answer goes (filled by [`StepReply`] once its handler has returned): it is answered
    /// once the next message has issued its own work.
    deferred: Option<Deferred>,
    reply: ReplySlot,
    /// The step's grammar masks, one row of `mask_words` per sampled row (reused).
    masks: Vec<u32>,
    /// Last, so that it drops after the device.
    _live: LiveRunner,
}

/// ModelRunners whose device is not yet released.
static LIVE_RUNNERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct LiveRunner;

impl LiveRunner {
    fn new() -> Self {
        LIVE_RUNNERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        LiveRunner
    }
}

impl Drop for LiveRunner {
    fn drop(&mut self) {
        LIVE_RUNNERS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// ModelRunners in this process that have not yet dropped their device.
pub fn live_runners() -> usize {
    LIVE_RUNNERS.load(std::sync::atomic::Ordering::SeqCst)
}

/// Waits (at most `limit`) until every ModelRunner has dropped its device: their threads
/// end once the actors that send to them are gone (which needs their system running: from
/// inside it, poll [`live_runners`] between awaits instead).
pub fn wait_for_runners(limit: std::time::Duration) {
    let start = std::time::Instant::now();
    while LIVE_RUNNERS.load(std::sync::atomic::Ordering::SeqCst) > 0 && start.elapsed() < limit {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

impl<D: Device> ModelRunner<D> {
    pub fn new(
        dev: D,
        model: Box<dyn CausalLM<D>>,
        cfg: RunnerConfig,
        eos_ids: Arc<[u32]>,
    ) -> Result<Self, DeviceError> {
        let remote = dev.remote_ranks();
        let mut runner = Self {
            dev,
            model,
            caches: Vec::new(),
            block_size: cfg.block_size,
            kv_dtype: cfg.kv_dtype,
            kv_scales: cfg.kv_scales,
            calculate_kv_scales: cfg.calculate_kv_scales,
            eos_ids,
            seqs: HashMap::new(),
            remote,
            in_group_step: false,
            peers: Vec::new(),
            graphs: Vec::new(),
            last_done: None,
            deferred: None,
            reply: ReplySlot::default(),
            masks: Vec::new(),
            _live: LiveRunner::new(),
        };
        runner.allocate_cache(cfg.num_blocks)?;
        Ok(runner)
    }

    fn allocate_cache(&mut self, num_blocks: usize) -> Result<(), DeviceError> {
        // Graphs hold the old cache's addresses.
        self.graphs.clear();
        self.caches.clear();
        let (layers, shape) = self.model.cache_shape(num_blocks, self.block_size);
        self.caches =
            (0..layers).map(|_| self.dev.alloc_cache(shape, self.kv_dtype)).collect::<Result<_, _>>()?;
        if let Some(scales) = &self.kv_scales {
            if scales.len() != layers {
                return Err(DeviceError::Other(format!(
                    "KV cache scales for {} layers, for a model of {layers} cache layers",
                    scales.len()
                )));
            }
            for (cache, &s) in self.caches.iter_mut().zip(scales.iter()) {
                self.dev.set_kv_scales(cache, s)?;
            }
        }
        if self.calculate_kv_scales {
            for cache in &mut self.caches {
                self.dev.calculate_kv_scales(cache)?;
            }
        }
        Ok(())
    }

    /// Makes this runner rank 0 of a group whose other ranks run at `peers`.
    pub fn with_peers(mut self, peers: Vec<Addr<ModelRunner<D>>>) -> Self {
        self.peers = peers;
        self
    }

    /// One rank's forward (and its share of the logits when the step samples), then the
    /// logits of the prompt rows a request asks the logprobs of: the collectives inside
    /// meet the other ranks'. The lead rank reads the prompt logprobs back (`prompt.targets`).
    /// A runner alone (`grouped` false) issues it where its device would have it
    /// ([`Device::issue_forward`]); the ranks of a group stay on their own threads, where
    /// a rank waiting in a collective holds no thread the others' kernels need.
    fn forward(
        &mut self,
        ids: &[u32],
        meta: &AttnMetadata,
        prompt: &PromptRows,
        grouped: bool,
    ) -> Result<(Option<D::Tensor>, Vec<PromptOutput>), DeviceError> {
        let (dev, model, caches) = (&mut self.dev, &mut self.model, &mut self.caches);
        match grouped {
            true => Self::forward_on(dev, &**model, caches, ids, meta, prompt),
            false => D::issue_forward(move || Self::forward_on(dev, &**model, caches, ids, meta, prompt)),
        }
    }

    fn forward_on(
        dev: &D,
        model: &dyn CausalLM<D>,
        caches: &mut [D::Cache],
        ids: &[u32],
        meta: &AttnMetadata,
        prompt: &PromptRows,
    ) -> Result<(Option<D::Tensor>, Vec<PromptOutput>), DeviceError> {
        let hidden = model.forward(dev, ids, caches, meta)?;
        let logits = match meta.last_token_rows.is_empty() {
            true => None,
            false => Some(model.compute_logits(dev, &hidden, meta)?),
        };
        let mut out = Vec::with_capacity(prompt.targets.len());
        // A few hundred rows at a time: a long prompt's logits would otherwise take
        // gigabytes (rows × vocabulary).
        for (c, rows) in prompt.rows.chunks(PROMPT_ROWS_PER_PASS).enumerate() {
            let pass = AttnMetadata { last_token_rows: rows.to_vec(), ..AttnMetadata::default() };
            let l = model.compute_logits(dev, &hidden, &pass)?;
            if prompt.targets.is_empty() {
                continue;
            }
            let cols = dev.shape(&l).1;
            let host = dev.to_host(&l)?;
            let targets = &prompt.targets[c * PROMPT_ROWS_PER_PASS..][..rows.len()];
            for (row, &(seq, at, token, k)) in host.chunks_exact(cols).zip(targets) {
                out.push(PromptOutput { seq, at, logprob: sampling::prompt_logprob(row, token, k) });
            }
        }
        Ok((logits, out))
    }

    /// Records the decode forward for each batch size and context bound, the largest first
    /// (the graphs' input buffers are sized by the first). Each runs on dummy inputs: every
    /// row at position 0 with a block table as long as the bound allows, writing no cache.
    /// A model with LoRA capacity gets a second set that applies the batch's adapters
    /// (recorded first: it reads one input more), so that steps without adapters skip them.
    fn capture_graphs(&mut self, sizes: &[usize], bounds: &[usize]) -> Result<usize, DeviceError> {
        self.graphs.clear();
        if !self.peers.is_empty() || self.remote.is_some() {
            return Ok(0);
        }
        let sets: &[bool] = if self.model.has_lora() { &[true, false] } else { &[false] };
        for &lora in sets {
            for &size in sizes.iter().rev() {
                for &bound in bounds.iter().rev() {
                    let ids = vec![0; size];
                    let meta = AttnMetadata {
                        positions: vec![0; size],
                        slot_mapping: vec![-1; size],
                        token_seq: (0..size as u32).collect(),
                        block_tables: vec![vec![0; bound.div_ceil(self.block_size)]; size],
                        last_token_rows: (0..size).collect(),
                        lora_slots: if lora { vec![-1; size] } else { Vec::new() },
                        prompt_lens: vec![1; size],
                    };
                    let (dev, model, caches) = (&self.dev, &self.model, &mut self.caches);
                    let mut forward = || model.forward(dev, &ids, caches, &meta);
                    match dev.capture_graph(&ids, &meta, bound, &mut forward)? {
                        Some(g) => self.graphs.push(((lora, size, bound), g)),
                        None => return Ok(0),
                    }
                }
            }
        }
        self.graphs.sort_by_key(|(key, _)| *key);
        Ok(self.graphs.len())
    }

    /// The logits of a decode step through a graph: every sequence contributes its one
    /// last token, and a graph of the batch's set (with adapters or without) holds the
    /// batch (padded to its size) and the longest context. None when no graph applies.
    /// The batch is padded in place when a graph takes it.
    fn replay(
        &mut self,
        ids: &mut Vec<u32>,
        meta: &mut AttnMetadata,
    ) -> Result<Option<D::Tensor>, DeviceError> {
        let n = ids.len();
        if self.graphs.is_empty() || meta.last_token_rows.len() != n {
            return Ok(None);
        }
        let lora = !meta.lora_slots.is_empty();
        let ctx = meta.positions.iter().copied().max().unwrap_or(0) as usize + 1;
        let Some(((_, size, _), graph)) = self
            .graphs
            .iter()
            .find(|((with_lora, size, bound), _)| *with_lora == lora && *size >= n && *bound >= ctx)
        else {
            return Ok(None);
        };
        // Padding rows read block 0 at position 0, write no cache and use no adapter; their
        // outputs are never sampled (`last_token_rows` still names the real rows, the first n).
        let size = *size;
        ids.resize(size, 0);
        meta.positions.resize(size, 0);
        meta.slot_mapping.resize(size, -1);
        meta.token_seq.extend(n as u32..size as u32);
        meta.block_tables.resize(size, vec![0]);
        meta.prompt_lens.resize(size, 1);
        if lora {
            meta.lora_slots.resize(size, -1);
        }
        let hidden = self.dev.replay_graph(graph, ids, meta)?;
        self.model.compute_logits(&self.dev, hidden, meta).map(Some)
    }

    /// Runs one step and waits for its tokens. Public so that benchmarks can drive a runner
    /// without actors.
    pub fn execute(&mut self, batch: ExecuteBatch) -> Result<StepOutput, RunnerError> {
        self.answer_deferred();
        match self.issue(batch)? {
            Issued::Done(out) => Ok(out),
            Issued::Sampling(d) => self.finish(d),
        }
    }

    /// Whether a step's sampled tokens may stay on the device until the next message: the
    /// device puts them into that step's inputs itself. Not under tensor parallelism: the
    /// other ranks (threads, or nodes) take their token ids from the host.
    fn defers(&self) -> bool {
        self.peers.is_empty() && self.remote.is_none() && self.dev.feeds_sampled_tokens()
    }

    /// Whether `batch` may be issued before the deferred step's tokens are back: none of
    /// its sequences applies penalties, whose counts need the tokens themselves.
    fn may_feed(&self, batch: &ExecuteBatch) -> bool {
        batch
            .seqs
            .iter()
            .all(|s| s.new.is_some() || self.seqs.get(&s.seq).is_none_or(|rs| rs.history.is_none()))
    }

    /// Answers the deferred step, if any: waits for its tokens.
    fn answer_deferred(&mut self) {
        let Some(d) = self.deferred.take() else { return };
        let result = self.finish(d);
        let tx = self.reply.lock().map(|mut slot| slot.take()).unwrap_or_default();
        if let Some(tx) = tx {
            let _ = tx.send(result);
        }
    }

    /// Issues one step: its forward and, where it samples, its sampling, without waiting
    /// for the device.
    fn issue(&mut self, batch: ExecuteBatch) -> Result<Issued, RunnerError> {
        let ns = |a: Instant, b: Instant| (b - a).as_nanos() as u64;
        let (t0, allocs) = (Instant::now(), self.dev.allocations());
        for id in &batch.dropped {
            self.seqs.remove(id);
        }
        for (slot, adapter) in &batch.lora_loads {
            self.model.set_lora_slot(&self.dev, *slot, Some(adapter))?;
        }
        let batch_lora_loads = batch.lora_loads;
        let copies: Arc<[(BlockId, BlockId)]> = batch.copies.into();
        if !copies.is_empty() {
            for cache in &mut self.caches {
                self.dev.copy_blocks(cache, &copies)?;
            }
        }
        let any_lora = batch.seqs.iter().any(|s| s.lora_slot >= 0);
        let recompute_past = self.model.recompute_past();
        let mut ids = Vec::new();
        let mut meta = AttnMetadata::default();
        let mut sampled_seqs = Vec::new();
        let mut prompt = PromptRows::default();
        for (i, s) in batch.seqs.into_iter().enumerate() {
            if let Some(n) = s.new {
                let eos = self.eos_ids.first().copied().unwrap_or(0);
                self.seqs.insert(s.seq, RunnerSeq::new(n, eos));
            }
            let rs = self.seqs.get(&s.seq).ok_or(RunnerError::UnknownSeq(s.seq))?;
            let end = s.start + s.len;
            if end > rs.tokens.len() {
                return Err(RunnerError::Range { seq: s.seq, start: s.start, end, have: rs.tokens.len() });
            }
            // A sequence growing past the model's recompute length runs its whole context
            // again, over the cache slots it already holds.
            let start = match recompute_past.map(|p| p as usize) {
                Some(p) if rs.prompt_len <= p && (1..=p).contains(&s.start) && end > p => 0,
                _ => s.start,
            };
            // Prompt positions whose next token's logprob the request asks for (its first
            // sequence's: the others share the prompt).
            if let Some(k) = rs.params.prompt_logprobs.filter(|_| rs.index == 0) {
                for pos in start..end.min(rs.prompt_len.saturating_sub(1)) {
                    prompt.rows.push(ids.len() + pos - start);
                    prompt.targets.push((s.seq, pos + 1, rs.tokens[pos + 1], k));
                }
            }
            // A token still on the device (its place holder) is put in place there.
            ids.extend_from_slice(&rs.tokens[start..end]);
            for pos in start..end {
                meta.positions.push(pos as u32);
                let block = s.block_table[pos / self.block_size] as i64;
                meta.slot_mapping.push(block * self.block_size as i64 + (pos % self.block_size) as i64);
                meta.token_seq.push(i as u32);
                if any_lora {
                    meta.lora_slots.push(s.lora_slot);
                }
            }
            meta.block_tables.push(s.block_table);
            meta.prompt_lens.push(rs.prompt_len as u32);
            if s.sample {
                meta.last_token_rows.push(ids.len() - 1);
                sampled_seqs.push(s.seq);
            }
        }
        if ids.is_empty() && batch_lora_loads.is_empty() && copies.is_empty() {
            return Ok(Issued::Done(StepOutput::default()));
        }
        let mut peer_steps = Vec::with_capacity(self.peers.len());
        let grouped = !self.peers.is_empty() || self.remote.is_some();
        if grouped {
            let step = ShardStep {
                ids: ids.as_slice().into(),
                meta: Arc::new(meta.clone()),
                lora_loads: batch_lora_loads.clone(),
                copies: copies.clone(),
                prompt_rows: prompt.rows.as_slice().into(),
            };
            self.in_group_step = true;
            if let Some(remote) = &self.remote {
                remote.send_step(&step.encode())?;
            }
            for p in &self.peers {
                peer_steps.push(p.send(step.clone()));
            }
        }
        if ids.is_empty() {
            // A batch of adapter loads or block copies only: every rank has done them.
            self.join_ranks(peer_steps)?;
            return Ok(Issued::Done(StepOutput::default()));
        }
        let t1 = Instant::now();
        // Issued behind a step whose tokens are still on the device, the device had no wait.
        let idle_ns = match self.deferred {
            Some(_) => batch.follows.then_some(0),
            None => self.last_done.filter(|_| batch.follows).map(|d| ns(d, t1)),
        };
        // A device error fails the step (its requests get it); the other ranks of a group
        // may then wait in a collective this rank never joined (see the module doc).
        // (A step with prompt rows has prompt tokens: never a replayed decode step.)
        let replayed = self.replay(&mut ids, &mut meta)?;
        let graph = replayed.is_some();
        let (logits, prompt_logprobs) = match replayed {
            Some(logits) => (Some(logits), Vec::new()),
            None => self.forward(&ids, &meta, &prompt, grouped)?,
        };
        let t2 = Instant::now();
        let mut timing = RunnerTiming {
            prepare_ns: ns(t0, t1),
            launch_ns: ns(t1, t2),
            device_ns: 0,
            sample_ns: 0,
            mask_ns: 0,
            device_allocs: 0,
            graph,
            fed: self.deferred.is_some(),
            idle_ns,
        };
        let Some(logits) = logits else {
            self.dev.synchronize()?;
            self.join_ranks(peer_steps)?;
            let t3 = Instant::now();
            self.last_done = Some(t3);
            timing.device_ns = ns(t2, t3);
            timing.device_allocs = self.dev.allocations() - allocs;
            return Ok(Issued::Done(StepOutput { sampled: Vec::new(), prompt_logprobs, timing }));
        };
        self.join_ranks(peer_steps)?;
        // The device samples (a GPU sends back only token ids and requested logprobs),
        // issued right behind the forward: waiting for the forward first cost the H200 about
        // 0.05 ms a batch-1 step of the 8B model (the host's wake-up and the sampler's
        // launch, with the GPU idle).
        // Grammar masks are computed here, while the device runs the forward just issued;
        // the step before's tokens, which the grammars take first, are back by now.
        let guided = self.token_masks(&sampled_seqs, self.dev.shape(&logits).1);
        timing.mask_ns = ns(t2, Instant::now());
        let eos = self.eos_ids.clone();
        let words = self.dev.shape(&logits).1.div_ceil(32);
        let inputs: Vec<SampleInput> = sampled_seqs
            .iter()
            .enumerate()
            .map(|(row, s)| {
                let allowed = guided[row].then(|| &self.masks[row * words..(row + 1) * words]);
                self.seqs[s].sample_input(&eos, allowed)
            })
            .collect();
        let t3 = Instant::now();
        let ticket = self.dev.sample_rows_issue(logits, &inputs)?;
        drop(inputs);
        timing.sample_ns = ns(t2, t3);
        let held = sampled_seqs
            .into_iter()
            .enumerate()
            .map(|(row, seq)| (seq, self.seqs.get_mut(&seq).map_or(0, |rs| rs.hold(row))))
            .collect();
        timing.device_allocs = self.dev.allocations() - allocs;
        Ok(Issued::Sampling(Deferred { ticket, held, prompt_logprobs, timing, issued: Instant::now() }))
    }

    /// Writes the token mask of each sampled row whose sequence limits its tokens (a
    /// grammar, `allowed_token_ids`, `bad_words`) into `self.masks` (a row of `cols / 32`
    /// words each), in parallel over the rows; which rows have one. The step before's
    /// tokens are collected first (the masks depend on them): its sampling ran ahead of
    /// this step's forward on the device.
    fn token_masks(&mut self, sampled: &[SeqId], cols: usize) -> Vec<bool> {
        use rayon::prelude::*;
        let mut guided = vec![false; sampled.len()];
        if !sampled.iter().any(|s| self.seqs.get(s).is_some_and(|rs| rs.params.masks_tokens())) {
            return guided;
        }
        self.answer_deferred();
        let words = cols.div_ceil(32);
        self.masks.resize(sampled.len() * words, 0);
        let rows: HashMap<SeqId, usize> = sampled.iter().enumerate().map(|(r, s)| (*s, r)).collect();
        let mut chunks: Vec<Option<&mut [u32]>> = self.masks.chunks_mut(words).map(Some).collect();
        let jobs: Vec<(usize, &mut RunnerSeq, &mut [u32])> = self
            .seqs
            .iter_mut()
            .filter(|(_, rs)| rs.params.masks_tokens())
            .filter_map(|(id, rs)| {
                let r = *rows.get(id)?;
                Some((r, rs, chunks[r].take()?))
            })
            .collect();
        for (r, on) in jobs.into_par_iter().map(|(r, rs, mask)| (r, rs.token_mask(mask))).collect::<Vec<_>>()
        {
            guided[r] = on;
        }
        guided
    }

    /// Waits for an issued step's tokens and puts them in the places held for them.
    fn finish(&mut self, d: Deferred) -> Result<StepOutput, RunnerError> {
        let results = self.dev.sample_rows_collect(d.ticket)?;
        let done = Instant::now();
        self.last_done = Some(done);
        let mut timing = d.timing;
        timing.device_ns = (done - d.issued).as_nanos() as u64;
        let mut out = StepOutput {
            sampled: Vec::with_capacity(results.len()),
            prompt_logprobs: d.prompt_logprobs,
            timing,
        };
        for (row, ((seq, at), (token, logprobs))) in d.held.into_iter().zip(results).enumerate() {
            if let Some(rs) = self.seqs.get_mut(&seq) {
                rs.fill(at, row, token);
            }
            out.sampled.push(Sampled { seq, token, logprobs });
        }
        Ok(out)
    }
}

/// Prompt rows computed in one pass of the logits.
const PROMPT_ROWS_PER_PASS: usize = 256;

/// A step's prompt positions whose logprobs are asked for: each one's row in the step, and
/// (on the lead rank) its sequence, the position of the token it predicts, that token and
/// the number of top logprobs asked.
#[derive(Default)]
struct PromptRows {
    rows: Vec<usize>,
    targets: Vec<(SeqId, usize, u32, usize)>,
}

/// A step as [`ModelRunner::issue`] left it.
enum Issued {
    /// Nothing to sample: done.
    Done(StepOutput),
    /// Sampling issued: its tokens are collected by [`ModelRunner::finish`].
    Sampling(Deferred),
}

/// A step whose sampling was issued and not yet collected.
struct Deferred {
    ticket: SampleTicket,
    /// Each sampled row's sequence and the index of the token place held for it.
    held: Vec<(SeqId, usize)>,
    prompt_logprobs: Vec<PromptOutput>,
    timing: RunnerTiming,
    /// When its sampling was issued: the wait for the device counts from here.
    issued: Instant,
}

impl<D: Device> ModelRunner<D> {
    /// Waits for the other ranks' share of a step (sent as [`ShardStep`]s), rank 1 first,
    /// then for the ranks in other processes.
    fn join_ranks(
        &mut self,
        steps: Vec<impl std::future::Future<Output = Result<Result<(), RunnerError>, actix::MailboxError>>>,
    ) -> Result<(), RunnerError> {
        for (rank, done) in steps.into_iter().enumerate() {
            futures::executor::block_on(done).map_err(|_| RunnerError::RankGone(rank + 1))??;
        }
        if let Some(remote) = &self.remote {
            remote.join_step()?;
        }
        self.in_group_step = false;
        Ok(())
    }

    /// [`ReleaseCache`]: drops the KV cache and the sequences, and answers the device's
    /// (free, total) memory.
    pub fn release_cache(&mut self) -> Result<Option<(usize, usize)>, RunnerError> {
        self.answer_deferred();
        self.caches.clear();
        self.seqs.clear();
        self.dev.synchronize()?;
        // Measured with the graphs (recorded on the profiling cache) still held: their
        // memory stays out of the cache's budget. They go with the cache they point into.
        let memory = self.dev.memory_info();
        self.graphs.clear();
        Ok(memory)
    }

    /// Fails this rank's tensor-parallel group: it left a step or command part-way.
    pub fn fail_group(&self, why: &str) {
        self.dev.fail_group(why);
    }

    /// [`TuneGemms`].
    pub fn tune_gemms(&mut self, rows: &[usize]) -> Result<GemmTuning, RunnerError> {
        self.answer_deferred();
        Ok(self.dev.tune_gemms(rows)?)
    }

    /// [`AllocateCache`].
    pub fn reallocate_cache(&mut self, num_blocks: usize) -> Result<(), RunnerError> {
        self.answer_deferred();
        Ok(self.allocate_cache(num_blocks)?)
    }

    /// A rank's share of rank 0's step: adapters placed, blocks copied, then the forward.
    pub fn run_shard(&mut self, msg: &ShardStep) -> Result<(), RunnerError> {
        for (slot, adapter) in &msg.lora_loads {
            self.model.set_lora_slot(&self.dev, *slot, Some(adapter))?;
        }
        for cache in &mut self.caches {
            self.dev.copy_blocks(cache, &msg.copies)?;
        }
        if !msg.ids.is_empty() {
            let rows = PromptRows { rows: msg.prompt_rows.to_vec(), targets: Vec::new() };
            self.forward(&msg.ids, &msg.meta, &rows, true)?;
        }
        Ok(())
    }
}

impl<D: Device> Actor for ModelRunner<D> {
    type Context = SyncContext<Self>;
}

impl<D: Device> Handler<ShardStep> for ModelRunner<D> {
    type Result = Result<(), RunnerError>;
    fn handle(&mut self, msg: ShardStep, _: &mut SyncContext<Self>) -> Self::Result {
        let done = self.run_shard(&msg);
        if let Err(e) = &done {
            // Left part-way, the step leaves the other ranks waiting in a collective.
            self.dev.fail_group(&e.to_string());
        }
        done
    }
}

impl<D: Device> Handler<ReleaseCache> for ModelRunner<D> {
    type Result = Result<Option<(usize, usize)>, RunnerError>;
    fn handle(&mut self, _: ReleaseCache, _: &mut SyncContext<Self>) -> Self::Result {
        self.release_cache()
    }
}

impl<D: Device> Handler<TuneGemms> for ModelRunner<D> {
    type Result = Result<GemmTuning, RunnerError>;
    fn handle(&mut self, msg: TuneGemms, _: &mut SyncContext<Self>) -> Self::Result {
        self.tune_gemms(&msg.rows)
    }
}

impl<D: Device> Handler<CaptureGraphs> for ModelRunner<D> {
    type Result = Result<usize, RunnerError>;
    fn handle(&mut self, msg: CaptureGraphs, _: &mut SyncContext<Self>) -> Self::Result {
        self.answer_deferred();
        Ok(self.capture_graphs(&msg.sizes, &msg.bounds)?)
    }
}

impl<D: Device> Handler<AllocateCache> for ModelRunner<D> {
    type Result = Result<(), RunnerError>;
    fn handle(&mut self, msg: AllocateCache, _: &mut SyncContext<Self>) -> Self::Result {
        self.reallocate_cache(msg.num_blocks)
    }
}

impl<D: Device> Handler<ExecuteBatch> for ModelRunner<D> {
    type Result = StepReply;
    /// Issues the step, then answers the one before it (deferred: its tokens feed this
    /// step on the device); this step is deferred in turn where the device allows.
    fn handle(&mut self, msg: ExecuteBatch, _: &mut SyncContext<Self>) -> StepReply {
        if self.deferred.is_some() && !self.may_feed(&msg) {
            self.answer_deferred();
        }
        let followed = msg.followed;
        let issued = self.issue(msg);
        if let (Err(e), true) = (&issued, std::mem::take(&mut self.in_group_step)) {
            // Rank 0 left a step its other ranks run: they would wait in a collective.
            self.dev.fail_group(&e.to_string());
        }
        self.answer_deferred();
        match issued {
            Ok(Issued::Sampling(d)) if followed && self.defers() => {
                self.deferred = Some(d);
                StepReply::Later(self.reply.clone())
            }
            Ok(Issued::Sampling(d)) => StepReply::Now(self.finish(d)),
            Ok(Issued::Done(out)) => StepReply::Now(Ok(out)),
            Err(e) => StepReply::Now(Err(e)),
        }
    }
}
