//! Shutting down without cutting anyone off unannounced. On SIGTERM or SIGINT the server
//! drains: `/health` answers 503, new generations get 503, and running ones may finish for
//! `--shutdown-timeout` seconds. What is still running then ends with an error event and
//! `[DONE]` (SSE), an error frame and a close with 1001 (WebSocket), or a 500 carrying the
//! reason (non-streamed); then the server stops.

use std::time::{Duration, Instant};

use actix_web::web;

use super::{AppState, ServeArgs};
use crate::engine::{Architectures, EngineError};

/// Where the server is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Serving,
    /// Running requests finish; new ones are refused.
    Draining,
    /// The drain time is over: what still runs is being ended.
    Cut,
}

/// The message every generation still running at the cut ends with.
pub const CUT_MESSAGE: &str = "the server is shutting down: the request was ended after --shutdown-timeout";

/// Serves until SIGTERM or SIGINT, then drains and stops as the module describes.
pub async fn serve<A: Architectures>(args: ServeArgs) -> Result<(), EngineError> {
    if args.engine.cluster.node_rank > 0 {
        // A node other than node 0 serves no API: it runs its rank's steps until node 0 goes.
        let engine = args.engine.clone();
        return actix_rt::task::spawn_blocking(move || crate::cluster::worker::run(engine))
            .await
            .map_err(|e| EngineError::Cluster(format!("the node's thread: {e}")))?;
    }
    let drain = Duration::from_secs_f64(args.shutdown_timeout);
    let engine = crate::Engine::start_with_architectures::<A>(args.engine.clone()).await?;
    let (server, _, state) = super::bind(args, engine, true)?;
    let handle = server.handle();
    let running = actix_rt::spawn(server);
    wait_for_signal().await;
    tracing::info!(drain_s = drain.as_secs_f64(), live = state.live.len(), "shutting down: draining");
    state.phase.send_replace(Phase::Draining);
    let until = Instant::now() + drain;
    while !state.live.is_empty() && Instant::now() < until {
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    if !state.live.is_empty() {
        tracing::info!(live = state.live.len(), "drain time over: ending the requests still running");
        state.phase.send_replace(Phase::Cut);
        state.engine.end_all(CUT_MESSAGE).await?;
        // The error events reach their clients, and each WebSocket closes once its
        // generations have ended.
        let until = Instant::now() + Duration::from_secs(5);
        while (!state.live.is_empty() || state.open_sockets() > 0) && Instant::now() < until {
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
    }
    state.phase.send_replace(Phase::Cut);
    handle.stop(true).await;
    let _ = running.await;
    tracing::info!("server stopped");
    Ok(())
}

async fn wait_for_signal() {
    use actix_rt::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = actix_rt::signal::ctrl_c().await;
        }
    }
}

impl AppState {
    /// Whether new generations are taken.
    pub fn serving(&self) -> bool {
        *self.phase.borrow() == Phase::Serving
    }

    /// WebSocket sessions still open.
    pub fn open_sockets(&self) -> usize {
        self.phase.receiver_count()
    }
}

/// A receiver of the server's phase, for a WebSocket session (its count is the number of
/// sessions open).
pub fn watch_phase(state: &web::Data<AppState>) -> tokio::sync::watch::Receiver<Phase> {
    state.phase.subscribe()
}
