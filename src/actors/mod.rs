//! The engine's actors, one per file: the Scheduler drives the step loop, the BlockManager
//! owns the KV cache's blocks, a ModelRunner per device runs the model.

pub mod block_manager;
pub mod lora_manager;
pub mod model_runner;
pub mod scheduler;
