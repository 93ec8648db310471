//! Attention metadata: what a batch's flat tokens need to find their sequence's KV cache.
//! Built by the ModelRunner from the Scheduler's batch; models pass it through untouched to
//! the kernels, which read it.

/// Per-step metadata for flat tokens of mixed prefill and decode sequences.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct AttnMetadata {
    /// Per token: its position in its sequence (also the RoPE position).
    pub positions: Vec<u32>,
    /// Per token: the cache slot (`block · block_size + offset`) its K/V are written to.
    pub slot_mapping: Vec<i64>,
    /// Per token: index of its sequence in `block_tables`.
    pub token_seq: Vec<u32>,
    /// Per sequence: the physical blocks holding its context, in order.
    pub block_tables: Vec<Vec<u32>>,
    /// Per sequence: row of its last token in the flat batch (the row that is sampled).
    pub last_token_rows: Vec<usize>,
    /// Per token: its adapter slot (-1 = base model). Empty when no token uses an adapter.
    pub lora_slots: Vec<i32>,
    /// Per sequence: the length of its prompt (empty: none known). Rotary embeddings whose
    /// frequencies follow the length of the forward (dynamic NTK, LongRoPE) read it.
    pub prompt_lens: Vec<u32>,
}
