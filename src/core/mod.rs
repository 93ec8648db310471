//! Plain cores under the actors: block accounting, scheduling and output processing.
//! No actix types here; each is unit-tested without a model.

pub mod beam;
pub mod block_pool;
pub mod lora_slots;
pub mod output;
pub mod scheduler;
