//! Paged attention launches: K/V written into the cache (by write_kv, or as q, k and v are
//! split and rotated: rope.rs), then prefill tiles on tensor cores
//! (flash_prefill) and the other rows on tensor cores too where the shape allows
//! (flash_decode, flash.cu), else through the split (PagedAttention v2) or the
//! one-block-per-head kernel (attention.cu); partitions joined by one reduction.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::nvrtc::split_names;
use super::{CudaCache, CudaDevice, CudaTensor, Half, StepBufs, cuda};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{AttnShape, DevResult};

/// The attention kernels of one KV cache element type, looked up when a cache is made so
/// that a step's launches find them without building names.
pub(super) struct KvKernels {
    pub(super) write_kv: CudaFunction,
    /// split_qkv_rope writing K and V into the cache.
    pub(super) split_rope_kv: CudaFunction,
    pub(super) attention: CudaFunction,
    /// flash_prefill for head_dim 64 and 128.
    pub(super) flash: [CudaFunction; 2],
    /// flash_decode for head_dim 64 and 128.
    pub(super) decode: [CudaFunction; 2],
    /// flash_decode for head_dim 256 (16-bit caches).
    pub(super) decode256: Option<CudaFunction>,
    /// flash_decode_join for head_dim 64 and 128 (16-bit caches).
    pub(super) decode_join: Option<[CudaFunction; 2]>,
    /// paged_attention_split for G in 1, 2, 4, 8 by D in 2, 4, 8 (see [`split_index`]).
    pub(super) split: Vec<CudaFunction>,
}

impl CudaDevice {
    /// Whether attention runs on tensor cores: for 16-bit models (or as set by
    /// [`Self::set_tensor_core_attention`]) on sm_80 or later.
    fn tensor_cores(&self) -> bool {
        let on = self.tensor_core_attention.get().unwrap_or(self.act16.get() != 0);
        on && self.sm80 && !self.plain_attention.get()
    }

    /// Whether prefill attention goes to flash_prefill for this shape: on tensor cores,
    /// with head_dim 64 or 128.
    pub(super) fn flash_for(&self, s: AttnShape) -> bool {
        self.tensor_cores() && matches!(s.head_dim, 64 | 128)
    }

    /// Whether a step's `rows` rows outside flash_prefill's tiles go to flash_decode: on
    /// tensor cores, head_dim 64 or 128 (or 256 over a 16-bit cache, where the prefill
    /// rows come here too), a GQA group of up to 8 query heads, and rows within its grid's
    /// y bound (65,535).
    pub(super) fn decode_on_flash(&self, s: AttnShape, rows: usize) -> bool {
        let half_cache = self.act16.get() != 0 && !self.kv_fp8.get();
        let head_dim = matches!(s.head_dim, 64 | 128) || (s.head_dim == 256 && half_cache);
        self.tensor_cores() && head_dim && s.num_heads / s.num_kv_heads <= 8 && rows <= 65_535
    }

    /// How many flash_prefill tiles the current step's attention launched (tests check that
    /// a prefill took the tensor-core path).
    pub fn tensor_core_tiles(&self) -> usize {
        self.inputs().step.borrow().as_ref().map_or(0, |b| b.num_tiles)
    }

    /// The bytes of an FP8 cache's K and V, as the kernels wrote them.
    pub fn cache_bytes(&self, cache: &CudaCache) -> DevResult<(Vec<u8>, Vec<u8>)> {
        let (super::KvBuf::Fp8(k), super::KvBuf::Fp8(v)) = (&cache.k, &cache.v) else {
            return Err(crate::kernels::DeviceError::Other("not an FP8 cache".into()));
        };
        let host = |b| self.stream.clone_dtoh(b).map_err(cuda("device to host copy"));
        Ok((host(k)?, host(v)?))
    }

    /// Whether the last attention's decode rows were split into partitions that
    /// flash_decode's blocks joined themselves (no reduction kernel).
    pub fn decode_joined(&self) -> bool {
        self.decode_joined.get()
    }

    /// Whether the last attention's decode rows ran on tensor cores (flash_decode).
    pub fn tensor_core_decode(&self) -> bool {
        self.decode_on_tensor_cores.get()
    }

    /// Forces prefill attention on (or off) tensor cores, whatever the weights' type.
    pub fn set_tensor_core_attention(&self, on: bool) {
        self.tensor_core_attention.set(Some(on));
    }

    /// The KV cache's element type for caches allocated now (FP8 where asked, else the
    /// 16-bit type of the weights, else f32) as its kernels' suffix, with those kernels.
    /// An FP8 cache is read as an f32 one is (its rows widened as they are loaded), by the
    /// same kernels.
    pub(super) fn kv_kernels(&self) -> (&'static str, KvKernels) {
        let sfx = match self.act16.get() {
            _ if self.kv_fp8.get() => "fp8",
            1 => "bf16",
            2 => "f16",
            _ => "f32",
        };
        let half = matches!(sfx, "bf16" | "f16");
        let f = |name: String| self.f(&name).clone();
        let kernels = KvKernels {
            write_kv: f(format!("write_kv_{sfx}")),
            split_rope_kv: f(format!("split_qkv_rope_kv_{sfx}")),
            attention: f(format!("paged_attention_{sfx}")),
            flash: [f(format!("flash_prefill_h64_{sfx}")), f(format!("flash_prefill_h128_{sfx}"))],
            decode: [f(format!("flash_decode_h64_{sfx}")), f(format!("flash_decode_h128_{sfx}"))],
            decode256: half.then(|| f(format!("flash_decode_h256_{sfx}"))),
            decode_join: half.then(|| {
                [f(format!("flash_decode_join_h64_{sfx}")), f(format!("flash_decode_join_h128_{sfx}"))]
            }),
            split: split_names(sfx).map(f).collect(),
        };
        (sfx, kernels)
    }

    /// The step's attention metadata on the device, uploaded unless it is there already
    /// (every layer passes the same).
    pub(super) fn attention_inputs(&self, s: AttnShape, meta: &AttnMetadata) -> DevResult<()> {
        // The flash kernels honour sliding windows and soft caps; the split kernel does not.
        if s.has_options() && !self.decode_on_flash(s, 1) {
            self.plain_attention.set(true);
        }
        self.attn_shape.set(Some(s));
        self.step_bufs(meta, self.flash_for(s))
    }

    /// `Device::paged_attention`: k and v written into the cache, then [`Self::attend_cached`].
    pub(super) fn attend(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        cache: &mut CudaCache,
        s: AttnShape,
        meta: &AttnMetadata,
    ) -> DevResult<CudaTensor> {
        let width = (s.num_kv_heads * s.head_dim) as i32;
        self.attention_inputs(s, meta)?;
        {
            let guard = self.inputs().step.borrow();
            let b = guard.as_ref().expect("uploaded above");
            let _t = self.span("write_kv", (0, 0), k.rows);
            let (kc, vc) = (cache.k.arg(), cache.v.arg());
            let mut launch = self.stream.launch_builder(&cache.kernels.write_kv);
            launch.arg(&*k.buf).arg(&*v.buf);
            kc.push(&mut launch);
            vc.push(&mut launch);
            // SAFETY: k, v are [n, width]; slots index inside the cache (checked by the
            // scheduler).
            let (ks, vs) = (cache.scales.k, cache.scales.v);
            unsafe { launch.arg(&b.slots).arg(&width).arg(&ks).arg(&vs).launch(Self::rows(k.rows)) }
                .map_err(cuda("write_kv launch"))?;
        }
        self.attend_cached(q, cache, s)
    }

    /// Attention of each query row of `q` over its context, whose K and V (this step's
    /// included) are in the cache, with the step's metadata uploaded
    /// ([`Self::attention_inputs`]). A cache that holds V divided by a scale other than 1
    /// gives an output scaled back once (the weighted sum is linear in V), its 16-bit copy
    /// left to be made again by the projection that reads it.
    pub(super) fn attend_cached(
        &self,
        q: &CudaTensor,
        cache: &mut CudaCache,
        s: AttnShape,
    ) -> DevResult<CudaTensor> {
        let v_scale = cache.scales.v;
        let mut out = self.attend_unscaled(q, cache, s)?;
        if v_scale != 1.0 {
            out.half = None;
            crate::kernels::Device::scale(self, &mut out, v_scale)?;
        }
        Ok(out)
    }

    /// [`Self::attend_cached`] before V's scale: K's is folded into the softmax scale.
    fn attend_unscaled(&self, q: &CudaTensor, cache: &mut CudaCache, s: AttnShape) -> DevResult<CudaTensor> {
        let guard = self.inputs().step.borrow();
        let b = guard.as_ref().expect("uploaded by attention_inputs");
        // A graph is replayed at any context up to its bound: its launch shapes follow the
        // bound, and the kernels skip what lies past each row's own context.
        let ctx_max = self.graph.get().ctx_bound().unwrap_or(b.ctx_max);
        let kk = &cache.kernels;
        let (half_cache, piped) = (cache.k.is_half(), cache.k.prefill_piped());
        let (kc, vc) = (cache.k.arg(), cache.v.arg());
        let cols = s.num_heads * s.head_dim;
        let mut out = self.tensor(q.rows, cols)?;
        let (mut half, kind) = self.half(q.rows, cols)?;
        let dims = AttnDims {
            heads: s.num_heads as i32,
            kv_heads: s.num_kv_heads as i32,
            head_dim: s.head_dim as i32,
            block_size: cache.shape.block_size as i32,
            scale: s.scale * cache.scales.k,
        };
        let (window, softcap) = (s.window as i32, s.softcap);
        if b.num_tiles > 0 {
            let _t = self.span("flash_prefill", (0, 0), q.rows - b.num_rows);
            let mut launch = self.stream.launch_builder(&kk.flash[usize::from(s.head_dim == 128)]);
            launch.arg(&*q.buf);
            kc.push(&mut launch);
            vc.push(&mut launch);
            launch.arg(&mut *out.buf);
            push_half(&mut launch, &mut half, q, &kind);
            push_tables(&mut launch, b);
            launch.arg(&b.tiles);
            dims.push(&mut launch);
            launch.arg(&window).arg(&softcap);
            // Over a 16-bit or FP8 cache a block takes several query heads of a GQA group.
            let hpb = if piped { prefill_heads(s, self.prefill_heads_max) } else { 1 };
            let smem = if piped { prefill_smem_bytes(s.head_dim, hpb, !half_cache) } else { 0 };
            let cfg = LaunchConfig {
                grid_dim: (b.num_tiles as u32, (s.num_heads / hpb) as u32, 1),
                block_dim: (128 * hpb as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // SAFETY: tiles hold rows of one sequence each; every index is bounded by the
            // step's metadata; out (and half) are [rows, heads·head_dim].
            unsafe { launch.launch(cfg) }.map_err(cuda("flash_prefill launch"))?;
        }
        if b.num_rows == 0 {
            out.half = half;
            return Ok(out);
        }
        let tc = self.decode_on_flash(s, b.num_rows);
        self.decode_on_tensor_cores.set(tc);
        self.decode_joined.set(false);
        // flash_decode gives each row partitions of its own length (`row_meta`; part 0 tells
        // the reduction so), at most `parts_max`; the split kernel cuts the bound into
        // partitions of `part`.
        let parts = match tc {
            true => Some((0, b.parts_max)),
            false if self.plain_attention.get() || s.has_options() => None,
            false => split_partition(b.num_rows, s, ctx_max).map(|part| (part, ctx_max.div_ceil(part))),
        };
        if let Some((part, parts_max)) = parts {
            let slots = b.num_rows * s.num_heads * parts_max;
            let mut part_out = self.tensor(slots, s.head_dim)?;
            let (mut part_max, mut part_sum) = (self.tensor(slots, 1)?, self.tensor(slots, 1)?);
            let (part_i, parts_i) = (part as i32, parts_max as i32);
            // Up to DECODE_JOIN_WARPS partitions a row over a 16-bit cache: one block takes
            // them all and joins them itself (flash.cu's decode_join), no reduction.
            let hd = usize::from(s.head_dim == 128);
            // (decode_joins is false for head_dim 256, which has no join kernel.)
            let join = kk.decode_join.as_ref().filter(|_| {
                tc && half_cache && parts_max <= self.decode_join_warps && self.decode_joins(b.num_rows, s)
            });
            self.decode_joined.set(join.is_some());
            let join_i = i32::from(join.is_some());
            let (name, kernel, cfg) = if tc {
                let warps = if join.is_some() { parts_max } else { parts_max.min(4) };
                // A 16-bit cache is staged through two chunk buffers of shared memory a warp.
                let smem = if half_cache { warps * decode_smem_per_warp(s.head_dim) } else { 0 };
                let cfg = LaunchConfig {
                    // KV heads fastest (flash.cu's DecodeWarp); rows within the grid's y
                    // bound (`decode_on_flash`).
                    grid_dim: (s.num_kv_heads as u32, b.num_rows as u32, (parts_max / warps) as u32),
                    block_dim: (32 * warps as u32, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                let kernel = match (join, &kk.decode256) {
                    (Some(j), _) => &j[hd],
                    (None, Some(k)) if s.head_dim == 256 => k,
                    (None, _) => &kk.decode[hd],
                };
                ("attention_decode_tc", kernel, cfg)
            } else {
                let group = s.num_heads / s.num_kv_heads;
                let cfg = LaunchConfig {
                    grid_dim: (b.num_rows as u32, s.num_kv_heads as u32, parts_max as u32),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: ((group * part + SPLIT_CHUNK * s.head_dim) * 4) as u32,
                };
                ("attention_split", &kk.split[split_index(s)], cfg)
            };
            let t = self.span(name, (0, 0), b.num_rows);
            let mut launch = self.stream.launch_builder(kernel);
            launch.arg(&*q.buf);
            kc.push(&mut launch);
            vc.push(&mut launch);
            launch.arg(&mut *part_out.buf).arg(&mut *part_max.buf).arg(&mut *part_sum.buf);
            if tc {
                launch.arg(&mut *out.buf);
                push_half(&mut launch, &mut half, q, &kind);
            }
            launch.arg(&b.rows);
            if tc {
                launch.arg(&b.row_meta).arg(&b.tables);
            } else {
                push_tables(&mut launch, b);
            }
            dims.push(&mut launch);
            if !tc {
                launch.arg(&part_i);
            }
            launch.arg(&parts_i);
            if tc {
                launch.arg(&join_i).arg(&window).arg(&softcap);
            }
            // SAFETY: indices are bounded by the step's metadata; the partial buffers hold
            // rows·heads·parts_max entries (of head_dim values for part_out); out (and half)
            // are [rows, heads·head_dim].
            unsafe { launch.launch(cfg) }.map_err(cuda("decode attention launch"))?;
            drop(t);
            if tc && (parts_max == 1 || join.is_some()) {
                // One warp took each row's whole context and wrote the output itself, or a
                // block joined the row's partitions.
                out.half = half;
                return Ok(out);
            }
            let _t = self.span("attention_reduce", (0, 0), b.num_rows);
            // A block per (row, head) while they are few, else a warp each, four to a block.
            let heads_rows = b.num_rows * s.num_heads;
            let by_warp = heads_rows >= REDUCE_BY_WARP;
            let cfg = LaunchConfig {
                grid_dim: (if by_warp { heads_rows.div_ceil(4) } else { heads_rows } as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let name = if by_warp { "paged_attention_reduce_warp_f32" } else { "paged_attention_reduce_f32" };
            let mut launch = self.stream.launch_builder(self.f(name));
            launch.arg(&*part_out.buf).arg(&*part_max.buf).arg(&*part_sum.buf).arg(&mut *out.buf);
            push_half(&mut launch, &mut half, q, &kind);
            launch
                .arg(&b.rows)
                .arg(&b.row_meta)
                .arg(&dims.heads)
                .arg(&dims.head_dim)
                .arg(&part_i)
                .arg(&parts_i);
            let n = heads_rows as i32;
            if by_warp {
                launch.arg(&n);
            }
            launch.arg(&window);
            // SAFETY: as above; out (and half) are [rows, heads·head_dim]; the warp kernel
            // covers n = rows · heads slots, each of a head_dim that is a multiple of 32 up
            // to 256 (the only shapes that leave partitions).
            unsafe { launch.launch(cfg) }.map_err(cuda("paged_attention_reduce launch"))?;
            out.half = half;
            return Ok(out);
        }
        let _t = self.span("attention", (0, 0), b.num_rows);
        if s.head_dim > 512 {
            return Err(crate::kernels::DeviceError::Other(format!("head_dim {} is above 512", s.head_dim)));
        }
        let cfg = LaunchConfig {
            grid_dim: ((b.num_rows * s.num_heads) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&kk.attention);
        launch.arg(&*q.buf);
        kc.push(&mut launch);
        vc.push(&mut launch);
        launch.arg(&mut *out.buf);
        push_half(&mut launch, &mut half, q, &kind);
        launch.arg(&b.rows);
        push_tables(&mut launch, b);
        dims.push(&mut launch);
        launch.arg(&window).arg(&softcap);
        // SAFETY: every index is bounded by the metadata built from the scheduler's tables;
        // head_dim is at most 512 (4 dims a thread).
        unsafe { launch.launch(cfg) }.map_err(cuda("paged_attention launch"))?;
        out.half = half;
        Ok(out)
    }
}

/// The shape arguments the attention kernels end with.
struct AttnDims {
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    block_size: i32,
    scale: f32,
}

impl AttnDims {
    fn push<'a>(&'a self, launch: &mut cudarc::driver::LaunchArgs<'a>) {
        launch
            .arg(&self.heads)
            .arg(&self.kv_heads)
            .arg(&self.head_dim)
            .arg(&self.block_size)
            .arg(&self.scale);
    }
}

/// The step's per-token positions and sequences and the block tables, in the order the
/// attention kernels take them.
fn push_tables<'a>(launch: &mut cudarc::driver::LaunchArgs<'a>, b: &'a StepBufs) {
    launch.arg(&b.positions).arg(&b.token_seq).arg(&b.tables).arg(&b.table_offsets);
}

/// The 16-bit output and its kind (with kind 0 any buffer fills the slot; it is not written).
fn push_half<'a>(
    launch: &mut cudarc::driver::LaunchArgs<'a>,
    half: &'a mut Option<Half>,
    any: &'a CudaTensor,
    kind: &'a i32,
) {
    match half {
        Some(h) => launch.arg(&mut *h.buf),
        None => launch.arg(&*any.buf),
    };
    launch.arg(kind);
}

/// The split kernel's instantiation for a shape, as an index into `KvKernels::split`: the
/// smallest group bound G (1, 2, 4, 8) and dims-per-lane bound D (2, 4, 8) that hold it
/// (split_partition has checked group ≤ 8 and head_dim ≤ 256).
pub(super) fn split_index(s: AttnShape) -> usize {
    let g = (s.num_heads / s.num_kv_heads).next_power_of_two();
    let d = (s.head_dim / 32).next_power_of_two().max(2);
    g.trailing_zeros() as usize * 3 + d.trailing_zeros() as usize - 1
}

/// Up to this many flash_decode partitions of a row over a 16-bit cache (fewer where the
/// GPU's shared memory holds fewer warps' chunk buffers: `CudaDevice::decode_join_warps`)
/// are joined by their block (flash.cu's decode_join, `CudaDevice::decode_joins`) instead
/// of the reduction kernel.
pub(super) const DECODE_JOIN_WARPS: usize = 8;

/// Contexts (or a graph's context bound) up to which the decode rows of a step that
/// `CudaDevice::decode_joins` take no more partitions each than a block joins.
pub(super) const DECODE_JOIN_CTX: usize = 512;

impl CudaDevice {
    /// Whether flash_decode's blocks join the partitions of `rows` decode rows themselves:
    /// while the rows' (row, KV head) pairs leave SMs free, the reduction kernel is mostly
    /// a boundary between two kernels on the decode step's path. On the H200 (8B shape,
    /// contexts up to 256) batch 1 went 4.15 → 4.10 ms and batch 8 4.32 → 4.25; at batch
    /// 256 joining in the block took 9.09 → 9.21 ms, so many rows keep the reduction.
    /// Head sizes over 128 are not joined: eight warps' chunk buffers would not fit.
    pub(super) fn decode_joins(&self, rows: usize, s: AttnShape) -> bool {
        rows * s.num_kv_heads <= self.sms && s.head_dim <= 128
    }
}

/// Shared memory flash_decode takes a warp over a 16-bit cache: two chunks of 16 keys' K and
/// V rows of `head_dim` 16-bit values.
pub(super) fn decode_smem_per_warp(head_dim: usize) -> usize {
    2 * 2 * 16 * head_dim * 2
}

/// Query heads of one GQA group that a flash_prefill block over a 16-bit or FP8 cache takes (four
/// warps each), so that each chunk of K and V is staged once for all of them: the largest
/// of 4, 2 and 1 that divides the group, up to `max` ([`prefill_heads_within`]).
pub(super) fn prefill_heads(s: AttnShape, max: usize) -> usize {
    let group = s.num_heads / s.num_kv_heads;
    [4, 2, 1].into_iter().find(|&h| h <= max && group.is_multiple_of(h)).unwrap_or(1)
}

/// The most query heads a flash_prefill block may take on a GPU whose blocks can have
/// `smem_optin` bytes of shared memory: 4 (flash.cu's kernels allow 4 × 128 threads) where
/// their buffers (an FP8 cache's, the larger) fit at head_dim 128, as on sm_80 and sm_90; 2
/// on sm_86 and sm_89 (99 KiB).
pub(super) fn prefill_heads_within(smem_optin: usize) -> usize {
    [4, 2, 1].into_iter().find(|&h| prefill_smem_bytes(128, h, true) <= smem_optin).unwrap_or(1)
}

/// Keys per chunk of flash_prefill (flash.cu's BC).
const PREFILL_CHUNK: usize = 32;

/// Shared memory of a flash_prefill_pipe block taking `heads` query heads:
/// two chunks of K and V rows and each warp's 16 query rows, rows padded by 8 values; over
/// an FP8 cache (`fp8`), two chunks of K and V bytes besides, copied before they are widened.
pub(super) fn prefill_smem_bytes(head_dim: usize, heads: usize, fp8: bool) -> usize {
    let raw = if fp8 { 4 * PREFILL_CHUNK * head_dim } else { 0 };
    (4 * PREFILL_CHUNK + 16 * 4 * heads) * (head_dim + 8) * 2 + raw
}

/// flash_decode over a 16-bit cache and flash_prefill over a 16-bit or FP8 one take more than
/// the 48 KiB of shared memory a block gets without asking (up to four warps of chunk
/// buffers, or flash_decode_join's warps; the queries of several heads). Asks for it, once per kernel,
/// with flash_prefill's heads a block ([`prefill_heads_within`]) and flash_decode_join's
/// warps (up to [`DECODE_JOIN_WARPS`]) bounded by what the GPU allows; returns both bounds.
pub(super) fn allow_flash_smem(
    ctx: &cudarc::driver::CudaContext,
    funcs: &std::collections::HashMap<String, (CudaFunction, bool)>,
) -> DevResult<(usize, usize)> {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as OPTIN;
    let optin = ctx.attribute(OPTIN).map_err(cuda("shared memory per block"))?.max(0) as usize;
    let prefill_heads = prefill_heads_within(optin);
    let join_warps = DECODE_JOIN_WARPS.min(optin / decode_smem_per_warp(128));
    for (name, (f, _)) in funcs {
        if !name.starts_with("flash_") || name.ends_with("_f32") {
            continue;
        }
        let hd = if name.contains("_h64_") {
            64
        } else if name.contains("_h256_") {
            256
        } else {
            128
        };
        let bytes = match name.starts_with("flash_decode_") {
            true if name.starts_with("flash_decode_join_") => join_warps * decode_smem_per_warp(hd),
            true => 4 * decode_smem_per_warp(hd),
            false => prefill_smem_bytes(hd, prefill_heads, name.ends_with("_fp8")),
        };
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(cuda("flash kernel shared memory"))?;
    }
    Ok((prefill_heads, join_warps))
}

/// From how many (row, head) pairs the partitions are joined by a warp each rather than a
/// block each: many rows fill the GPU with warps, few need blocks to spread.
const REDUCE_BY_WARP: usize = 4096;

/// K/V rows the split kernel stages in shared memory at a time (CHUNK in attention.cu).
const SPLIT_CHUNK: usize = 32;

/// Positions per partition for the split attention kernel, or None where it does not apply
/// (GQA groups over 8 heads, head sizes not a multiple of 32 or over 256, or a batch whose
/// partial results would not fit the budget). Partitions start at 32 positions, so that
/// one short decode still spreads over the GPU, and grow while the grid stays large and
/// while the partial results would take more than 256 MiB.
fn split_partition(rows: usize, s: AttnShape, ctx_max: usize) -> Option<usize> {
    let group = s.num_heads / s.num_kv_heads;
    if group > 8 || !s.head_dim.is_multiple_of(32) || s.head_dim > 256 {
        return None;
    }
    let bytes = |part: usize| rows * s.num_heads * ctx_max.div_ceil(part) * (s.head_dim + 2) * 4;
    let blocks = |part: usize| rows * s.num_kv_heads * ctx_max.div_ceil(part);
    let mut part = 32;
    while part < 512 && blocks(part) > 4096 {
        part *= 2;
    }
    while bytes(part) > 256 << 20 {
        part *= 2;
    }
    // Scores of the partition and a chunk of K or V rows live in shared memory (48 KiB
    // without opting in).
    ((group * part + SPLIT_CHUNK * s.head_dim) * 4 <= 48 << 10).then_some(part)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_shape_gets_the_smallest_split_instantiation_that_holds_it() {
        let shape = |heads, kv_heads, head_dim| AttnShape::causal(heads, kv_heads, head_dim);
        let names: Vec<String> = super::split_names("bf16").collect();
        for (s, want) in [
            (shape(32, 8, 128), "g4_d4"),
            (shape(14, 2, 64), "g8_d2"),
            (shape(4, 4, 32), "g1_d2"),
            (shape(16, 8, 256), "g2_d8"),
            (shape(9, 3, 96), "g4_d4"),
        ] {
            assert_eq!(names[split_index(s)], format!("paged_attention_split_{want}_bf16"));
        }
    }

    #[test]
    fn prefill_blocks_take_whole_gqa_groups_within_the_kernels_bounds() {
        let shape = |heads, kv_heads| AttnShape::causal(heads, kv_heads, 128);
        for (heads, kv_heads, max, want) in [
            (32, 8, 4, 4),
            (64, 8, 4, 4),
            (16, 8, 4, 2),
            (14, 2, 4, 1),
            (9, 3, 4, 1),
            (4, 4, 4, 1),
            (32, 8, 2, 2),
        ] {
            let h = prefill_heads(shape(heads, kv_heads), max);
            assert_eq!(h, want, "{heads} heads over {kv_heads} KV heads, at most {max}");
            assert_eq!((heads / kv_heads) % h, 0, "a block's heads share one KV head");
        }
        // sm_90 and sm_80 blocks may ask for 227 and 163 KiB, sm_86 and sm_89 for 99.
        assert_eq!(prefill_heads_within(227 << 10), 4);
        assert_eq!(prefill_heads_within(163 << 10), 4);
        assert_eq!(prefill_heads_within(99 << 10), 2);
        let src = include_str!("flash.cu");
        assert!(src.contains(&format!("#define BC {PREFILL_CHUNK}\n")), "flash.cu's BC differs");
        assert!(src.contains("__launch_bounds__(512, 1) flash_prefill"), "four heads of 128 threads");
    }
}
