//! The [`Device`] operations of the CUDA device: one launch (or cuBLAS call) each, with
//! shapes checked by the model and indices bounded by the scheduler's metadata.

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};

use super::gemm::act_code;
use super::lora::GemmOut;
use super::rope::RopeOut;
use super::{CudaCache, CudaDevice, CudaLora, CudaTensor, CudaWeight, KvBuf, WeightArg, WeightBuf, cuda};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{
    Activation, AttnShape, CacheShape, DType, DevResult, Device, DeviceError, GemmTuning, HostTensor,
    KvDtype, KvScales, LoraRows, LoraShape, LoraSlotWeights, MoeSpec, RopeSpec, SampleTicket, Sampled,
    TpRank,
};
use crate::sampling::SampleInput;

impl Device for CudaDevice {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Cache = CudaCache;
    type Lora = CudaLora;
    type Graph = super::CudaGraphStep;

    const SIZES_KV_CACHE: bool = true;

    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "CUDA".into());
        format!("{name} ({})", self.arch)
    }

    fn tp(&self) -> TpRank {
        self.tp
    }

    fn all_reduce(&self, x: &mut CudaTensor) -> DevResult<()> {
        if let Some(c) = &self.comm {
            let n = x.rows * x.cols;
            let _t = self.span("all_reduce", (0, 0), x.rows);
            c.all_reduce_in_place(&mut x.buf.slice_mut(0..n), &cudarc::nccl::ReduceOp::Sum)
                .map_err(cuda("NCCL all-reduce"))?;
        }
        Ok(())
    }

    fn all_gather_cols(&self, x: &CudaTensor, keep: usize, total: usize) -> DevResult<CudaTensor> {
        let mut out = self.tensor(x.rows, total)?;
        let gathered;
        let parts = match &self.comm {
            Some(c) => {
                // NCCL writes all world·rows·cols values.
                let mut p = self.tensor(self.tp.world * x.rows, x.cols)?;
                let _t = self.span("all_gather", (0, 0), x.rows);
                c.all_gather(&x.view(), &mut *p.buf).map_err(cuda("NCCL all-gather"))?;
                gathered = p;
                &*gathered.buf
            }
            None => &*x.buf,
        };
        let (rows, cols, keep, total_i) = (x.rows as i32, x.cols as i32, keep as i32, total as i32);
        // SAFETY: parts holds world [rows, cols] shards; total ≤ world·keep and keep ≤ cols.
        unsafe {
            self.stream
                .launch_builder(self.f("join_shards_f32"))
                .arg(parts)
                .arg(&mut *out.buf)
                .arg(&rows)
                .arg(&cols)
                .arg(&keep)
                .arg(&total_i)
                .launch(Self::rows(x.rows))
        }
        .map_err(cuda("join shards launch"))?;
        Ok(out)
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx.bind_to_thread().ok()?;
        cudarc::driver::result::mem_get_info().ok()
    }

    fn upload(&self, t: HostTensor<'_>) -> Result<CudaWeight, DeviceError> {
        if let DType::Quant(f) = t.dtype {
            return Err(DeviceError::Other(format!(
                "{f} blocks kept by --keep-quantized are multiplied on the CPU only; leave the flag out on a GPU \
                 (the blocks are then dequantized at import)"
            )));
        }
        let numel: usize = t.shape.iter().product();
        let need = t.dtype.row_bytes(numel);
        if t.data.len() != need {
            return Err(DeviceError::WeightSize { shape: t.shape, dtype: t.dtype, got: t.data.len(), need });
        }
        let buf = match (t.dtype, t.shape.len()) {
            (DType::Rows(format), 2) => {
                self.act16.set(if format.f16 { 2 } else { 1 });
                // Prompts' GEMMs widen it into the scratch first (`widen_int4`).
                let mut widened = self.widened.borrow_mut();
                if widened.as_ref().is_none_or(|b| b.len() < numel) {
                    *widened = Some(self.zeros(numel)?);
                }
                // FP8 rows with one scale a row: those scales as a vector for the W8A8 GEMM.
                let scales = match (format.kind, format.group, &self.fp8) {
                    (crate::kernels::rows::RowKind::Fp8, 0, Some(_)) => {
                        Some(self.htod(&format.scales(&t.data))?)
                    }
                    _ => None,
                };
                WeightBuf::Rows { buf: self.htod(&t.data)?, format, scales }
            }
            // Stacked experts: the fused MoE kernels read 16-bit weights.
            (DType::Rows(_), _) => {
                let mut data = Vec::new();
                t.dtype.widened().convert_from(t.dtype, &t.data, &mut data);
                return self.upload(HostTensor {
                    dtype: t.dtype.widened(),
                    shape: t.shape,
                    data: data.into(),
                });
            }
            (DType::BF16, 2 | 3) => {
                self.act16.set(1);
                WeightBuf::Bf16(self.upload_u16(&t.data)?)
            }
            (DType::F16, 2 | 3) => {
                self.act16.set(2);
                WeightBuf::F16(self.upload_u16(&t.data)?)
            }
            _ => {
                let mut bytes = Vec::new();
                DType::F32.convert_from(t.dtype, &t.data, &mut bytes);
                let host: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
                WeightBuf::F32(self.htod(&host)?)
            }
        };
        Ok(CudaWeight { shape: t.shape, buf })
    }

    fn alloc_cache(&self, shape: CacheShape, dtype: KvDtype) -> Result<CudaCache, DeviceError> {
        let n = shape.num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
        if dtype == KvDtype::Fp8E5m2 {
            return Err(DeviceError::Other("an fp8_e5m2 KV cache is served on the CPU only".into()));
        }
        self.kv_fp8.set(dtype == KvDtype::Fp8E4m3);
        let (sfx, kernels) = self.kv_kernels();
        let buf = || -> Result<KvBuf, DeviceError> {
            Ok(match sfx {
                "f32" => KvBuf::F32(self.zeros(n)?),
                "fp8" => KvBuf::Fp8(self.zeros(n)?),
                _ => KvBuf::Half(self.zeros(n)?),
            })
        };
        Ok(CudaCache { shape, k: buf()?, v: buf()?, kernels, scales: KvScales::default() })
    }

    fn set_kv_scales(&self, cache: &mut CudaCache, scales: KvScales) -> Result<(), DeviceError> {
        match (&cache.k, &cache.v) {
            (KvBuf::Fp8(_), KvBuf::Fp8(_)) => {
                cache.scales = scales;
                Ok(())
            }
            _ => Err(DeviceError::Other("KV cache scales are for an FP8 cache".into())),
        }
    }

    fn calculate_kv_scales(&self, _cache: &mut CudaCache) -> Result<(), DeviceError> {
        Err(DeviceError::Other("--calculate-kv-scales is served on the CPU only".into()))
    }

    fn copy_blocks(&self, cache: &mut CudaCache, pairs: &[(u32, u32)]) -> DevResult<()> {
        use cudarc::driver::DevicePtrMut;
        let s = cache.shape;
        if let Some(&b) = pairs.iter().flat_map(|(a, b)| [a, b]).find(|&&b| b as usize >= s.num_blocks) {
            return Err(DeviceError::Other(format!(
                "copy_blocks: block {b} of a {}-block cache",
                s.num_blocks
            )));
        }
        let elems = s.block_size * s.num_kv_heads * s.head_dim;
        for buf in [&mut cache.k, &mut cache.v] {
            let (ptr, bytes, _guard) = match buf {
                KvBuf::F32(b) => {
                    let (p, g) = b.device_ptr_mut(&self.stream);
                    (p, elems * 4, g)
                }
                KvBuf::Half(b) => {
                    let (p, g) = b.device_ptr_mut(&self.stream);
                    (p, elems * 2, g)
                }
                KvBuf::Fp8(b) => {
                    let (p, g) = b.device_ptr_mut(&self.stream);
                    (p, elems, g)
                }
            };
            for &(src, dst) in pairs {
                let (src, dst) = (ptr + (src as usize * bytes) as u64, ptr + (dst as usize * bytes) as u64);
                // SAFETY: both blocks lie inside the buffer (checked above), are whole blocks
                // of it, and do not overlap unless equal; the copy is ordered on the stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
                }
                .map_err(cuda("copy_blocks"))?;
            }
        }
        Ok(())
    }

    fn kv_cache_elem_bytes(&self, dtype: KvDtype) -> usize {
        dtype.elem_bytes(if self.act16.get() == 0 { 4 } else { 2 })
    }

    fn allocations(&self) -> u64 {
        self.allocs.get()
    }

    fn tune_gemms(&self, rows: &[usize]) -> DevResult<GemmTuning> {
        let fastest =
            |times: &[f64]| (0..times.len()).min_by(|&a, &b| times[a].total_cmp(&times[b])).unwrap_or(0);
        self.tune_gemms_by(rows, &fastest)
    }

    fn to_host(&self, t: &CudaTensor) -> DevResult<Vec<f32>> {
        if self.node.is_some() {
            // The copy would block behind a collective a lost node never joins.
            self.wait_queued("device to host copy")?;
        }
        let Some(h) = t.half.as_ref().filter(|_| t.half_only) else {
            return self.stream.clone_dtoh(&t.view()).map_err(cuda("device to host copy"));
        };
        let n = t.rows * t.cols;
        let words =
            self.stream.clone_dtoh(&h.buf.slice(0..n.div_ceil(2))).map_err(cuda("device to host copy"))?;
        let bits: &[u16] = bytemuck::cast_slice(&words);
        let mut values: Vec<f32> = bits[..n]
            .iter()
            .map(|&b| match h.kind {
                1 => half::bf16::from_bits(b).to_f32(),
                _ => half::f16::from_bits(b).to_f32(),
            })
            .collect();
        if let Some(s) = &t.scale {
            // The scale the GEMV would apply, row by row.
            let sums = self
                .stream
                .clone_dtoh(&s.sums.slice(0..t.rows * s.parts))
                .map_err(cuda("device to host copy"))?;
            for (row, sums) in values.chunks_mut(t.cols).zip(sums.chunks(s.parts)) {
                let r = 1.0 / (sums.iter().sum::<f32>() / t.cols as f32 + s.eps).sqrt();
                row.iter_mut().for_each(|v| *v *= r);
            }
        }
        Ok(values)
    }

    fn synchronize(&self) -> DevResult<()> {
        self.wait_queued("stream synchronize")
    }

    fn remote_ranks(&self) -> Option<std::sync::Arc<dyn crate::kernels::RemoteRanks>> {
        self.node.as_ref().and_then(|n| n.remote.clone())
    }

    fn group_health(&self) -> Option<std::sync::Arc<dyn crate::kernels::GroupHealth>> {
        self.node.as_ref().map(|n| n.health.clone())
    }

    fn fail_group(&self, why: &str) {
        if let Some(n) = &self.node {
            n.health.fail(format!("rank {}: {why}", self.tp.rank));
        }
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32]) -> DevResult<CudaTensor> {
        let hidden = table.shape[1];
        let mut out = self.tensor(ids.len(), hidden)?;
        let ids = self.stage_ids(ids)?;
        let _t = self.span("embedding", (0, 0), ids.len());
        let h = hidden as i32;
        let cfg = Self::rows(out.rows);
        let (name, table_ptr) = match &table.buf {
            WeightBuf::F32(t) => ("embedding_f32", t as &dyn WeightArg),
            WeightBuf::Bf16(t) => ("embedding_bf16", t as &dyn WeightArg),
            WeightBuf::F16(t) => ("embedding_f16", t as &dyn WeightArg),
            WeightBuf::Rows { .. } => return Err(packed_table()),
        };
        let mut launch = self.stream.launch_builder(self.f(name));
        table_ptr.push(&mut launch);
        // SAFETY: table is [vocab, hidden]; ids were validated against the vocabulary at admission.
        unsafe { launch.arg(&ids).arg(&mut *out.buf).arg(&h).launch(cfg) }
            .map_err(cuda("embedding launch"))?;
        self.restage("embedding ids", ids);
        Ok(out)
    }

    /// The positions come from the buffer the step's RoPE reads (staged anew for a graph).
    fn embed_positions(&self, table: &CudaWeight, positions: &[u32], offset: u32) -> DevResult<CudaTensor> {
        let hidden = table.shape[1];
        let mut out = self.tensor(positions.len(), hidden)?;
        self.rope_positions(positions)?;
        let inputs = self.inputs().rope_positions.borrow();
        let pos = &inputs
            .as_ref()
            .ok_or_else(|| DeviceError::Other("positions missing after their upload".into()))?
            .1;
        let (h, off) = (hidden as i32, offset as i32);
        let name = match &table.buf {
            WeightBuf::F32(_) => "embed_positions_f32",
            WeightBuf::Bf16(_) => "embed_positions_bf16",
            WeightBuf::F16(_) => "embed_positions_f16",
            WeightBuf::Rows { .. } => return Err(packed_table()),
        };
        let _t = self.span("embed_positions", (0, 0), positions.len());
        let mut launch = self.stream.launch_builder(self.f(name));
        table.push_arg(&mut launch);
        launch.arg(pos).arg(&mut *out.buf).arg(&h).arg(&off);
        // SAFETY: the table holds max_positions + offset rows; positions stay below the
        // model's maximum (checked at admission).
        unsafe { launch.launch(Self::rows(out.rows)) }.map_err(cuda("embed_positions launch"))?;
        Ok(out)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, bias: Option<&CudaWeight>) -> DevResult<CudaTensor> {
        let mut out = self.tensor(x.rows, w.shape[0])?;
        self.linear_into(x, w, bias, &mut out, 0.0)?;
        Ok(out)
    }

    /// For a batch past BGMV's rows whose adapters cover every output column (q, k and v of
    /// the qkv projection; gate and up; o; down), the deltas come first, written over the
    /// output rather than added to it, and the projection's GEMM adds itself to them: the
    /// output's f32 values cross memory once less.
    fn linear_lora(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        modules: &[(&CudaLora, usize)],
        slots: &[i32],
    ) -> DevResult<CudaTensor> {
        let n = w.shape[0];
        self.upload_lora_slots(slots)?;
        let first = Self::lora_first(x.rows, modules, n);
        self.lora_deltas_first.set(first);
        if !first {
            let mut y = self.linear(x, w, bias)?;
            self.lora_add(&mut y, x, modules)?;
            return Ok(y);
        }
        let mut out = self.tensor(x.rows, n)?;
        self.lora_gemms(GemmOut::f32(self, &mut out), x, modules, 0.0)?;
        self.linear_into(x, w, bias, &mut out, 1.0)?;
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaWeight, eps: f32) -> DevResult<CudaTensor> {
        self.norm(x, None, w, eps, false)
    }

    fn add_rms_norm(
        &self,
        x: &CudaTensor,
        residual: &mut CudaTensor,
        w: &CudaWeight,
        eps: f32,
    ) -> DevResult<CudaTensor> {
        self.norm(x, Some(residual), w, eps, false)
    }

    /// One kernel where its threads hold the row in registers.
    fn rms_norm_add_rms_norm(
        &self,
        x: &CudaTensor,
        pre: (&CudaWeight, f32),
        residual: &mut CudaTensor,
        norm: (&CudaWeight, f32),
    ) -> DevResult<CudaTensor> {
        if !Self::norms_twice(x.cols) {
            let normed = self.norm(x, None, pre.0, pre.1, false)?;
            return self.norm(&normed, Some(residual), norm.0, norm.1, false);
        }
        self.norm_of(x, Some(pre), Some(residual), norm, false)
    }

    /// Up to 8 rows over 16-bit weights, for a norm only the next projection's GEMV reads:
    /// one GEMV, the norm's scale left to that GEMV (`CudaDevice::linear_res_norm`).
    fn linear_add_rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        residual: &mut CudaTensor,
        norm: &CudaWeight,
        eps: f32,
        gemm_only: bool,
    ) -> DevResult<CudaTensor> {
        if gemm_only && let Some(t) = self.linear_res_norm(x, w, residual, norm, eps)? {
            self.norm_in_gemv.set(true);
            return Ok(t);
        }
        self.norm_in_gemv.set(false);
        let y = self.linear(x, w, None)?;
        self.norm(&y, Some(residual), norm, eps, gemm_only)
    }

    /// The norm in the 16-bit copy alone where there is one (16-bit weights): every GEMM
    /// of 16-bit weights, and the GEMV, read that copy.
    fn rms_norm_for_gemm(
        &self,
        x: &CudaTensor,
        residual: Option<&mut CudaTensor>,
        w: &CudaWeight,
        eps: f32,
    ) -> DevResult<CudaTensor> {
        self.norm(x, residual, w, eps, true)
    }

    fn add_inplace(&self, acc: &mut CudaTensor, x: &CudaTensor) -> DevResult<()> {
        let n = (acc.rows * acc.cols) as i64;
        let _t = self.span("add", (0, 0), acc.rows);
        // SAFETY: both hold n values.
        unsafe {
            self.stream
                .launch_builder(self.f("add_f32"))
                .arg(&mut *acc.buf)
                .arg(&*x.buf)
                .arg(&n)
                .launch(Self::grid(n as usize))
        }
        .map_err(cuda("add launch"))?;
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        b: Option<&CudaWeight>,
        eps: f32,
    ) -> DevResult<CudaTensor> {
        let mut out = self.tensor(x.rows, x.cols)?;
        let (cols, has_bias) = (x.cols as i32, i32::from(b.is_some()));
        let _t = self.span("layer_norm", (0, 0), x.rows);
        let mut launch = self.stream.launch_builder(self.f("layer_norm_f32"));
        launch.arg(&*x.buf);
        w.push_arg(&mut launch);
        b.unwrap_or(w).push_arg(&mut launch);
        launch.arg(&has_bias).arg(&mut *out.buf).arg(&cols).arg(&eps);
        // SAFETY: x and out are [rows, cols]; w (and b) hold cols f32 (1-D weights are f32).
        unsafe { launch.launch(Self::rows(x.rows)) }.map_err(cuda("layer_norm launch"))?;
        Ok(out)
    }

    fn scale(&self, x: &mut CudaTensor, s: f32) -> DevResult<()> {
        self.elementwise_f32("scale_f32", x, Param::F32(s))
    }

    fn softcap(&self, x: &mut CudaTensor, cap: f32) -> DevResult<()> {
        self.elementwise_f32("softcap_f32", x, Param::F32(cap))
    }

    fn activation(&self, x: &mut CudaTensor, act: Activation) -> DevResult<()> {
        self.elementwise_f32("activation_f32", x, Param::I32(act_code(act)))
    }

    fn add_sigmoid_gated(&self, acc: &mut CudaTensor, x: &CudaTensor, gate: &CudaTensor) -> DevResult<()> {
        self.add_sigmoid_gated_impl(acc, x, gate)
    }

    fn fused_moe(
        &self,
        x: &CudaTensor,
        router_logits: &CudaTensor,
        gate_up: &CudaWeight,
        down: &CudaWeight,
        spec: MoeSpec,
    ) -> DevResult<CudaTensor> {
        self.fused_moe_impl(x, router_logits, gate_up, down, spec)
    }

    fn act_mul(&self, gate_up: &CudaTensor, act: Activation) -> DevResult<CudaTensor> {
        let src = gate_up.buf.device_ptr(&self.stream).0;
        // SAFETY: gate_up holds rows · cols floats.
        unsafe { self.act_mul_at(src, 0, gate_up.rows, gate_up.cols / 2, true, act) }
    }

    /// With 16-bit weights past the GEMV's rows, the projection is written in their type
    /// (`CudaDevice::gate_up_act_16`), and with `gemm_only` so is the result alone.
    fn gate_up_act(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        lora: LoraRows<CudaLora>,
        act: Activation,
        gemm_only: bool,
    ) -> DevResult<CudaTensor> {
        match self.gate_up_act_16(x, w, lora, act, gemm_only)? {
            Some(out) => Ok(out),
            None => self.act_mul(&self.project(x, w, None, lora)?, act),
        }
    }

    fn qk_norm(
        &self,
        qkv: &mut CudaTensor,
        s: AttnShape,
        q_w: &CudaWeight,
        k_w: &CudaWeight,
        eps: f32,
    ) -> DevResult<()> {
        self.own_f32(qkv)?;
        let (cols, heads, hd) = (qkv.cols as i32, s.num_heads as i32, s.head_dim as i32);
        let cfg = LaunchConfig {
            grid_dim: (qkv.rows as u32, (s.num_heads + s.num_kv_heads) as u32, 1),
            block_dim: (s.head_dim.div_ceil(32).clamp(1, 8) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let _t = self.span("qk_norm", (0, 0), qkv.rows);
        let mut launch = self.stream.launch_builder(self.f("qk_norm_f32"));
        launch.arg(&mut *qkv.buf);
        q_w.push_arg(&mut launch);
        k_w.push_arg(&mut launch);
        launch.arg(&cols).arg(&heads).arg(&hd).arg(&eps);
        // SAFETY: qkv is [rows, (heads + 2 kv_heads) · head_dim]; q_w, k_w hold head_dim f32.
        unsafe { launch.launch(cfg) }.map_err(cuda("qk_norm launch"))?;
        Ok(())
    }

    fn split_qkv_rope(
        &self,
        qkv: &CudaTensor,
        s: AttnShape,
        rope: &RopeSpec,
        meta: &AttnMetadata,
    ) -> DevResult<(CudaTensor, CudaTensor, CudaTensor)> {
        let n = qkv.rows;
        let (mut q, mut k, mut v) = (
            self.tensor(n, s.num_heads * s.head_dim)?,
            self.tensor(n, s.num_kv_heads * s.head_dim)?,
            self.tensor(n, s.num_kv_heads * s.head_dim)?,
        );
        self.rope_launch(qkv, s, rope, meta, RopeOut::Tensors(&mut q, &mut k, &mut v))?;
        Ok((q, k, v))
    }

    /// RoPE writes K and V into the cache at the step's slots, then attention reads them.
    fn qkv_attention(
        &self,
        qkv: &CudaTensor,
        s: AttnShape,
        rope: &RopeSpec,
        cache: &mut CudaCache,
        meta: &AttnMetadata,
    ) -> DevResult<CudaTensor> {
        self.attention_inputs(s, meta)?;
        let mut q = self.tensor(qkv.rows, s.num_heads * s.head_dim)?;
        self.rope_launch(qkv, s, rope, meta, RopeOut::Cache(&mut q, cache))?;
        self.attend_cached(&q, cache, s)
    }

    /// Up to 8 rows of 16-bit weights over a cache of their type: one GEMV that applies
    /// RoPE and writes k and v into the cache (`CudaDevice::qkv_rope_gemv`), then attention.
    fn project_qkv_attention(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        (s, rope): (AttnShape, &RopeSpec),
        cache: &mut CudaCache,
        meta: &AttnMetadata,
    ) -> DevResult<CudaTensor> {
        let q = match bias {
            None => self.qkv_rope_gemv((x, w), s, rope, cache, meta)?,
            Some(_) => None,
        };
        self.qkv_on_gemv.set(q.is_some());
        if let Some(q) = q {
            return self.attend_cached(&q, cache, s);
        }
        let qkv = self.linear(x, w, bias)?;
        self.qkv_attention(&qkv, s, rope, cache, meta)
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        cache: &mut CudaCache,
        s: AttnShape,
        meta: &AttnMetadata,
    ) -> DevResult<CudaTensor> {
        self.attend(q, k, v, cache, s, meta)
    }

    fn capture_graph(
        &self,
        ids: &[u32],
        meta: &AttnMetadata,
        ctx_bound: usize,
        forward: &mut dyn FnMut() -> DevResult<CudaTensor>,
    ) -> DevResult<Option<super::CudaGraphStep>> {
        self.capture(ids, meta, ctx_bound, forward).map(Some)
    }

    fn replay_graph<'g>(
        &self,
        graph: &'g super::CudaGraphStep,
        ids: &[u32],
        meta: &AttnMetadata,
    ) -> DevResult<&'g CudaTensor> {
        self.replay(graph, ids, meta)
    }

    fn sample_rows(&self, logits: CudaTensor, inputs: &[SampleInput]) -> DevResult<Vec<Sampled>> {
        self.sample(logits, inputs)
    }

    fn sample_rows_issue(&self, logits: CudaTensor, inputs: &[SampleInput]) -> DevResult<SampleTicket> {
        self.sample_issue(logits, inputs)
    }

    fn sample_rows_collect(&self, ticket: SampleTicket) -> DevResult<Vec<Sampled>> {
        self.sample_collect(ticket)
    }

    fn feeds_sampled_tokens(&self) -> bool {
        true
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> DevResult<CudaTensor> {
        let mut out = self.tensor(rows.len(), x.cols)?;
        let r: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let r = self.stage("gathered rows", &r)?;
        let cols = x.cols as i32;
        let _t = self.span("gather_rows", (0, 0), rows.len());
        // SAFETY: rows index inside x.
        unsafe {
            self.stream
                .launch_builder(self.f("gather_rows_f32"))
                .arg(&*x.buf)
                .arg(&r)
                .arg(&mut *out.buf)
                .arg(&cols)
                .launch(Self::rows(rows.len()))
        }
        .map_err(cuda("gather launch"))?;
        self.restage("gathered rows", r);
        Ok(out)
    }

    fn alloc_lora(&self, shapes: &[LoraShape]) -> Result<Vec<CudaLora>, DeviceError> {
        self.lora_alloc(shapes)
    }

    fn set_lora_slot(&self, l: &mut CudaLora, slot: usize, w: Option<LoraSlotWeights>) -> DevResult<()> {
        self.lora_set(l, slot, w)
    }

    fn add_lora(
        &self,
        y: &mut CudaTensor,
        x: &CudaTensor,
        modules: &[(&CudaLora, usize)],
        slots: &[i32],
    ) -> DevResult<()> {
        self.upload_lora_slots(slots)?;
        self.lora_add(y, x, modules)
    }
}

/// An embedding table of packed rows: the kernels look rows up in 16-bit tables only.
fn packed_table() -> DeviceError {
    DeviceError::Other(
        "an embedding table of packed rows is not read on the GPU (checkpoints quantize projections)".into(),
    )
}

impl CudaWeight {
    /// The weight's buffer as a kernel argument (1-D weights are always f32).
    fn push_arg<'a>(&'a self, launch: &mut cudarc::driver::LaunchArgs<'a>) {
        match &self.buf {
            WeightBuf::F32(b) => launch.arg(b),
            WeightBuf::Bf16(b) => launch.arg(b),
            WeightBuf::F16(b) => launch.arg(b),
            WeightBuf::Rows { .. } => unreachable!("packed rows are 2-D projections, read by the GEMMs"),
        };
    }
}

impl CudaDevice {
    /// Makes `x`'s f32 values the only ones: an in-place op then leaves no stale 16-bit
    /// copy. Tensors kept in 16 bits alone, or with a norm left to a GEMV, are not for
    /// in-place ops (no model applies one to them).
    fn own_f32(&self, x: &mut CudaTensor) -> DevResult<()> {
        if x.half_only || x.scale.is_some() {
            return Err(DeviceError::Other("an in-place op on a tensor kept for a GEMM alone".into()));
        }
        x.half = None;
        Ok(())
    }

    /// One thread per value of `x`, in place: `name(x, n, param)`.
    fn elementwise_f32(&self, name: &'static str, x: &mut CudaTensor, param: Param) -> DevResult<()> {
        self.own_f32(x)?;
        let n = (x.rows * x.cols) as i64;
        let _t = self.span(name, (0, 0), x.rows);
        let mut launch = self.stream.launch_builder(self.f(name));
        launch.arg(&mut *x.buf).arg(&n);
        match &param {
            Param::F32(v) => launch.arg(v),
            Param::I32(v) => launch.arg(v),
        };
        // SAFETY: x holds n floats; the kernel touches x[i] for i < n.
        unsafe { launch.launch(Self::grid(n as usize)) }.map_err(cuda("element-wise launch"))?;
        Ok(())
    }
}

/// The scalar an element-wise kernel takes after its values.
enum Param {
    F32(f32),
    I32(i32),
}
