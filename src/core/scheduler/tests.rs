//! The scheduler driven with a handful of fake blocks; every plan is applied to a real
//! BlockPool, whose free count must always equal the scheduler's mirror.

use super::*;
use crate::core::block_pool::BlockPool;

struct Harness {
    s: Scheduler,
    pool: BlockPool,
}

impl Harness {
    fn new(num_blocks: usize, block_size: usize, max_num_seqs: usize, budget: usize) -> Self {
        Self::with_caching(num_blocks, block_size, max_num_seqs, budget, false)
    }

    fn with_caching(
        num_blocks: usize,
        block_size: usize,
        max_num_seqs: usize,
        budget: usize,
        on: bool,
    ) -> Self {
        let cfg = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: budget,
            block_size,
            num_blocks,
            max_loras: 2,
            prefix_caching: on,
            priority: false,
        };
        Self { s: Scheduler::new(cfg), pool: BlockPool::new(num_blocks, block_size) }
    }

    /// Plans a step, applies its block ops, marks it computed and appends `token` to each
    /// sampled sequence.
    fn step(&mut self, token: u32) -> StepPlan {
        let plan = self.s.schedule().expect("work to do");
        self.pool.apply(&plan.ops).expect("the plan fits the pool");
        assert_eq!(self.pool.num_free(), self.s.free_blocks(), "mirror of the free count");
        for sq in &plan.seqs {
            let table = self.pool.table(sq.seq).expect("scheduled sequences have blocks");
            assert_eq!(Some(table), self.s.pool.table(sq.seq), "the replica's table");
            assert!(table.len() * self.pool.block_size() >= sq.start + sq.len);
            self.s.on_computed(sq);
            if sq.sample {
                self.s.append_token(sq.seq, token);
            }
        }
        plan
    }
}

fn lens(plan: &StepPlan) -> Vec<(SeqId, usize, usize)> {
    plan.seqs.iter().map(|s| (s.seq, s.start, s.len)).collect()
}

#[test]
fn requests_join_and_leave_between_steps() {
    let mut h = Harness::new(16, 4, 8, 64);
    let a = h.s.add(0, &[1, 2, 3, 4, 5], 1, None)[0];
    assert_eq!(lens(&h.step(9)), vec![(a, 0, 5)]);
    let b = h.s.add(1, &[7, 8], 1, None)[0];
    assert_eq!(lens(&h.step(9)), vec![(a, 5, 1), (b, 0, 2)]);
    h.s.finish(a);
    let plan = h.step(9);
    assert_eq!(lens(&plan), vec![(b, 2, 1)]);
    assert!(plan.ops.contains(&BlockOp::Free(a)));
    assert!(plan.dropped.contains(&a));
    h.s.remove_group(1);
    h.s.remove_group(0);
    let last = h.s.schedule().expect("the frees are delivered");
    h.pool.apply(&last.ops).unwrap();
    assert_eq!(h.pool.num_free(), 16);
    assert!(h.s.schedule().is_none());
}

#[test]
fn long_prompts_are_prefilled_in_chunks_within_the_budget() {
    let mut h = Harness::new(16, 4, 8, 8);
    let a = h.s.add(0, &(0..20).collect::<Vec<_>>(), 1, None)[0];
    let p1 = h.step(1);
    assert_eq!(lens(&p1), vec![(a, 0, 8)]);
    assert!(!p1.seqs[0].sample);
    assert_eq!(lens(&h.step(1)), vec![(a, 8, 8)]);
    let p3 = h.step(1);
    assert_eq!(lens(&p3), vec![(a, 16, 4)]);
    assert!(p3.seqs[0].sample);
    assert_eq!(lens(&h.step(1)), vec![(a, 20, 1)]);
}

#[test]
fn running_out_of_blocks_preempts_the_newest_by_recompute() {
    // 4 blocks of 4 tokens; two sequences of 7 tokens take 2 blocks each.
    let mut h = Harness::new(4, 4, 8, 64);
    let a = h.s.add(0, &[1; 7], 1, None)[0];
    let b = h.s.add(1, &[2; 7], 1, None)[0];
    h.step(5); // both prefill (8 tokens after sampling each)
    h.step(5); // both decode the 8th token: still 2 blocks each
    let plan = h.step(5); // a needs a third block: b is preempted
    assert_eq!(plan.num_preempted, 1);
    assert_eq!(lens(&plan), vec![(a, 8, 1)]);
    let free_b = plan.ops.iter().position(|o| *o == BlockOp::Free(b)).expect("b's blocks freed");
    let grow_a = plan.ops.iter().position(|o| matches!(o, BlockOp::Grow { seq, .. } if *seq == a)).unwrap();
    assert!(free_b < grow_a, "blocks are freed before they are reused");
    assert_eq!(h.s.seq(b).unwrap().num_computed, 0);
    assert_eq!(h.s.seq(b).unwrap().tokens.len(), 9, "generated tokens survive preemption");
    h.s.finish(a);
    // b comes back and recomputes its prompt and generated tokens in one chunk.
    let plan = h.step(5);
    assert_eq!(lens(&plan), vec![(b, 0, 9)]);
}

#[test]
fn n_greater_than_one_shares_the_prompt_blocks() {
    let mut h = Harness::new(32, 4, 8, 64);
    let ids = h.s.add(0, &(0..10).collect::<Vec<_>>(), 3, None);
    let plan = h.step(1);
    // The parent computes all 10 tokens; children share 2 full blocks and compute 2 each.
    assert_eq!(lens(&plan), vec![(ids[0], 0, 10), (ids[1], 8, 2), (ids[2], 8, 2)]);
    assert!(
        plan.ops.iter().any(|o| matches!(o, BlockOp::Fork { child, num_blocks: 2, .. } if *child == ids[1]))
    );
    assert_eq!(h.pool.num_free(), 32 - 3 - 1 - 1);
    assert_eq!(h.pool.table(ids[1]).unwrap()[..2], h.pool.table(ids[0]).unwrap()[..2]);
    // Shared blocks return only when the last holder ends.
    h.s.finish(ids[0]);
    h.s.finish(ids[1]);
    let plan = h.step(1);
    assert_eq!(lens(&plan), vec![(ids[2], 10, 1)]);
    h.s.finish(ids[2]);
    h.s.remove_group(0);
    let last = h.s.schedule().unwrap();
    h.pool.apply(&last.ops).unwrap();
    assert_eq!(h.pool.num_free(), 32);
    assert_eq!(h.s.free_blocks(), 32);
}

#[test]
fn max_num_seqs_bounds_the_batch_and_waiting_is_fcfs() {
    let mut h = Harness::new(64, 4, 2, 64);
    let a = h.s.add(0, &[1, 2], 1, None)[0];
    let b = h.s.add(1, &[1, 2], 1, None)[0];
    let c = h.s.add(2, &[1, 2], 1, None)[0];
    assert_eq!(lens(&h.step(3)), vec![(a, 0, 2), (b, 0, 2)]);
    assert_eq!(h.s.num_waiting(), 1);
    h.s.finish(a);
    assert_eq!(lens(&h.step(3)), vec![(b, 2, 1), (c, 0, 2)]);
}

#[test]
fn a_batch_never_holds_more_adapters_than_slots() {
    // max_loras = 2; four requests on three adapters plus one on the base model.
    let mut h = Harness::new(64, 4, 8, 64);
    let a = h.s.add(0, &[1, 2], 1, Some(100))[0];
    let b = h.s.add(1, &[1, 2], 1, Some(200))[0];
    let c = h.s.add(2, &[1, 2], 1, Some(300))[0];
    let d = h.s.add(3, &[1, 2], 1, None)[0];
    let e = h.s.add(4, &[1, 2], 1, Some(100))[0];
    let plan = h.step(9);
    let ids: Vec<SeqId> = plan.seqs.iter().map(|s| s.seq).collect();
    assert_eq!(ids, vec![a, b, d, e], "the third adapter waits; base and resident adapters go");
    assert_eq!(plan.lora_loads.len(), 2);
    let slot = |id| plan.seqs.iter().find(|s| s.seq == id).unwrap().lora_slot;
    assert_eq!(slot(d), -1);
    assert_eq!(slot(a), slot(e));
    assert_ne!(slot(a), slot(b));
    assert_eq!(h.s.num_waiting(), 1);
    // When b's adapter is no longer pinned, c takes its slot.
    h.s.finish(b);
    let plan = h.step(9);
    assert!(plan.seqs.iter().any(|s| s.seq == c && s.start == 0));
    let c_slot = plan.seqs.iter().find(|s| s.seq == c).unwrap().lora_slot;
    assert_eq!(plan.lora_loads, vec![(c_slot as usize, 300)]);
}

#[test]
fn a_step_planned_before_the_last_ones_tokens_are_known_decodes_on_and_resolves_in_order() {
    let mut h = Harness::new(16, 4, 8, 64);
    let a = h.s.add(0, &[1, 2, 3], 1, None)[0];
    // Step 1 (the prompt) is sent; step 2 is planned before its token comes back.
    let p1 = h.s.schedule().unwrap();
    h.pool.apply(&p1.ops).unwrap();
    p1.seqs.iter().for_each(|s| h.s.on_launched(s));
    assert_eq!(h.s.seq(a).unwrap().tokens, vec![1, 2, 3, PENDING]);
    let p2 = h.s.schedule().unwrap();
    h.pool.apply(&p2.ops).unwrap();
    assert_eq!(lens(&p2), vec![(a, 3, 1)], "decodes the token step 1 samples");
    p2.seqs.iter().for_each(|s| h.s.on_launched(s));
    assert_eq!(h.s.seq(a).unwrap().tokens, vec![1, 2, 3, PENDING, PENDING]);
    // The tokens come back in step order.
    h.s.resolve_token(a, 40);
    assert_eq!(h.s.seq(a).unwrap().tokens, vec![1, 2, 3, 40, PENDING]);
    h.s.resolve_token(a, 41);
    assert_eq!(h.s.seq(a).unwrap().tokens, vec![1, 2, 3, 40, 41]);
    assert_eq!(h.pool.num_free(), h.s.free_blocks());
    // A sequence that ended keeps its tokens.
    h.s.finish(a);
    h.s.resolve_token(a, 42);
    assert_eq!(h.s.seq(a).unwrap().tokens, vec![1, 2, 3, 40, 41]);
}

/// With prefix caching, a request whose prompt starts with blocks another computed adopts
/// them and computes only the rest (keeping its last token to compute); another adapter's
/// request does not; a preempted sequence comes back through its own cached blocks.
#[test]
fn prefix_cache_hits_skip_computed_blocks() {
    let mut h = Harness::with_caching(16, 4, 8, 64, true);
    let prompt: Vec<u32> = (1..=10).collect();
    let a = h.s.add(0, &prompt, 1, None)[0];
    assert_eq!(lens(&h.step(50)), vec![(a, 0, 10)]);
    h.step(51);
    // Blocks [1..4] and [5..8] are computed: a second request with the prompt takes them.
    let b = h.s.add(1, &prompt, 1, None)[0];
    let plan = h.step(52);
    assert!(lens(&plan).contains(&(b, 8, 2)), "{:?}", lens(&plan));
    assert_eq!(h.pool.table(b).unwrap()[..2], h.pool.table(a).unwrap()[..2]);
    assert_eq!(h.s.seq(b).unwrap().cached_tokens, 8);
    assert_eq!((h.s.prefix_queries, h.s.prefix_hits), (20, 8));
    // A prompt that is exactly two blocks recomputes its last token: one block hit.
    let c = h.s.add(2, &prompt[..8], 1, None)[0];
    assert!(lens(&h.step(53)).contains(&(c, 4, 4)));
    // Under an adapter, nothing is shared with the base model.
    let d = h.s.add(3, &prompt, 1, Some(7))[0];
    assert!(lens(&h.step(54)).contains(&(d, 0, 10)));
    // Its own blocks serve it after a preemption: a runs on from its generated tokens.
    h.s.finish(b);
    h.s.finish(c);
    h.s.finish(d);
    h.step(55);
    h.s.preempt(a);
    // Its 16 tokens: blocks up to token 12 were offered to the cache before it went (the
    // fourth was computed by the step in flight), so it computes 4.
    let back = lens(&h.step(56));
    assert_eq!(h.s.seq(a).unwrap().tokens.len(), 17, "16, and the one this step sampled");
    assert_eq!(back, vec![(a, 12, 4)]);
}

/// Outputs of steps and pool state agree with caching off: nothing is looked up or kept
/// beyond what a request holds.
#[test]
fn without_prefix_caching_nothing_is_cached() {
    let mut h = Harness::new(16, 4, 8, 64);
    let prompt: Vec<u32> = (1..=10).collect();
    h.s.add(0, &prompt, 1, None);
    h.step(1);
    h.step(2);
    let b = h.s.add(1, &prompt, 1, None)[0];
    assert!(lens(&h.step(3)).contains(&(b, 0, 10)));
    assert_eq!(h.pool.num_cached(), 0);
    assert_eq!((h.s.prefix_queries, h.s.prefix_hits), (0, 0));
}

/// Requests that arrive together with the same prompt compute it once: the first's blocks
/// are offered as its step is planned, and the second, admitted in the same step, adopts
/// them (their keys and values are written before attention reads them).
#[test]
fn requests_admitted_together_compute_a_shared_prompt_once() {
    let mut h = Harness::with_caching(16, 4, 8, 64, true);
    let prompt: Vec<u32> = (1..=10).collect();
    let a = h.s.add(0, &prompt, 1, None)[0];
    let b = h.s.add(1, &prompt, 1, None)[0];
    assert_eq!(lens(&h.step(5)), vec![(a, 0, 10), (b, 8, 2)]);
    assert_eq!(h.pool.table(b).unwrap()[..2], h.pool.table(a).unwrap()[..2]);
    // A prompt longer than the step's budget: the next request adopts the chunk computed.
    let mut h = Harness::with_caching(16, 4, 8, 12, true);
    let long: Vec<u32> = (1..=20).collect();
    let c = h.s.add(0, &long, 1, None)[0];
    let d = h.s.add(1, &long, 1, None)[0];
    assert_eq!(lens(&h.step(5)), vec![(c, 0, 12)]);
    // d takes the 12 computed and the 4 c computes in this step: it keeps its last 4.
    assert_eq!(lens(&h.step(5)), vec![(c, 12, 8), (d, 16, 4)]);
}

#[test]
fn the_priority_policy_orders_the_queue_and_preempts_worse_running_requests() {
    let cfg = |priority| SchedulerConfig {
        max_num_seqs: 2,
        max_num_batched_tokens: 64,
        block_size: 4,
        num_blocks: 32,
        max_loras: 0,
        prefix_caching: false,
        priority,
    };
    for policy in [false, true] {
        let mut h = Harness { s: Scheduler::new(cfg(policy)), pool: BlockPool::new(32, 4) };
        // Two requests run (priority 5 and 1); then 0, 3 and -2 arrive.
        for (group, p) in [(0, 5), (1, 1)] {
            h.s.add(group, &[1, 2, 3], 1, None);
            h.s.set_priority(group, p);
        }
        h.step(7);
        for (group, p) in [(2, 0), (3, 3), (4, -2)] {
            h.s.add(group, &[4, 5, 6], 1, None);
            h.s.set_priority(group, p);
        }
        let groups = |h: &Harness, plan: &StepPlan| -> (Vec<u64>, Vec<u64>) {
            let ran = plan.seqs.iter().map(|s| h.s.seq(s.seq).unwrap().group).collect();
            (ran, h.s.waiting.iter().map(|&id| h.s.seq(id).unwrap().group).collect())
        };
        let plan = h.step(7);
        if policy {
            // -2 ranks above 5: the worst running one gives way, and -2 starts beside 1.
            assert_eq!((plan.num_preempted, groups(&h, &plan)), (1, (vec![1, 4], vec![2, 3, 0])));
            // Then 0 ranks above 1, which gives way and waits before 3 and 5.
            let plan = h.step(7);
            assert_eq!((plan.num_preempted, groups(&h, &plan)), (1, (vec![4, 2], vec![1, 3, 0])));
        } else {
            // First come first served: the running ones go on, the newcomers wait in order.
            assert_eq!((plan.num_preempted, groups(&h, &plan)), (0, (vec![0, 1], vec![2, 3, 4])));
        }
    }
}

impl Harness {
    /// Plans a step, applies its block ops and launches it (beams then await their answer).
    fn launch(&mut self) -> StepPlan {
        let plan = self.s.schedule().expect("work to do");
        self.pool.apply(&plan.ops).expect("the plan fits the pool");
        assert_eq!(self.pool.num_free(), self.s.free_blocks(), "mirror of the free count");
        for sq in &plan.seqs {
            self.s.on_launched(sq);
        }
        plan
    }

    fn table(&self, seq: SeqId) -> Vec<BlockId> {
        self.pool.table(seq).expect("the sequence holds blocks").to_vec()
    }
}

/// A beam takes no step while its answer is out or once it has answered; a fork shares
/// its parent's full blocks and gets a copy of the partly filled one, made before the step.
#[test]
fn a_forked_beam_shares_full_blocks_and_copies_the_partial_one() {
    let mut h = Harness::new(8, 4, 8, 64);
    let a = h.s.add(0, &[1, 2, 3, 4, 5, 6], 1, None)[0];
    h.s.set_beam(0);
    assert_eq!(lens(&h.launch()), vec![(a, 0, 6)]);
    assert!(h.s.schedule().is_none(), "no step while the answer is out");
    assert!(h.s.take_beam_result(a, 6));
    assert!(h.s.schedule().is_none(), "an answered beam waits for the search");
    let b = h.s.fork_beam(a, 8);
    h.s.extend_beam(a, 7);
    let plan = h.launch();
    assert_eq!(lens(&plan), vec![(a, 6, 1), (b, 6, 1)]);
    let (ta, tb) = (h.table(a), h.table(b));
    assert_eq!((ta.len(), tb.len()), (2, 2));
    assert_eq!(ta[0], tb[0], "the full block is shared");
    assert_ne!(ta[1], tb[1]);
    assert_eq!(plan.copies, vec![(ta[1], tb[1])], "the partial block is copied");
    assert_eq!(h.s.seq(b).unwrap().tokens, vec![1, 2, 3, 4, 5, 6, 8]);
    // A dropped beam gives back its own blocks only.
    assert!(h.s.take_beam_result(a, 7) && h.s.take_beam_result(b, 7));
    h.s.drop_beam(b);
    let plan = h.s.schedule().expect("the free is delivered");
    h.pool.apply(&plan.ops).unwrap();
    assert!(plan.seqs.is_empty());
    assert_eq!(h.pool.num_free(), 6);
}

/// When every running beam has answered and a sibling cannot fit, the last answered one is
/// preempted (it keeps its answer and takes no step until extended); while a running
/// sequence can still move, nothing is preempted for the sibling.
#[test]
fn answered_beams_make_room_for_a_sibling_that_cannot_fit() {
    let mut h = Harness::new(4, 4, 8, 64);
    let a = h.s.add(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 1, None)[0];
    h.s.set_beam(0);
    h.launch();
    assert!(h.s.take_beam_result(a, 9));
    let b = h.s.fork_beam(a, 21);
    h.s.extend_beam(a, 20);
    assert_eq!(lens(&h.launch()), vec![(a, 9, 1), (b, 9, 1)]);
    assert_eq!(h.pool.num_free(), 0);
    assert!(h.s.take_beam_result(a, 10));
    // b is preempted with its step out; that step's answer no longer counts.
    h.s.preempt(b);
    assert!(!h.s.take_beam_result(b, 10));
    let plan = h.launch();
    assert_eq!(lens(&plan), vec![(b, 0, 10)]);
    assert_eq!(plan.num_preempted, 1);
    assert!(h.s.take_beam_result(b, 10));
    assert!(h.s.schedule().is_none(), "both have answered: a waits in the queue");
    h.s.extend_beam(a, 30);
    h.s.extend_beam(b, 31);
    let plan = h.launch();
    assert_eq!(lens(&plan), vec![(b, 10, 1)], "a waits for blocks b does not give up");
    assert_eq!(plan.num_preempted, 0);
    assert!(h.s.take_beam_result(b, 11));
    let plan = h.launch();
    assert_eq!(lens(&plan), vec![(a, 0, 11)]);
    assert_eq!(plan.num_preempted, 1);
}
