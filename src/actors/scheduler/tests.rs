//! The Scheduler actor against a slow fake BlockManager and a recording fake runner.

use std::sync::Mutex;
use std::time::Duration;

use super::*;
use crate::actors::block_manager::Reserved;
use crate::actors::model_runner::{Sampled, StepOutput};
use crate::core::block_pool::BlockPool;
use crate::kernels::DType;
use crate::models::random::{Preset, make_random_model};

struct SlowBlocks(BlockPool);
impl Actor for SlowBlocks {
    type Context = Context<Self>;
}
impl Handler<Reserve> for SlowBlocks {
    type Result = ResponseActFuture<Self, Result<Reserved, BlockError>>;
    fn handle(&mut self, msg: Reserve, _: &mut Context<Self>) -> Self::Result {
        let applied = self.0.apply(&msg.ops).map(|_| {
            let tables =
                msg.tables_for.iter().map(|&s| self.0.table(s).map(<[u32]>::to_vec).unwrap_or_default());
            Reserved { tables: tables.collect(), num_free: self.0.num_free() }
        });
        Box::pin(
            actix_rt::time::sleep(Duration::from_millis(100)).into_actor(self).map(move |_, _, _| applied),
        )
    }
}

#[derive(Default)]
struct Recorder(Arc<Mutex<Vec<Vec<SeqId>>>>);
impl Actor for Recorder {
    type Context = Context<Self>;
}
impl Handler<ExecuteBatch> for Recorder {
    type Result = Result<StepOutput, super::super::model_runner::RunnerError>;
    fn handle(&mut self, b: ExecuteBatch, _: &mut Context<Self>) -> Self::Result {
        self.0.lock().unwrap().push(b.seqs.iter().map(|s| s.seq).collect());
        Ok(StepOutput { sampled: token_fives(&b), ..Default::default() })
    }
}

/// Token 5 for every sequence of the batch that samples.
fn token_fives(b: &ExecuteBatch) -> Vec<Sampled> {
    b.seqs.iter().filter(|s| s.sample).map(|s| Sampled { seq: s.seq, token: 5, logprobs: None }).collect()
}

/// A scheduler over the tiny random model's tokenizer: 8 sequences, 64 tokens a step, 32
/// blocks of 4.
fn start_scheduler(
    blocks: Recipient<Reserve>,
    runner: Recipient<ExecuteBatch>,
    async_scheduling: bool,
) -> Addr<SchedulerActor> {
    let dir = crate::scratch::ScratchDir::new("sched").unwrap();
    make_random_model(Preset::Tiny.shape(), dir.path(), DType::F32, 1, 1.0).unwrap();
    let tokenizer = Arc::new(Tokenizer::load(dir.path(), &[]).unwrap());
    let cfg = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        block_size: 4,
        num_blocks: 32,
        max_loras: 0,
        prefix_caching: true,
        priority: false,
    };
    let limits = AdmissionLimits { max_model_len: 64, vocab_size: 320, max_waiting: None };
    SchedulerActor::new(cfg, blocks, runner, tokenizer, limits, Arc::default())
        .with_async_scheduling(async_scheduling)
        .start()
}

#[actix_rt::test]
async fn an_abort_while_blocks_are_being_reserved_drops_the_request_from_the_batch() {
    // A paused clock: the slow BlockManager's 100 ms and the wait below pass in order
    // whenever the actors are idle, however busy the machine is.
    tokio::time::pause();
    let batches = Arc::new(Mutex::new(Vec::new()));
    let blocks = SlowBlocks(BlockPool::new(32, 4)).start();
    let runner = Recorder(batches.clone()).start();
    let sched = start_scheduler(blocks.recipient(), runner.recipient(), false);
    let (tx, mut rx) = mpsc::channel(1024);
    let params = Arc::new(SamplingParams { max_tokens: Some(20), ignore_eos: true, ..Default::default() });
    let add = AddRequest { id: "a".into(), prompt_ids: vec![1, 2, 3], params, events: tx, lora: None };
    sched.send(add).await.unwrap().unwrap();
    // The first step is now waiting on the slow BlockManager: abort in that window.
    assert!(sched.send(Abort { id: "a".into(), reason: AbortReason::Cancelled }).await.unwrap());
    actix_rt::time::sleep(Duration::from_millis(400)).await;
    let stats = sched.send(GetStats).await.expect("the scheduler survived");
    assert_eq!((stats.num_running, stats.num_waiting), (0, 0));
    assert!(batches.lock().unwrap().iter().all(|b| b.is_empty()), "the aborted request never ran");
    assert!(matches!(rx.recv().await, Some(TokenEvent::Finished { reason: FinishReason::Abort, .. })));
}

/// A runner whose steps take 150 ms each, one after another, recording when each ends (on
/// the test's paused clock).
#[derive(Default)]
struct SlowRunner {
    ended: Arc<Mutex<Vec<actix_rt::time::Instant>>>,
    busy_until: Option<actix_rt::time::Instant>,
}
impl Actor for SlowRunner {
    type Context = Context<Self>;
}
impl Handler<ExecuteBatch> for SlowRunner {
    type Result = ResponseActFuture<Self, Result<StepOutput, super::super::model_runner::RunnerError>>;
    fn handle(&mut self, b: ExecuteBatch, _: &mut Context<Self>) -> Self::Result {
        if b.seqs.is_empty() {
            // A flush: no work.
            return Box::pin(actix::fut::ready(Ok(StepOutput::default())));
        }
        let sampled = token_fives(&b);
        let now = actix_rt::time::Instant::now();
        let end = self.busy_until.map_or(now, |t| t.max(now)) + Duration::from_millis(150);
        self.busy_until = Some(end);
        let ended = self.ended.clone();
        Box::pin(actix_rt::time::sleep_until(end).into_actor(self).map(move |_, _, _| {
            ended.lock().unwrap().push(actix_rt::time::Instant::now());
            Ok(StepOutput { sampled, ..Default::default() })
        }))
    }
}

/// With async scheduling, a request of two tokens has its second step in flight when its
/// first ends, and no third step to plan: its first token still reaches the client when
/// the first step ends, not with the second.
#[actix_rt::test]
async fn async_scheduling_sends_a_token_when_its_step_ends() {
    tokio::time::pause();
    let ended = Arc::new(Mutex::new(Vec::new()));
    let blocks = crate::actors::block_manager::BlockManager::new(32, 4).start();
    let runner = SlowRunner { ended: ended.clone(), busy_until: None }.start();
    let sched = start_scheduler(blocks.recipient(), runner.recipient(), true);
    let (tx, mut rx) = mpsc::channel(1024);
    let params = Arc::new(SamplingParams { max_tokens: Some(2), ignore_eos: true, ..Default::default() });
    let add = AddRequest { id: "a".into(), prompt_ids: vec![1, 2, 3], params, events: tx, lora: None };
    sched.send(add).await.unwrap().unwrap();
    let first = rx.recv().await;
    let at = actix_rt::time::Instant::now();
    assert!(matches!(first, Some(TokenEvent::Token { .. })), "{first:?}");
    let ended_then = ended.lock().unwrap().len();
    assert_eq!(ended_then, 1, "the first token arrived after {ended_then} steps had ended");
    while let Some(ev) = rx.recv().await {
        if matches!(ev, TokenEvent::Done { .. }) {
            break;
        }
    }
    let ends = ended.lock().unwrap().clone();
    assert_eq!(ends.len(), 2, "two steps for two tokens");
    assert!(at < ends[1], "the first token came before the second step ended");
}

/// A runner that answers each step only when its next message arrives, as a GPU runner
/// whose sampled tokens feed the next step does; it counts the flushes it gets.
#[derive(Default)]
struct DeferringRunner {
    held: Option<(tokio::sync::oneshot::Sender<StepOutput>, StepOutput)>,
    flushes: Arc<Mutex<usize>>,
}
impl Actor for DeferringRunner {
    type Context = Context<Self>;
}
impl Handler<ExecuteBatch> for DeferringRunner {
    type Result = ResponseFuture<Result<StepOutput, super::super::model_runner::RunnerError>>;
    fn handle(&mut self, b: ExecuteBatch, _: &mut Context<Self>) -> Self::Result {
        if let Some((tx, out)) = self.held.take() {
            let _ = tx.send(out);
        }
        if b.seqs.is_empty() {
            *self.flushes.lock().unwrap() += 1;
            return Box::pin(async { Ok(StepOutput::default()) });
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.held = Some((tx, StepOutput { sampled: token_fives(&b), ..Default::default() }));
        Box::pin(async move {
            rx.await.map_err(|_| super::super::model_runner::RunnerError::Device("runner stopped".into()))
        })
    }
}

/// Against a runner that holds each step's answer until its next message, every request
/// still ends, with and without async scheduling: the scheduler follows its last step
/// with a flush whenever nothing else would come.
#[actix_rt::test]
async fn a_runner_that_answers_a_step_at_the_next_message_is_always_sent_one() {
    for async_scheduling in [true, false] {
        let flushes = Arc::new(Mutex::new(0));
        let blocks = crate::actors::block_manager::BlockManager::new(32, 4).start();
        let runner = DeferringRunner { held: None, flushes: flushes.clone() }.start();
        let sched = start_scheduler(blocks.recipient(), runner.recipient(), async_scheduling);
        let mut streams = Vec::new();
        for (i, max_tokens) in [3usize, 5].into_iter().enumerate() {
            let (tx, rx) = mpsc::channel(1024);
            let params = Arc::new(SamplingParams {
                max_tokens: Some(max_tokens),
                ignore_eos: true,
                ..Default::default()
            });
            let add = AddRequest {
                id: format!("r{i}").into(),
                prompt_ids: vec![1, 2, 3],
                params,
                events: tx,
                lora: None,
            };
            sched.send(add).await.unwrap().unwrap();
            streams.push((rx, max_tokens));
        }
        for (mut rx, max_tokens) in streams {
            let mut tokens = 0;
            let done = actix_rt::time::timeout(Duration::from_secs(10), async {
                while let Some(ev) = rx.recv().await {
                    match ev {
                        TokenEvent::Token { .. } => tokens += 1,
                        TokenEvent::Done { .. } => return true,
                        _ => {}
                    }
                }
                false
            })
            .await;
            assert_eq!(done, Ok(true), "a request never ended (async scheduling {async_scheduling})");
            assert_eq!(tokens, max_tokens);
        }
        assert!(*flushes.lock().unwrap() > 0, "the last step was answered without a flush");
    }
}
