//! The scheduler actor's message handlers: requests in and out, adapters placed at
//! start-up, stats.

use actix::prelude::*;

use super::{
    Abort, AddRequest, EndAll, GetStats, PreloadLoras, SchedulerActor, SchedulerStats, SetMaxWaiting,
};
use crate::actors::model_runner::ExecuteBatch;
use crate::error::EngineError;

impl Actor for SchedulerActor {
    type Context = Context<Self>;
}

impl Handler<AddRequest> for SchedulerActor {
    type Result = Result<(), EngineError>;
    fn handle(&mut self, msg: AddRequest, ctx: &mut Context<Self>) -> Self::Result {
        self.add(msg)?;
        self.maybe_step(ctx);
        Ok(())
    }
}

impl Handler<SetMaxWaiting> for SchedulerActor {
    type Result = ();
    fn handle(&mut self, msg: SetMaxWaiting, _: &mut Context<Self>) {
        self.limits.max_waiting = msg.0;
    }
}

impl Handler<EndAll> for SchedulerActor {
    type Result = ();
    fn handle(&mut self, msg: EndAll, ctx: &mut Context<Self>) {
        self.end_all(msg.0);
        self.maybe_step(ctx);
    }
}

impl Handler<Abort> for SchedulerActor {
    type Result = bool;
    fn handle(&mut self, msg: Abort, ctx: &mut Context<Self>) -> bool {
        let found = self.abort(&msg.id, msg.reason);
        // Deliver the frees even when nothing else is left to run.
        self.maybe_step(ctx);
        self.flush_events();
        found
    }
}

impl Handler<PreloadLoras> for SchedulerActor {
    type Result = ResponseFuture<Result<usize, EngineError>>;
    fn handle(&mut self, msg: PreloadLoras, _: &mut Context<Self>) -> Self::Result {
        let lora_loads: Vec<_> =
            msg.0.into_iter().filter_map(|a| self.core.preload_lora(a.id).map(|slot| (slot, a))).collect();
        let loaded = lora_loads.len();
        // A batch of loads only: the runner places them (on every rank) and runs nothing.
        let batch = ExecuteBatch { lora_loads, ..Default::default() };
        let sent = (loaded > 0).then(|| self.runner.send(batch));
        Box::pin(async move {
            if let Some(sent) = sent {
                sent.await
                    .map_err(|_| EngineError::Stopped)?
                    .map_err(|e| EngineError::Device(e.to_string()))?;
            }
            Ok(loaded)
        })
    }
}

impl Handler<GetStats> for SchedulerActor {
    type Result = MessageResult<GetStats>;
    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        let (running_loras, waiting_loras) = self.core.adapters_in_use();
        MessageResult(SchedulerStats {
            num_running: self.core.num_running(),
            num_waiting: self.core.num_waiting(),
            free_blocks: self.core.free_blocks(),
            total_blocks: self.total_blocks,
            num_preemptions: self.core.total_preemptions,
            last_step: self.last_step,
            busy: self.in_flight > 0,
            lora_slots_used: self.core.lora_slots_used(),
            running_loras,
            waiting_loras,
        })
    }
}
