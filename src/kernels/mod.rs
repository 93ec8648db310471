//! Device code. Model files are written once against the [`Device`] trait; each device
//! (the CPU, and CUDA GPUs through cudarc) implements its operations.
//!
//! Activations are 2-D `[rows, cols]` f32 tensors: rows are the flattened tokens of a batch.
//! Weights keep the checkpoint's dtype (f32, bf16, f16) and are multiplied with f32
//! accumulation. The paged KV cache of one layer is owned by the device as [`Device::Cache`].

pub mod attn;
pub mod cpu;
pub mod cuda;
pub mod e4m3;
pub mod e5m2;
pub mod moe;
pub mod quant;
mod rope;
pub mod rows;

pub use moe::MoeSpec;
pub use rope::{RopeByLen, RopeSpec};

use crate::kernels::attn::AttnMetadata;
use crate::request::TokenLogprobs;
use crate::sampling::SampleInput;

/// A host-side tensor in a checkpoint dtype, ready to be uploaded as a weight. Its bytes
/// are borrowed straight from the memory-mapped checkpoint when no conversion or stacking
/// was needed.
pub struct HostTensor<'a> {
    pub dtype: DType,
    /// Row-major, outermost first (`[out_features, in_features]` for a linear weight).
    pub shape: Vec<usize>,
    /// Little-endian element bytes.
    pub data: std::borrow::Cow<'a, [u8]>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// llama.cpp's blocks (of 32 elements, or K-quant super-blocks of 256), kept by
    /// `--keep-quantized` (CPU only).
    Quant(quant::QuantFormat),
    /// 4-bit integers in groups with 16-bit scales (GPTQ, AWQ, compressed-tensors), kept
    /// packed for the GPU's kernels; the CPU widens them at upload.
    Rows(rows::RowFormat),
}

impl DType {
    /// Bytes of one element of a float dtype. A block format has no element size: callers
    /// that may see one size rows with [`DType::row_bytes`].
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Quant(f) => panic!("{f} blocks have no element size"),
            DType::Rows(f) => panic!("{f} have no element size"),
        }
    }
    /// Bytes of `n` consecutive elements (a multiple of 32 for a block format).
    pub fn row_bytes(self, n: usize) -> usize {
        match self {
            DType::Quant(f) => f.row_bytes(n),
            DType::Rows(f) => {
                assert!(n.is_multiple_of(f.cols as usize), "{f} are taken whole rows at a time");
                n / f.cols as usize * f.row_bytes()
            }
            _ => n * self.size(),
        }
    }
    /// The 16-bit type a kept 4-bit weight widens to (its scales'); `self` otherwise.
    pub fn widened(self) -> DType {
        match self {
            DType::Rows(f) if f.f16 => DType::F16,
            DType::Rows(_) => DType::BF16,
            d => d,
        }
    }
    /// Whether elements are packed in blocks or rows (no element size).
    pub fn is_packed(self) -> bool {
        matches!(self, DType::Quant(_) | DType::Rows(_))
    }
    /// f32 `values` as little-endian elements of `self` (a float dtype).
    pub fn encode_f32(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * self.size());
        self.convert_from(DType::F32, bytemuck::cast_slice(values), &mut out);
        out
    }
    /// Converts little-endian elements of `src_dtype` into `self`, appending to `out`.
    /// Blocks are dequantized; `self` is a float dtype unless it equals `src_dtype`.
    pub fn convert_from(self, src_dtype: DType, src: &[u8], out: &mut Vec<u8>) {
        if self == src_dtype {
            out.extend_from_slice(src);
            return;
        }
        assert!(!self.is_packed(), "nothing is quantized to {self:?} on load");
        if src_dtype.is_packed() {
            let mut v = Vec::new();
            match src_dtype {
                DType::Quant(f) => f.dequantize(src, &mut v),
                DType::Rows(f) => f.dequantize(src, &mut v),
                _ => unreachable!("packed"),
            }
            let f32_bytes: &[u8] = bytemuck::cast_slice(&v);
            return self.convert_from(DType::F32, f32_bytes, out);
        }
        let n = src.len() / src_dtype.size();
        out.reserve(n * self.size());
        for i in 0..n {
            let b = &src[i * src_dtype.size()..(i + 1) * src_dtype.size()];
            let v = match src_dtype {
                DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
                DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                DType::Quant(_) | DType::Rows(_) => unreachable!("dequantized above"),
            };
            match self {
                DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
                DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
                DType::Quant(_) | DType::Rows(_) => unreachable!("asserted above"),
            }
        }
    }
}

/// Geometry of one layer's paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// The KV cache's element type (`--kv-cache-dtype`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
pub enum KvDtype {
    /// The device's own: f32 on the CPU; on a GPU the 16-bit type of a 16-bit model, else f32.
    #[default]
    Auto,
    /// OCP FP8 E4M3 (`float8_e4m3fn`), vLLM's `fp8`: each value divided by the layer's
    /// scale (the checkpoint's, else 1), rounded to the nearest of its 8-bit values (ties to
    /// even) and saturated at ±448. A quarter of f32's bytes, half of a 16-bit type's.
    #[value(name = "fp8", alias = "fp8_e4m3")]
    Fp8E4m3,
    /// OCP FP8 E5M2 (`float8_e5m2`), vLLM's `fp8_e5m2`: the top byte of a half, nearest
    /// even, saturated at ±57344; two mantissa bits where e4m3 has three, and the range of
    /// a half, so that values need no scale to fit.
    #[value(name = "fp8_e5m2")]
    Fp8E5m2,
}

impl KvDtype {
    /// Bytes of an element, where `auto` is the bytes of the device's own type.
    pub fn elem_bytes(self, auto: usize) -> usize {
        match self.fp8() {
            None => auto,
            Some(_) => 1,
        }
    }

    /// The FP8 format of an FP8 cache.
    pub fn fp8(self) -> Option<Fp8Format> {
        match self {
            KvDtype::Auto => None,
            KvDtype::Fp8E4m3 => Some(Fp8Format::E4m3),
            KvDtype::Fp8E5m2 => Some(Fp8Format::E5m2),
        }
    }
}

/// What the largest key of the first batch is stored as under --calculate-kv-scales (vLLM's
/// K_SCALE_CONSTANT): e4m3's ±448 leaves room for keys 2.24 times as large.
pub const K_SCALE_RANGE: f32 = 200.0;
/// As [`K_SCALE_RANGE`] for values (vLLM's V_SCALE_CONSTANT).
pub const V_SCALE_RANGE: f32 = 100.0;

/// The two OCP FP8 formats an FP8 KV cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    E4m3,
    E5m2,
}

impl Fp8Format {
    /// Each byte's value.
    pub fn values(self) -> &'static [f32; 256] {
        match self {
            Fp8Format::E4m3 => e4m3::values(),
            Fp8Format::E5m2 => e5m2::values(),
        }
    }
}

/// The per-tensor scales of one layer's FP8 KV cache (a checkpoint's `k_scale` and
/// `v_scale`): a key `x` is stored as the e4m3 byte nearest `x / k` (saturated) and read
/// back as that byte's value times `k`; a value likewise by `v`. 1 where the checkpoint has
/// none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvScales {
    pub k: f32,
    pub v: f32,
}

impl Default for KvScales {
    fn default() -> Self {
        Self { k: 1.0, v: 1.0 }
    }
}

/// Shape and options of an attention call: query heads, kv heads, head size, the softmax
/// scale, a sliding window (a query at position p sees positions above p − window; 0 for
/// none) and a soft cap on the scores (`cap · tanh(s / cap)`; 0 for none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub window: usize,
    pub softcap: f32,
}

impl AttnShape {
    /// Full causal attention with `1/√head_dim` scaling and no soft cap.
    pub fn causal(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        let scale = 1.0 / (head_dim as f32).sqrt();
        Self { num_heads, num_kv_heads, head_dim, scale, window: 0, softcap: 0.0 }
    }
    /// Whether an option the plain kernels lack is set.
    pub fn has_options(&self) -> bool {
        self.window > 0 || self.softcap > 0.0
    }
    /// First context position a query at `pos` attends to.
    pub fn first_visible(&self, pos: usize) -> usize {
        match self.window {
            0 => 0,
            w => (pos + 1).saturating_sub(w),
        }
    }
}

/// MLP activations, by the names of HF's `ACT2FN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` ("silu", "swish").
    Silu,
    /// GELU's tanh approximation ("gelu_pytorch_tanh", "gelu_new").
    GeluTanh,
    /// `max(x, 0)` ("relu").
    Relu,
}

impl Activation {
    pub const HF_NAMES: &str = "silu, swish, gelu_pytorch_tanh, gelu_new, relu";

    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Some(Self::GeluTanh),
            "relu" => Some(Self::Relu),
            _ => None,
        }
    }

    /// The activation of one value in f32, as torch computes it.
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Self::Silu => x / (1.0 + (-x).exp()),
            Self::GeluTanh => {
                const K: f32 = 0.797_884_6; // √(2/π)
                0.5 * x * (1.0 + (K * (x + 0.044715 * x * x * x)).tanh())
            }
            Self::Relu => x.max(0.0),
        }
    }
}

/// Geometry of one target module's LoRA weights across the device's adapter slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraShape {
    pub slots: usize,
    pub max_rank: usize,
    pub in_features: usize,
    pub out_features: usize,
    /// Store the weights in bf16 (`--lora-dtype bfloat16`) rather than f32.
    pub bf16: bool,
}

/// One adapter's weights for one module, to place in a slot.
pub struct LoraSlotWeights<'a> {
    /// `[rank, in]`
    pub a: &'a [f32],
    /// `[out, rank]`
    pub b: &'a [f32],
    pub rank: usize,
    pub scale: f32,
}

/// This device's place in a tensor-parallel group (rank 0 of 1 without parallelism).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpRank {
    pub rank: usize,
    pub world: usize,
}

impl TpRank {
    pub const SINGLE: TpRank = TpRank { rank: 0, world: 1 };
}

/// Whether a tensor-parallel group can still run. Once a rank is lost (it failed, stopped
/// or did not reach a collective in time) the group stays failed: its ranks are out of step.
pub trait GroupHealth: Send + Sync {
    /// Why the group can no longer run, once it cannot.
    fn failure(&self) -> Option<String>;
    /// Marks the group failed for `why` (a rank has gone or left a step part-way): no
    /// collective can complete, and every rank waiting in one fails with the reason.
    fn fail(&self, why: String);
}

/// The ranks of a tensor-parallel group that run in other processes (other nodes), as rank
/// 0 sees them: each step's inputs go to them encoded, and each answers once its share of
/// the forward is done.
pub trait RemoteRanks: Send + Sync {
    /// Sends one step's encoded inputs to every remote rank.
    fn send_step(&self, step: &[u8]) -> DevResult<()>;
    /// Waits until every remote rank has run the step sent last.
    fn join_step(&self) -> DevResult<()>;
    /// Sends an encoded command outside the steps (the cache's sizing and allocation) to
    /// every other node, and answers each node's encoded reply, in rank order.
    fn command(&self, command: &[u8]) -> DevResult<Vec<Vec<u8>>>;
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("weight has {got} bytes, shape {shape:?} of {dtype:?} needs {need}")]
    WeightSize { shape: Vec<usize>, dtype: DType, got: usize, need: usize },
    #[error("CUDA {what} failed: {detail}")]
    Cuda { what: &'static str, detail: String },
    #[error("device error: {0}")]
    Other(String),
}

/// What a device operation gives: a failed launch, copy or allocation is an error the
/// ModelRunner hands to the requests of that step.
pub type DevResult<T> = Result<T, DeviceError>;

/// A sampled token with its logprobs when they were asked for.
pub type Sampled = (u32, Option<TokenLogprobs>);

/// A sampling issued by [`Device::sample_rows_issue`]: its rows' results already on the
/// host, or the device's number for one still running.
#[derive(Debug)]
pub enum SampleTicket {
    Done(Vec<Sampled>),
    Issued(u64),
}

/// A forward's token id `FED_TOKEN | i` stands for the token that the last sampling issued
/// (and not yet collected) picked for its row i, on a device that
/// [feeds sampled tokens](Device::feeds_sampled_tokens). Vocabularies stay below it.
pub const FED_TOKEN: u32 = 1 << 31;

/// What `Device::tune_gemms` did.
#[derive(Debug, Clone, Default)]
pub struct GemmTuning {
    /// (shape, row count) points timed, and those where a cuBLASLt algorithm won.
    pub points: usize,
    pub lt_chosen: usize,
    /// cuBLASLt candidates tried, and those dropped: failed, or off cublasGemmEx's output.
    pub candidates: usize,
    pub rejected: usize,
    /// One GEMM at every point, summed (µs): by cublasGemmEx and by the chosen algorithms.
    pub gemm_ex_us: f64,
    pub chosen_us: f64,
    /// Points not timed: their operands did not fit in device memory.
    pub skipped: usize,
}

/// The operations a model's forward needs. Every method works on whole flat batches.
pub trait Device: Send + Unpin + 'static {
    /// `[rows, cols]` f32 activations living on the device.
    type Tensor: Send;
    /// An immutable parameter living on the device.
    type Weight: Send + Sync;
    /// One layer's paged K and V cache.
    type Cache: Send + Unpin;
    /// One target module's LoRA A/B weights for every adapter slot.
    type Lora: Send + Sync + Unpin;
    /// A recorded forward that replays without the host issuing its operations.
    type Graph: Send + Unpin;

    /// Whether the KV cache is sized from the device's free memory (after a profiling
    /// step) rather than by `--kv-cache-space`.
    const SIZES_KV_CACHE: bool = false;

    fn name(&self) -> String;
    /// Rank and group size under tensor parallelism.
    fn tp(&self) -> TpRank;
    /// Sums `x` over every rank of the group, in place; each rank ends with the same
    /// values (RowParallelLinear, VocabParallelEmbedding). A no-op for a group of one.
    fn all_reduce(&self, x: &mut Self::Tensor) -> DevResult<()>;
    /// Every rank's `[rows, c]` shard, its first `keep` columns, side by side in rank order
    /// and cut at `total` columns: `[rows, total]` on every rank (ParallelLMHead's gather).
    fn all_gather_cols(&self, x: &Self::Tensor, keep: usize, total: usize) -> DevResult<Self::Tensor>;
    /// The ranks of this device's group that run in other processes, on rank 0 of a group
    /// that spans nodes.
    fn remote_ranks(&self) -> Option<std::sync::Arc<dyn RemoteRanks>> {
        None
    }
    /// The health of this device's tensor-parallel group (None outside one, or where the
    /// device does not watch it).
    fn group_health(&self) -> Option<std::sync::Arc<dyn GroupHealth>> {
        None
    }
    /// Fails this device's group: this rank left a step part-way (an error in its forward),
    /// so the others must stop waiting for it.
    fn fail_group(&self, why: &str) {
        let _ = why;
    }
    /// (free, total) bytes of device memory; None on the CPU (sized by --kv-cache-space).
    fn memory_info(&self) -> Option<(usize, usize)>;
    fn upload(&self, t: HostTensor<'_>) -> Result<Self::Weight, DeviceError>;
    /// One layer's cache of `shape`, its elements of `dtype`.
    fn alloc_cache(&self, shape: CacheShape, dtype: KvDtype) -> Result<Self::Cache, DeviceError>;
    /// Gives an FP8 cache the scales its keys and values are stored by (none else has any).
    fn set_kv_scales(&self, cache: &mut Self::Cache, scales: KvScales) -> Result<(), DeviceError>;
    /// Has an FP8 cache take its scales from the first keys and values written into it, as
    /// vLLM's --calculate-kv-scales: k by max |k| / [`K_SCALE_RANGE`], v by max |v| /
    /// [`V_SCALE_RANGE`] (a scale stays 1 where they are all 0).
    fn calculate_kv_scales(&self, cache: &mut Self::Cache) -> Result<(), DeviceError>;
    /// Copies whole blocks of one layer's cache, keys and values, for each (source,
    /// destination) pair in order (a forked beam's copy of its parent's last block). Issued
    /// before the step's forward, on its stream.
    fn copy_blocks(&self, cache: &mut Self::Cache, pairs: &[(u32, u32)]) -> DevResult<()>;
    /// Bytes per K or V element of the caches of `dtype` that `alloc_cache` makes (`Auto`:
    /// f32 unless the device keeps a 16-bit model's cache in its type).
    fn kv_cache_elem_bytes(&self, dtype: KvDtype) -> usize {
        dtype.elem_bytes(4)
    }
    /// Device memory allocations made so far (0 where the device does not count them): in
    /// steady state a step makes none.
    fn allocations(&self) -> u64 {
        0
    }
    /// Times the GEMMs of every projection shape run so far at these row counts and keeps
    /// the fastest algorithm for each (once the profiling step has run the projections); a
    /// no-op where the device has one way to multiply.
    fn tune_gemms(&self, rows: &[usize]) -> DevResult<GemmTuning> {
        let _ = rows;
        Ok(GemmTuning::default())
    }
    fn to_host(&self, t: &Self::Tensor) -> DevResult<Vec<f32>>;
    /// Waits for the work issued so far to finish (a no-op where operations are synchronous).
    fn synchronize(&self) -> DevResult<()>;
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);

    /// `out[i] = table[ids[i]]` → `[ids.len(), hidden]`.
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> DevResult<Self::Tensor>;
    /// `out[i] = table[positions[i] + offset]` → `[positions.len(), hidden]`: learned
    /// position embeddings, read at the step's positions (which a graph replays anew).
    fn embed_positions(
        &self,
        table: &Self::Weight,
        positions: &[u32],
        offset: u32,
    ) -> DevResult<Self::Tensor>;
    /// `x @ w^T (+ bias)`: `[n, in] × [out, in]` → `[n, out]`.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
    ) -> DevResult<Self::Tensor>;
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Weight, eps: f32) -> DevResult<Self::Tensor>;
    /// Fused residual add and norm: `residual += x; return rms_norm(residual)`.
    fn add_rms_norm(
        &self,
        x: &Self::Tensor,
        residual: &mut Self::Tensor,
        w: &Self::Weight,
        eps: f32,
    ) -> DevResult<Self::Tensor>;
    /// `residual += rms_norm(x, pre)`, then the norm of the sum by `w` (a block's output normed
    /// before it joins the residual, as Gemma 2's are, then the next block's input norm).
    fn rms_norm_add_rms_norm(
        &self,
        x: &Self::Tensor,
        pre: (&Self::Weight, f32),
        residual: &mut Self::Tensor,
        (w, eps): (&Self::Weight, f32),
    ) -> DevResult<Self::Tensor> {
        let normed = self.rms_norm(x, pre.0, pre.1)?;
        self.add_rms_norm(&normed, residual, w, eps)
    }
    /// [`Device::add_rms_norm`] (with `residual`) or [`Device::rms_norm`] for a result that
    /// only the GEMM of a projection without adapters reads: a device may keep it only in
    /// the form that GEMM reads.
    fn rms_norm_for_gemm(
        &self,
        x: &Self::Tensor,
        residual: Option<&mut Self::Tensor>,
        w: &Self::Weight,
        eps: f32,
    ) -> DevResult<Self::Tensor> {
        match residual {
            Some(r) => self.add_rms_norm(x, r, w, eps),
            None => self.rms_norm(x, w, eps),
        }
    }
    /// `residual += x @ wᵀ`, then the norm (weights `norm`) of the sum: [`Device::add_rms_norm`]
    /// of [`Device::linear`], or with `gemm_only` [`Device::rms_norm_for_gemm`] of it. A
    /// device may do both in one pass, and with `gemm_only` leave part of the norm to the
    /// GEMM that reads it.
    fn linear_add_rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        residual: &mut Self::Tensor,
        norm: &Self::Weight,
        eps: f32,
        gemm_only: bool,
    ) -> DevResult<Self::Tensor> {
        let y = self.linear(x, w, None)?;
        match gemm_only {
            true => self.rms_norm_for_gemm(&y, Some(residual), norm, eps),
            false => self.add_rms_norm(&y, residual, norm, eps),
        }
    }
    /// LayerNorm with an optional bias: `(x − mean) / √(var + eps) · w (+ b)` per row.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: Option<&Self::Weight>,
        eps: f32,
    ) -> DevResult<Self::Tensor>;
    fn add_inplace(&self, acc: &mut Self::Tensor, x: &Self::Tensor) -> DevResult<()>;
    /// `x *= s`, in place (embeddings scaled by √hidden).
    fn scale(&self, x: &mut Self::Tensor, s: f32) -> DevResult<()>;
    /// `x = cap · tanh(x / cap)`, in place (soft-capped logits).
    fn softcap(&self, x: &mut Self::Tensor, cap: f32) -> DevResult<()>;
    /// `x = act(x)`, in place (the activation of a plain MLP).
    fn activation(&self, x: &mut Self::Tensor, act: Activation) -> DevResult<()>;
    /// `acc[t] += sigmoid(gate[t, 0]) · x[t]` for each row t (a shared expert's output
    /// under its gate, Qwen2-MoE's).
    fn add_sigmoid_gated(
        &self,
        acc: &mut Self::Tensor,
        x: &Self::Tensor,
        gate: &Self::Tensor,
    ) -> DevResult<()>;
    /// A mixture-of-experts MLP (vLLM's FusedMoE) over the rows of `x`: each row's experts
    /// chosen from `router_logits` (`[rows, experts]`) by [`moe::route`]'s rules, then
    /// `Σ w_e · down_e(act(gate_e x) · up_e x)` over them. `gate_up` is
    /// `[experts, 2·inter, hidden]` (each expert's gate rows, then its up rows) and `down`
    /// `[experts, hidden, inter]`; under tensor parallelism each holds this rank's share of
    /// `inter` and the result is this rank's partial sum, for the caller to all-reduce.
    fn fused_moe(
        &self,
        x: &Self::Tensor,
        router_logits: &Self::Tensor,
        gate_up: &Self::Weight,
        down: &Self::Weight,
        spec: MoeSpec,
    ) -> DevResult<Self::Tensor>;
    /// `[n, 2·i]` holding gate then up → `act(gate) · up` of shape `[n, i]`.
    fn act_mul(&self, gate_up: &Self::Tensor, act: Activation) -> DevResult<Self::Tensor>;
    /// RMSNorm over each head of q and k in a fused `[n, q + k + v]` projection of `shape`
    /// (weights `[head_dim]` each), in place, before RoPE (Qwen3's and Gemma3's q/k norms).
    fn qk_norm(
        &self,
        qkv: &mut Self::Tensor,
        shape: AttnShape,
        q_w: &Self::Weight,
        k_w: &Self::Weight,
        eps: f32,
    ) -> DevResult<()>;
    /// Splits the fused `[n, q + k + v]` projection and applies rotary embedding (HF's
    /// rotate-half layout) to q and k at each token's position (`meta.positions`), with
    /// the frequencies of the length it is computed at where they vary. Returns (q, k, v).
    fn split_qkv_rope(
        &self,
        qkv: &Self::Tensor,
        shape: AttnShape,
        rope: &RopeSpec,
        meta: &AttnMetadata,
    ) -> DevResult<(Self::Tensor, Self::Tensor, Self::Tensor)>;
    /// Writes k and v into the cache at `meta.slot_mapping`, then attends each query token
    /// over its sequence's cached context (causal: positions ≤ its own).
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        cache: &mut Self::Cache,
        shape: AttnShape,
        meta: &AttnMetadata,
    ) -> DevResult<Self::Tensor>;
    /// [`Device::paged_attention`] of [`Device::split_qkv_rope`]'s q, k and v: a device may
    /// write k and v into the cache as it splits them.
    fn qkv_attention(
        &self,
        qkv: &Self::Tensor,
        shape: AttnShape,
        rope: &RopeSpec,
        cache: &mut Self::Cache,
        meta: &AttnMetadata,
    ) -> DevResult<Self::Tensor> {
        let (q, k, v) = self.split_qkv_rope(qkv, shape, rope, meta)?;
        self.paged_attention(&q, &k, &v, cache, shape, meta)
    }
    /// [`Device::qkv_attention`] of the fused qkv projection of `x` (weights `w`, `bias`,
    /// no adapters) for attention of shape `shape` with rotary `rope`: a device may apply
    /// RoPE and write k and v into the cache as it projects.
    fn project_qkv_attention(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        (shape, rope): (AttnShape, &RopeSpec),
        cache: &mut Self::Cache,
        meta: &AttnMetadata,
    ) -> DevResult<Self::Tensor> {
        let qkv = self.linear(x, w, bias)?;
        self.qkv_attention(&qkv, shape, rope, cache, meta)
    }
    /// Records the forward `forward` runs on inputs `ids` and `meta` (returning its hidden
    /// states) as a graph to replay, with attention shaped for contexts up to `ctx_bound`.
    /// None on a device without graphs.
    fn capture_graph(
        &self,
        ids: &[u32],
        meta: &AttnMetadata,
        ctx_bound: usize,
        forward: &mut dyn FnMut() -> DevResult<Self::Tensor>,
    ) -> DevResult<Option<Self::Graph>>;
    /// Replays `graph` on a step's inputs, shaped as at its capture: its hidden states.
    fn replay_graph<'g>(
        &self,
        graph: &'g Self::Graph,
        ids: &[u32],
        meta: &AttnMetadata,
    ) -> DevResult<&'g Self::Tensor>;
    /// One token per row of `logits` (row i for `inputs[i]`), with its logprobs where asked,
    /// by the rules of [`crate::sampling`]. A GPU samples the rows itself, so that only
    /// token ids (and requested logprobs) come back.
    fn sample_rows(&self, logits: Self::Tensor, inputs: &[SampleInput]) -> DevResult<Vec<Sampled>>;
    /// [`Device::sample_rows`] without waiting for the device: its results are collected
    /// later with [`Device::sample_rows_collect`], and until then the device may take its
    /// tokens as the next forward's inputs ([`FED_TOKEN`]). A device that samples on the
    /// host returns them at once.
    fn sample_rows_issue(&self, logits: Self::Tensor, inputs: &[SampleInput]) -> DevResult<SampleTicket> {
        self.sample_rows(logits, inputs).map(SampleTicket::Done)
    }
    /// The rows' tokens (and logprobs) of an issued sampling, once the device has them.
    fn sample_rows_collect(&self, ticket: SampleTicket) -> DevResult<Vec<Sampled>> {
        match ticket {
            SampleTicket::Done(rows) => Ok(rows),
            SampleTicket::Issued(_) => {
                Err(DeviceError::Other("no sampling was issued on this device".into()))
            }
        }
    }
    /// Runs a step's forward where this device's kernels are best issued from. The CPU's
    /// kernels each split their work over its compute threads: issued from one of those
    /// threads, each loop's tasks go to the other threads at once, where from any other
    /// thread every kernel would wake a compute thread and then sleep until the last task
    /// is done. Elsewhere `forward` runs in place.
    fn issue_forward<R: Send>(forward: impl FnOnce() -> R + Send) -> R {
        forward()
    }
    /// Whether a forward's token ids may name tokens of the last sampling issued and not
    /// yet collected (`FED_TOKEN | row`): the device puts them in place itself, so that the
    /// next step is issued before the host has the tokens.
    fn feeds_sampled_tokens(&self) -> bool {
        false
    }
    /// Picks rows (the last token of each sequence) → `[rows.len(), cols]`.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> DevResult<Self::Tensor>;

    /// Adapter weights for every slot of a group of modules that read the same x (q, k
    /// and v; gate and up; or one module alone), which [`Device::add_lora`] applies
    /// together.
    fn alloc_lora(&self, shapes: &[LoraShape]) -> Result<Vec<Self::Lora>, DeviceError>;
    /// Loads an adapter's weights into `slot` (None clears the slot).
    fn set_lora_slot(
        &self,
        lora: &mut Self::Lora,
        slot: usize,
        weights: Option<LoraSlotWeights>,
    ) -> DevResult<()>;
    /// Batched LoRA (Punica's BGMV): for each row t with `slots[t] >= 0`,
    /// `y[t, offset..offset+out] += scale · B_s (A_s x[t])` with s = slots[t]; rows whose
    /// slot is negative (no adapter) are untouched. One call serves a mixed batch.
    /// `modules` are (weights, column offset in y) of projections that read the same `x`
    /// (q/k/v, gate/up): they share one pass over the rows.
    fn add_lora(
        &self,
        y: &mut Self::Tensor,
        x: &Self::Tensor,
        modules: &[(&Self::Lora, usize)],
        slots: &[i32],
    ) -> DevResult<()>;
    /// [`Device::linear`] with the LoRA deltas of `modules` added as [`Device::add_lora`]
    /// adds them; a device may compute the deltas first and let the projection add itself
    /// to them.
    fn linear_lora(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        modules: &[(&Self::Lora, usize)],
        slots: &[i32],
    ) -> DevResult<Self::Tensor> {
        let mut y = self.linear(x, w, bias)?;
        self.add_lora(&mut y, x, modules, slots)?;
        Ok(y)
    }
    /// [`Device::linear`], or [`Device::linear_lora`] when `lora` holds the projection's
    /// adapters for the batch.
    fn project(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        lora: LoraRows<Self::Lora>,
    ) -> DevResult<Self::Tensor> {
        match lora {
            Some((modules, slots)) => self.linear_lora(x, w, bias, modules, slots),
            None => self.linear(x, w, bias),
        }
    }
    /// `act(gate) · up` of a fused gate/up projection (`[gate | up]` rows of w), with
    /// `lora`'s deltas (modules and each row's slot) added to the projection first:
    /// [`Device::act_mul`] of [`Device::project`]. A device may keep the projection in the
    /// weights' 16-bit type in between, as a 16-bit model (and transformers) computes it;
    /// and, with `gemm_only` (only the GEMM of a projection without adapters reads the
    /// result), keep the result only in the form that GEMM reads.
    fn gate_up_act(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        lora: LoraRows<Self::Lora>,
        act: Activation,
        gemm_only: bool,
    ) -> DevResult<Self::Tensor> {
        let _ = gemm_only;
        self.act_mul(&self.project(x, w, None, lora)?, act)
    }
}

/// A projection's LoRA adapters for a step: its modules (adapter weights for every slot,
/// and their first column in the projection's output) and each row's slot.
pub type LoraRows<'a, L> = Option<(&'a [(&'a L, usize)], &'a [i32])>;
