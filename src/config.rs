//! Engine arguments with vLLM's flag names ([`EngineArgs`], parsed by clap), resolved and
//! validated once into [`EngineConfig`] when the model's shape is known.

use std::path::PathBuf;

use crate::kernels::{DType, KvDtype};
use crate::models::config::ModelConfig;
use crate::models::lora::{LoraSplit, Shard};
use crate::request::MAX_LOGPROBS;

/// Where the README's commands put the default model.
pub const DEFAULT_MODEL_DIR: &str = "models/SmolLM2-135M-Instruct";

/// Where the weights come from (vLLM's `--load-format`, the values it shares with us).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LoadFormat {
    /// The model directory's safetensors.
    #[default]
    Auto,
    Safetensors,
    /// No checkpoint: weights of the config's shapes made at load, deterministic by name
    /// (benchmarks of a model's shapes need only its config.json and tokenizer).
    Dummy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DTypeArg {
    Auto,
    #[value(alias = "float", alias = "f32")]
    Float32,
    #[value(alias = "bf16")]
    Bfloat16,
    #[value(alias = "half", alias = "f16")]
    Float16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// The first CUDA GPU when one is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// A Hugging Face model directory (config.json, safetensors, tokenizer.json), or a model
    /// id (`org/name`) found in the local Hugging Face cache (see [`crate::hub`]).
    #[arg(long, default_value = DEFAULT_MODEL_DIR)]
    pub model: PathBuf,
    /// The branch, tag or commit of a model id to serve from the cache (default `main`).
    #[arg(long)]
    pub revision: Option<String>,
    /// A Hugging Face cache directory searched for model ids before the default cache.
    #[arg(long)]
    pub download_dir: Option<PathBuf>,
    /// Accepted for vLLM's scripts. There is no Python here, so a checkpoint's own modeling
    /// code never runs: models are served by the built-in architectures, and one whose
    /// config needs its remote code is refused.
    #[arg(long)]
    pub trust_remote_code: bool,
    /// Seeds the sampling of requests that set no seed, so that a run is repeatable
    /// (each such request takes the next seed of a sequence that starts here).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most logprobs a request may ask for per token (vLLM's default 20, which is also the
    /// most this engine returns; -1 asks for no limit).
    #[arg(long, default_value_t = MAX_LOGPROBS as i64, allow_negative_numbers = true)]
    pub max_logprobs: i64,
    /// Where defaults for the sampling fields a request leaves unset come from: `auto`, the
    /// model's generation_config.json (temperature, top_p, top_k, min_p,
    /// repetition_penalty, max_new_tokens); `vllm`, vLLM's own defaults; or a directory
    /// holding a generation_config.json.
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    /// The chat template for every chat request that names none: a file, or the template
    /// itself (vLLM's flag); the model's own by default.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Let the model call tools on its own (`tool_choice: "auto"`), read from its output by
    /// --tool-call-parser.
    #[arg(long, requires = "tool_call_parser")]
    pub enable_auto_tool_choice: bool,
    /// How tool calls are read from the model's output: hermes (Qwen2.5, Qwen3),
    /// llama3_json (Llama 3.1/3.2), mistral.
    #[arg(long, value_enum)]
    pub tool_call_parser: Option<crate::structured::tools::ToolParser>,
    /// Reasoning models: the `<think>` block goes to `reasoning_content` (deepseek_r1,
    /// qwen3), and a request's structured output applies to the answer after it.
    #[arg(long, value_enum)]
    pub reasoning_parser: Option<crate::structured::reasoning::ReasoningParser>,
    /// No periodic log line of throughput, queue and KV cache usage (every
    /// VLLM_LOG_STATS_INTERVAL seconds, 10 by default, while the engine is busy).
    #[arg(long)]
    pub disable_log_stats: bool,
    /// No log line when a request starts or finishes.
    #[arg(long)]
    pub disable_log_requests: bool,
    /// Weight dtype; `auto` keeps the checkpoint's.
    #[arg(long, value_enum, default_value_t = DTypeArg::Auto)]
    pub dtype: DTypeArg,
    /// Context length (prompt + output); defaults to the model's max_position_embeddings.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most sequences in one step. Default, as vLLM's: 1024 on a GPU of 70 GiB or more
    /// (other than an A100), else 256.
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Most tokens in one step (longer prompts are prefilled in chunks). Default, as vLLM's:
    /// on a GPU of 70 GiB or more (other than an A100) 8192 for the server and 16384 for the
    /// offline benchmarks; elsewhere 2048 for the server and 8192 for the GPU's offline
    /// benchmarks (2048 on the CPU).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache size in GiB on the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE).
    #[arg(long, default_value_t = 4.0)]
    pub kv_cache_space: f64,
    /// KV cache element type: `auto` (f32 on the CPU; on a GPU the 16-bit type of a 16-bit
    /// model, else f32), `fp8` (alias `fp8_e4m3`: e4m3 by the checkpoint's per-layer
    /// k_scale and v_scale, else a scale of 1, saturating at ±448; a quarter of f32's bytes,
    /// so four times the tokens in the same memory on the CPU, twice on a GPU) or
    /// `fp8_e5m2` (e5m2 bytes, saturating at ±57344; on the CPU only).
    #[arg(long, value_enum, default_value_t = KvDtype::Auto)]
    pub kv_cache_dtype: KvDtype,
    /// vLLM's --calculate-kv-scales: an FP8 KV cache takes each layer's scales from the
    /// first keys and values it stores (k_scale = max |k| / 200, v_scale = max |v| / 100, as
    /// vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT), in place of the checkpoint's or 1.
    /// Needs an FP8 --kv-cache-dtype; on the CPU.
    #[arg(long)]
    pub calculate_kv_scales: bool,
    /// Exact number of KV cache blocks, overriding the size computed from memory.
    #[arg(long)]
    pub num_gpu_blocks_override: Option<usize>,
    /// Fraction of GPU memory the engine may use (weights, activations, KV cache).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Run every step as issued: no CUDA graphs for decode steps.
    #[arg(long)]
    pub enforce_eager: bool,
    /// `auto`/`safetensors` read the checkpoint; `dummy` makes weights of its shapes instead.
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    pub load_format: LoadFormat,
    /// vLLM's quantization method names: a quantized checkpoint's own method (fp8, gptq,
    /// gptq_marlin, awq, awq_marlin, compressed-tensors; the flag may be left out), `fp8`
    /// on a checkpoint that is not quantized (quantized at load, a scale a projection row),
    /// or `gguf` with a .gguf file as --model (dequantized once at import, as a .gguf
    /// --model is without the flag); other methods are refused by name, as are checkpoints
    /// whose config.json names one the loader does not read.
    #[arg(long, short = 'q')]
    pub quantization: Option<String>,
    /// With a .gguf --model on the CPU: keep its Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K matrices in their
    /// blocks and multiply them with the CPU's quantized kernels, as llama.cpp does (a
    /// quarter to a half of bf16's bytes a token; inputs rounded to 8 bits a block), instead
    /// of dequantizing them at import.
    #[arg(long)]
    pub keep_quantized: bool,
    /// `fcfs` (first come first served) or `priority`: requests by their `priority` (lower
    /// first), then arrival, a waiting request preempting running ones it ranks above.
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,
    /// Turns automatic prefix caching off; it is on by default, as in vLLM.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Automatic prefix caching (the default; the flag is accepted for vLLM's scripts).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Plan and send the next step while one runs, so that the host's share of a step
    /// (scheduling, outputs, messages) overlaps the device's; a sequence that stops is given
    /// one step more, whose token is dropped. On by default (vLLM's flag is accepted);
    /// `--async-scheduling=false` runs one step at a time.
    #[arg(
        long,
        default_value_t = true,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub async_scheduling: bool,
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
    /// Ranks the model is split over (one ModelRunner each): GPUs with --device cuda,
    /// threads on the CPU.
    #[arg(long, visible_alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: usize,
    #[command(flatten)]
    pub lora: LoraArgs,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
    /// CPU kernel family: the widest this CPU has (`auto`), or one forced for tests and
    /// comparisons (avx512, avx2: AVX2 with FMA and F16C, portable).
    #[arg(long, value_enum, default_value_t = crate::kernels::cpu::family::CpuKernels::Auto)]
    pub cpu_kernels: crate::kernels::cpu::family::CpuKernels,
    /// Set by the offline benchmarks (vLLM's LLM class): larger default batches.
    #[arg(skip)]
    pub offline: bool,
}

impl EngineArgs {
    /// Fills in the batch limits left unset with vLLM's defaults for a GPU: `large` is a GPU
    /// of 70 GiB or more other than an A100.
    pub fn gpu_batch_defaults(&mut self, large: bool) {
        let tokens = match (large, self.offline) {
            (true, true) => 16384,
            (true, false) | (false, true) => 8192,
            (false, false) => 2048,
        };
        self.max_num_seqs.get_or_insert(if large { 1024 } else { 256 });
        self.max_num_batched_tokens.get_or_insert(tokens);
    }
}

/// LoRA flags, as vLLM names them.
#[derive(Debug, Clone, clap::Args)]
pub struct LoraArgs {
    /// Serve LoRA adapters.
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters to load at start: `name=path`, or vLLM's JSON form
    /// `{"name": ..., "path": ..., "base_model_name": ...}`.
    #[arg(long, num_args = 1.., value_parser = parse_lora_module)]
    pub lora_modules: Vec<(String, PathBuf)>,
    /// Most distinct adapters in one batch (adapter slots on each device).
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Largest adapter rank accepted: one of vLLM's values, 1, 8, 16, 32, 64, 128, 256, 320
    /// or 512.
    #[arg(long, default_value_t = 16, value_parser = parse_max_lora_rank)]
    pub max_lora_rank: usize,
    /// Adapters kept loaded in host memory (default: --max-loras).
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter.
    #[arg(long)]
    pub allow_runtime_lora: bool,
    /// The only directory runtime-loaded adapters may come from.
    #[arg(long)]
    pub lora_root: Option<PathBuf>,
    /// Dtype adapters are kept in on the device: `auto` follows the model's weights.
    #[arg(long, value_enum, default_value_t = DTypeArg::Auto)]
    pub lora_dtype: DTypeArg,
}

impl Default for LoraArgs {
    /// vLLM's defaults, as the flags give them.
    fn default() -> Self {
        Self {
            enable_lora: false,
            lora_modules: Vec::new(),
            max_loras: 1,
            max_lora_rank: 16,
            max_cpu_loras: None,
            allow_runtime_lora: false,
            lora_root: None,
            lora_dtype: DTypeArg::Auto,
        }
    }
}

/// The ranks vLLM's `--max-lora-rank` takes.
pub const MAX_LORA_RANKS: [usize; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];

fn parse_max_lora_rank(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(r) if MAX_LORA_RANKS.contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not one of {MAX_LORA_RANKS:?}")),
    }
}

/// vLLM's JSON form of an adapter on the command line.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LoraModuleJson {
    name: String,
    path: PathBuf,
    /// The base model the adapter was trained on; vLLM shows it in /v1/models.
    #[serde(default)]
    #[allow(dead_code)]
    base_model_name: Option<String>,
}

fn parse_lora_module(s: &str) -> Result<(String, PathBuf), String> {
    if s.trim_start().starts_with('{') {
        let m: LoraModuleJson =
            serde_json::from_str(s).map_err(|e| format!("invalid JSON adapter {s:?}: {e}"))?;
        if m.name.is_empty() || m.path.as_os_str().is_empty() {
            return Err(format!("an adapter needs a name and a path, got {s:?}"));
        }
        return Ok((m.name, m.path));
    }
    let (name, path) = s.split_once('=').ok_or_else(|| format!("expected name=path or JSON, got {s:?}"))?;
    if name.is_empty() || path.is_empty() {
        return Err(format!("expected name=path, got {s:?}"));
    }
    Ok((name.to_string(), PathBuf::from(path)))
}

/// Resolved LoRA settings (present when --enable-lora).
#[derive(Debug, Clone)]
pub struct LoraConfig {
    pub max_loras: usize,
    pub max_rank: usize,
    pub max_cpu_loras: usize,
    pub modules: Vec<(String, PathBuf)>,
    pub allow_runtime: bool,
    pub root: Option<PathBuf>,
    /// Keep adapter weights in bf16 (from --lora-dtype, or the model's dtype when auto).
    pub bf16: bool,
}

impl Default for EngineArgs {
    fn default() -> Self {
        Self {
            model: PathBuf::from(DEFAULT_MODEL_DIR),
            revision: None,
            download_dir: None,
            trust_remote_code: false,
            seed: None,
            max_logprobs: MAX_LOGPROBS as i64,
            generation_config: "auto".into(),
            chat_template: None,
            enable_auto_tool_choice: false,
            tool_call_parser: None,
            reasoning_parser: None,
            disable_log_stats: false,
            disable_log_requests: false,
            dtype: DTypeArg::Auto,
            max_model_len: None,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            block_size: 16,
            kv_cache_space: 4.0,
            kv_cache_dtype: KvDtype::Auto,
            calculate_kv_scales: false,
            num_gpu_blocks_override: None,
            gpu_memory_utilization: 0.9,
            enforce_eager: false,
            load_format: LoadFormat::Auto,
            quantization: None,
            keep_quantized: false,
            no_enable_prefix_caching: false,
            enable_prefix_caching: false,
            scheduling_policy: SchedulingPolicy::Fcfs,
            async_scheduling: true,
            device: DeviceArg::Cpu,
            tensor_parallel_size: 1,
            lora: LoraArgs::default(),
            cluster: crate::cluster::ClusterArgs::default(),
            cpu_kernels: crate::kernels::cpu::family::CpuKernels::Auto,
            offline: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("--block-size must be a power of two between 1 and 256, got {0}")]
    BlockSize(usize),
    #[error(
        "--kv-cache-dtype fp8_e5m2 is served on the CPU (--device cpu); on a CUDA GPU the FP8 cache \
         is e4m3: use --kv-cache-dtype fp8"
    )]
    Fp8E5m2OnGpu,
    #[error(
        "--calculate-kv-scales sets the scales of an FP8 KV cache: add --kv-cache-dtype fp8 (or \
         fp8_e5m2), or leave it out"
    )]
    CalculateKvScalesWithoutFp8,
    #[error(
        "--calculate-kv-scales is served on the CPU (--device cpu); on a CUDA GPU an FP8 KV cache \
         takes the checkpoint's scales, or 1: leave the flag out"
    )]
    CalculateKvScalesOnGpu,
    #[error("--max-num-seqs must be at least 1, got {0}")]
    MaxNumSeqs(usize),
    #[error("--max-num-batched-tokens ({tokens}) must be at least --max-num-seqs ({seqs})")]
    BatchedTokens { tokens: usize, seqs: usize },
    #[error("--max-model-len ({given}) is larger than the model's max_position_embeddings ({limit})")]
    MaxModelLen { given: usize, limit: usize },
    #[error(
        "The model's max seq len ({max_model_len}) is larger than the maximum number of tokens that can be stored in KV cache ({capacity}); {fix}"
    )]
    KvCacheTooSmall { max_model_len: usize, capacity: usize, fix: &'static str },
    #[error("the KV cache holds no block: --kv-cache-space {0} GiB is too small")]
    NoBlocks(f64),
    #[error("{0} needs --enable-lora")]
    LoraDisabled(&'static str),
    #[error("--max-loras must be at least 1 and --max-lora-rank between 1 and 512")]
    LoraLimits,
    #[error("--chat-template: {0}")]
    ChatTemplate(String),
    #[error("--generation-config: {0}")]
    GenerationConfig(String),
    #[error("--max-logprobs must be -1 (no limit) or at least 0, got {0}")]
    MaxLogprobs(i64),
    #[error("--tensor-parallel-size {tp}: {reason}")]
    TensorParallel { tp: usize, reason: String },
}

/// What makes room for a longer --max-model-len: on the CPU, and on a GPU.
const CPU_KV_FIX: &str = "raise --kv-cache-space (GiB of KV cache on the CPU) or lower --max-model-len";
const GPU_KV_FIX: &str = "raise --gpu-memory-utilization or lower --max-model-len (or --max-num-seqs and \
     --max-num-batched-tokens, whose profiling step takes memory too)";

/// Resolved engine settings: no Options, validated against the model.
/// vLLM's `--scheduling-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulingPolicy {
    Fcfs,
    Priority,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_dir: PathBuf,
    pub dtype: DType,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub kv_cache_dtype: KvDtype,
    /// Each layer's FP8 cache scales from the first keys and values it stores.
    pub calculate_kv_scales: bool,
    pub lora: Option<LoraConfig>,
    pub tensor_parallel_size: usize,
    /// Most logprobs per token a request may ask for (--max-logprobs, at most
    /// [`MAX_LOGPROBS`]).
    pub max_logprobs: usize,
    /// Log a line as each request starts and finishes (not --disable-log-requests).
    pub log_requests: bool,
    /// Defaults for the sampling fields a request leaves unset (--generation-config).
    pub sampling_defaults: crate::request::SamplingDefaults,
    /// The parser of `tool_choice: "auto"` (--enable-auto-tool-choice with
    /// --tool-call-parser); None refuses it.
    pub auto_tool_parser: Option<crate::structured::tools::ToolParser>,
    pub reasoning_parser: Option<crate::structured::reasoning::ReasoningParser>,
    pub scheduling_policy: SchedulingPolicy,
}

/// KV heads each rank holds: a share of them, or one replicated head when there are fewer
/// KV heads than ranks.
pub fn kv_heads_per_rank(model: &ModelConfig, tp: usize) -> usize {
    let tp = crate::kernels::TpRank { rank: 0, world: tp };
    crate::models::layers::qkv_heads(model.num_heads, model.num_kv_heads, tp).1.len()
}

/// Checks that the model's shapes split over `tp` ranks (vLLM's rules).
fn check_tensor_parallel(model: &ModelConfig, tp: usize) -> Result<(), ConfigError> {
    let fail = |reason: String| Err(ConfigError::TensorParallel { tp, reason });
    let (heads, kv) = (model.num_heads, model.num_kv_heads);
    if tp == 0 {
        return fail("must be at least 1".into());
    }
    if !heads.is_multiple_of(tp) {
        return fail(format!("the model's {heads} attention heads are not divisible by {tp} ranks"));
    }
    if !kv.is_multiple_of(tp) && !tp.is_multiple_of(kv) {
        return fail(format!("the model's {kv} KV heads neither divide nor are divisible by {tp} ranks"));
    }
    // The evenly split sections of the layers (the MLP's features), as the model declares
    // them with its adapter targets.
    let even = model.lora_targets.iter().flat_map(|t| match &t.split {
        LoraSplit::Out(sections) => sections.iter().filter(|s| s.1 == Shard::Even).map(|s| s.0).collect(),
        LoraSplit::In(Shard::Even) => vec![t.in_features],
        LoraSplit::In(_) => vec![],
    });
    if let Some(n) = even.into_iter().find(|n| !n.is_multiple_of(tp)) {
        return fail(format!("the MLP's {n} features are not divisible by {tp} ranks"));
    }
    Ok(())
}

impl EngineConfig {
    /// Sizes the KV cache to `bytes` (a GPU's budget after the weights and the activations
    /// of a profiling step at the largest batch) of `elem_bytes` elements, with the same
    /// check that --max-model-len fits.
    pub fn resize_kv(
        &mut self,
        model: &ModelConfig,
        bytes: usize,
        elem_bytes: usize,
    ) -> Result<(), ConfigError> {
        let kv_heads = kv_heads_per_rank(model, self.tensor_parallel_size);
        let bytes_per_block = 2 * model.num_layers * self.block_size * kv_heads * model.head_dim * elem_bytes;
        self.num_blocks = bytes / bytes_per_block;
        let capacity = self.num_blocks * self.block_size;
        if self.max_model_len > capacity {
            return Err(ConfigError::KvCacheTooSmall {
                max_model_len: self.max_model_len,
                capacity,
                fix: GPU_KV_FIX,
            });
        }
        Ok(())
    }

    /// Resolves `args` for `model`. With `sized_by_device` (a GPU without
    /// --num-gpu-blocks-override) the KV cache is sized later from the device's memory
    /// ([`Self::resize_kv`]), where --max-model-len is checked against it; else it is
    /// sized here from --kv-cache-space (or the override) and checked now.
    pub fn resolve(
        args: &EngineArgs,
        model: &ModelConfig,
        sized_by_device: bool,
    ) -> Result<Self, ConfigError> {
        let bs = args.block_size;
        if !bs.is_power_of_two() || bs > 256 {
            return Err(ConfigError::BlockSize(bs));
        }
        // Limits still unset take the CPU's defaults (Engine::start sets a GPU's first).
        let max_num_seqs = args.max_num_seqs.unwrap_or(256);
        let max_num_batched_tokens = args.max_num_batched_tokens.unwrap_or(2048);
        if max_num_seqs == 0 {
            return Err(ConfigError::MaxNumSeqs(0));
        }
        if max_num_batched_tokens < max_num_seqs {
            return Err(ConfigError::BatchedTokens { tokens: max_num_batched_tokens, seqs: max_num_seqs });
        }
        let limit = model.max_position_embeddings;
        let max_model_len = args.max_model_len.unwrap_or(limit);
        if max_model_len > limit {
            return Err(ConfigError::MaxModelLen { given: max_model_len, limit });
        }
        if args.calculate_kv_scales && args.kv_cache_dtype.fp8().is_none() {
            return Err(ConfigError::CalculateKvScalesWithoutFp8);
        }
        let tp = args.tensor_parallel_size;
        check_tensor_parallel(model, tp)?;
        // The CPU's cache (f32, or FP8's byte): K and V per layer per token, of one rank's
        // KV heads.
        let kv_heads = kv_heads_per_rank(model, tp);
        let elem_bytes = args.kv_cache_dtype.elem_bytes(4);
        let bytes_per_block = 2 * model.num_layers * bs * kv_heads * model.head_dim * elem_bytes;
        let num_blocks = match args.num_gpu_blocks_override {
            Some(n) => n,
            None => (args.kv_cache_space * (1u64 << 30) as f64) as usize / bytes_per_block,
        };
        if num_blocks == 0 && !sized_by_device {
            return Err(ConfigError::NoBlocks(args.kv_cache_space));
        }
        let capacity = num_blocks * bs;
        if max_model_len > capacity && !sized_by_device {
            let fix = match args.num_gpu_blocks_override {
                Some(_) => "raise --num-gpu-blocks-override or lower --max-model-len",
                None => CPU_KV_FIX,
            };
            return Err(ConfigError::KvCacheTooSmall { max_model_len, capacity, fix });
        }
        let dtype = match args.dtype {
            DTypeArg::Float32 => DType::F32,
            DTypeArg::Bfloat16 => DType::BF16,
            DTypeArg::Float16 => DType::F16,
            DTypeArg::Auto => match model.checkpoint_dtype.as_deref() {
                Some("bfloat16") => DType::BF16,
                Some("float16") => DType::F16,
                _ => DType::F32,
            },
        };
        let l = &args.lora;
        let lora = if l.enable_lora {
            if l.max_loras == 0 || l.max_lora_rank == 0 || l.max_lora_rank > 512 {
                return Err(ConfigError::LoraLimits);
            }
            Some(LoraConfig {
                max_loras: l.max_loras,
                max_rank: l.max_lora_rank,
                max_cpu_loras: l.max_cpu_loras.unwrap_or(l.max_loras).max(l.max_loras),
                modules: l.lora_modules.clone(),
                allow_runtime: l.allow_runtime_lora,
                root: l.lora_root.clone(),
                bf16: false,
            })
        } else if !l.lora_modules.is_empty() {
            return Err(ConfigError::LoraDisabled("--lora-modules"));
        } else if l.allow_runtime_lora {
            return Err(ConfigError::LoraDisabled("--allow-runtime-lora"));
        } else {
            None
        };
        let lora = lora.map(|mut l| {
            l.bf16 = match args.lora.lora_dtype {
                DTypeArg::Bfloat16 | DTypeArg::Float16 => true,
                DTypeArg::Float32 => false,
                DTypeArg::Auto => dtype != DType::F32,
            };
            l
        });
        let max_logprobs = match args.max_logprobs {
            -1 => MAX_LOGPROBS,
            n if n < 0 => return Err(ConfigError::MaxLogprobs(n)),
            n => (n as usize).min(MAX_LOGPROBS),
        };
        Ok(Self {
            lora,
            max_logprobs,
            log_requests: !args.disable_log_requests,
            sampling_defaults: Default::default(),
            auto_tool_parser: args.tool_call_parser.filter(|_| args.enable_auto_tool_choice),
            reasoning_parser: args.reasoning_parser,
            scheduling_policy: args.scheduling_policy,
            model_dir: args.model.clone(),
            dtype,
            max_model_len,
            max_num_seqs,
            max_num_batched_tokens,
            block_size: bs,
            num_blocks,
            kv_cache_dtype: args.kv_cache_dtype,
            calculate_kv_scales: args.calculate_kv_scales,
            tensor_parallel_size: tp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prefix caching is on unless `--no-enable-prefix-caching` comes last.
    #[test]
    fn prefix_caching_is_on_unless_turned_off() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let on = |args: &[&str]| {
            let argv = std::iter::once("actorllm").chain(args.iter().copied());
            !<Cli as clap::Parser>::try_parse_from(argv).unwrap().engine.no_enable_prefix_caching
        };
        assert!(on(&[]));
        assert!(on(&["--enable-prefix-caching"]));
        assert!(!on(&["--no-enable-prefix-caching"]));
        assert!(on(&["--no-enable-prefix-caching", "--enable-prefix-caching"]));
    }

    /// Async scheduling is on unless `--async-scheduling=false` says otherwise; vLLM's bare
    /// flag still parses, and a bare flag does not swallow the argument after it.
    #[test]
    fn async_scheduling_is_on_by_default_and_turned_off_with_false() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let parse = |args: &[&str]| {
            let argv = std::iter::once("actorllm").chain(args.iter().copied());
            <Cli as clap::Parser>::try_parse_from(argv).map(|c| c.engine.async_scheduling)
        };
        assert!(parse(&[]).unwrap());
        assert!(parse(&["--async-scheduling"]).unwrap());
        assert!(parse(&["--async-scheduling", "--enforce-eager"]).unwrap());
        assert!(!parse(&["--async-scheduling=false"]).unwrap());
        assert!(parse(&["--async-scheduling", "false"]).is_err(), "a bare flag takes no value");
    }

    /// `--lora-modules` takes `name=path` and vLLM's JSON form alike; `--max-lora-rank`
    /// takes vLLM's values only.
    #[test]
    fn adapters_parse_as_name_path_or_json_and_ranks_as_vllm_lists_them() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let parse = |args: &[&str]| {
            let argv = std::iter::once("actorllm").chain(args.iter().copied());
            <Cli as clap::Parser>::try_parse_from(argv).map(|c| c.engine.lora)
        };
        let json = r#"{"name": "sql", "path": "/a/sql", "base_model_name": "meta-llama/Llama-2-7b-hf"}"#;
        let l = parse(&["--lora-modules", "chat=/a/chat", json, "--max-lora-rank", "320"]).unwrap();
        assert_eq!(
            l.lora_modules,
            [("chat".to_string(), PathBuf::from("/a/chat")), ("sql".to_string(), PathBuf::from("/a/sql"))]
        );
        assert_eq!(l.max_lora_rank, 320);
        assert!(parse(&["--lora-modules", r#"{"name": "x"}"#]).is_err(), "a JSON adapter needs a path");
        assert!(parse(&["--lora-modules", r#"{"name": "x", "path": "/p", "rank": 8}"#]).is_err());
        for r in MAX_LORA_RANKS {
            assert_eq!(parse(&["--max-lora-rank", &r.to_string()]).unwrap().max_lora_rank, r);
        }
        for r in ["0", "24", "1024", "-8"] {
            assert!(parse(&["--max-lora-rank", r]).is_err(), "{r}");
        }
    }

    #[test]
    fn unset_batch_limits_take_vllms_defaults_for_the_gpu_and_set_ones_stay() {
        let limits = |large: bool, offline: bool, seqs: Option<usize>| {
            let mut a = EngineArgs { offline, max_num_seqs: seqs, ..EngineArgs::default() };
            a.gpu_batch_defaults(large);
            (a.max_num_seqs, a.max_num_batched_tokens)
        };
        assert_eq!(limits(true, true, None), (Some(1024), Some(16384)));
        assert_eq!(limits(true, false, None), (Some(1024), Some(8192)));
        assert_eq!(limits(false, true, None), (Some(256), Some(8192)));
        assert_eq!(limits(false, false, None), (Some(256), Some(2048)));
        assert_eq!(limits(true, false, Some(64)), (Some(64), Some(8192)));
        // Without a GPU's defaults, the CPU's: 256 sequences, 2048 tokens.
        let dir = crate::scratch::ScratchDir::new("config").unwrap();
        crate::models::random::make_random_model(
            crate::models::random::Preset::Tiny.shape(),
            dir.path(),
            DType::F32,
            1,
            1.0,
        )
        .unwrap();
        let model = crate::models::registry::ModelRegistry::<crate::kernels::cpu::CpuDevice>::default()
            .read_config(dir.path())
            .unwrap();
        let c = EngineConfig::resolve(&EngineArgs::default(), &model, false).unwrap();
        assert_eq!((c.max_num_seqs, c.max_num_batched_tokens), (256, 2048));
    }

    /// `--kv-cache-dtype` takes vLLM's names (others are refused with the choices), and an
    /// FP8 cache fits four times the f32 cache's blocks in the CPU's --kv-cache-space.
    #[test]
    fn an_fp8_kv_cache_holds_four_times_the_blocks_of_an_f32_one() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let parse = |v: &str| {
            <Cli as clap::Parser>::try_parse_from(["actorllm", "--kv-cache-dtype", v])
                .map(|c| c.engine.kv_cache_dtype)
        };
        assert_eq!(parse("auto").unwrap(), KvDtype::Auto);
        assert_eq!(parse("fp8").unwrap(), KvDtype::Fp8E4m3);
        assert_eq!(parse("fp8_e4m3").unwrap(), KvDtype::Fp8E4m3);
        assert_eq!(parse("fp8_e5m2").unwrap(), KvDtype::Fp8E5m2);
        let refused = parse("int8").unwrap_err().to_string();
        assert!(refused.contains("int8") && refused.contains("auto, fp8, fp8_e5m2"), "{refused}");
        let dir = crate::scratch::ScratchDir::new("config-kv").unwrap();
        let shape = crate::models::random::Preset::Tiny.shape();
        crate::models::random::make_random_model(shape, dir.path(), DType::F32, 1, 1.0).unwrap();
        let model = crate::models::registry::ModelRegistry::<crate::kernels::cpu::CpuDevice>::default()
            .read_config(dir.path())
            .unwrap();
        let blocks = |kv_cache_dtype| {
            let args = EngineArgs { kv_cache_space: 0.01, kv_cache_dtype, ..EngineArgs::default() };
            EngineConfig::resolve(&args, &model, false).unwrap().num_blocks
        };
        let (f32_blocks, fp8_blocks) = (blocks(KvDtype::Auto), blocks(KvDtype::Fp8E4m3));
        assert!(f32_blocks > 0 && fp8_blocks / f32_blocks == 4, "{f32_blocks} vs {fp8_blocks}");
        assert_eq!(blocks(KvDtype::Fp8E5m2), fp8_blocks);
    }
}
