//! The CPU device: f32 activations in `Vec`s, weights in their checkpoint dtype, the paged
//! KV cache as f32 blocks `[num_blocks, block_size, kv_heads, head_dim]`. Work is split over
//! the rayon pool (both cores of a small machine).

mod attention;
pub mod family;
pub mod group;
pub mod lora;
pub mod matmul;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub mod packed;
pub mod quant;
mod simd;

/// Deterministic test values in [-0.5, 0.5) (an LCG), for the kernels' unit tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

use super::moe::{self, MoeSpec};
use super::{
    Activation, AttnShape, CacheShape, DType, DevResult, Device, DeviceError, FED_TOKEN, Fp8Format,
    HostTensor, KvDtype, KvScales, LoraShape, LoraSlotWeights, RopeSpec, SampleTicket, Sampled, TpRank,
};
use crate::kernels::attn::AttnMetadata;
use crate::sampling::SampleInput;
pub use family::Family;
use group::{Collective, CpuGroup};
pub use matmul::WeightData;

/// Row-major `[rows, cols]` f32 activations.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuTensor {
    pub fn new(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        Self { data, rows, cols }
    }
    fn zeros(rows: usize, cols: usize) -> Self {
        Self::new(vec![0.0; rows * cols], rows, cols)
    }
}

/// A weight in the layout its matmul wants.
pub enum Layout {
    /// Row-major `[out, in]` (1-D weights, and every weight of a portable run).
    Rows(WeightData),
    /// The SIMD families' panel layout of a 2-D weight.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    Packed(PackedData),
    /// A 3-D `[experts, out, in]` weight: one 2-D weight per expert, each in its own layout.
    Stacked(Vec<CpuWeight>),
    /// A 2-D weight kept in llama.cpp's blocks (`--keep-quantized`).
    Quant(quant::QuantWeight),
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub enum PackedData {
    F32(packed::Packed<f32>),
    Bf16(packed::Packed<u16>),
    F16(packed::Packed<f16>),
}

pub struct CpuWeight {
    pub shape: Vec<usize>,
    pub layout: Layout,
}

impl CpuWeight {
    /// Row `r` of a 2-D weight (or the whole of a 1-D one) widened to f32.
    fn row_f32(&self, r: usize, out: &mut [f32]) {
        let n = out.len();
        let start = r * n;
        match &self.layout {
            Layout::Rows(WeightData::F32(v)) => out.copy_from_slice(&v[start..start + n]),
            Layout::Rows(WeightData::Bf16(v)) => {
                for (o, &b) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            Layout::Rows(WeightData::F16(v)) => {
                for (o, h) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = h.to_f32();
                }
            }
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            Layout::Packed(PackedData::F32(p)) => p.row_f32(r, out),
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            Layout::Packed(PackedData::Bf16(p)) => p.row_f32(r, out),
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            Layout::Packed(PackedData::F16(p)) => p.row_f32(r, out),
            Layout::Quant(q) => q.row_f32(r, out),
            // Row r of the experts' rows laid end to end.
            Layout::Stacked(experts) => {
                let per = experts[0].shape[0];
                experts[r / per].row_f32(r % per, out)
            }
        }
    }
    fn to_f32(&self) -> Vec<f32> {
        let n: usize = self.shape.iter().product();
        let mut v = vec![0.0; n];
        self.row_f32(0, &mut v);
        v
    }
}

fn use_packed(shape: &[usize], family: Family) -> bool {
    shape.len() == 2 && family != Family::Portable
}

/// One layer's paged cache: K and V, each `[num_blocks, block_size, kv_heads, head_dim]`.
pub struct CpuCache {
    pub shape: CacheShape,
    pub k: KvCells,
    pub v: KvCells,
}

/// The elements of one of a layer's K or V caches, in the cache's dtype.
pub enum KvCells {
    F32(Vec<f32>),
    /// FP8 bytes (e4m3 or e5m2) of the values divided by the cache's scale.
    Fp8(Fp8Cells),
}

/// An FP8 cache's bytes, their format, its scale, and each byte's value times the scale
/// (what a read gives, by table).
pub struct Fp8Cells {
    pub bytes: Vec<u8>,
    pub format: Fp8Format,
    scale: f32,
    values: Box<[f32; 256]>,
    /// --calculate-kv-scales: the scale is to be set from the first rows written, as their
    /// largest magnitude over this.
    calibrate: Option<f32>,
}

impl Fp8Cells {
    fn new(format: Fp8Format, n: usize) -> Self {
        Self { bytes: vec![0; n], format, scale: 1.0, values: Box::new(*format.values()), calibrate: None }
    }

    /// Stores and reads by `scale` from here on (a checkpoint's `k_scale` or `v_scale`).
    fn set_scale(&mut self, scale: f32) {
        self.scale = scale;
        *self.values = self.format.values().map(|v| v * scale);
    }
}

impl KvCells {
    pub fn new(dtype: KvDtype, n: usize) -> Self {
        match dtype.fp8() {
            None => KvCells::F32(vec![0.0; n]),
            Some(format) => KvCells::Fp8(Fp8Cells::new(format, n)),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            KvCells::F32(c) => c.len(),
            KvCells::Fp8(c) => c.bytes.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stores `src` at element `at`, rounded to the cache's dtype (over FP8, each value
    /// divided by the scale first).
    pub fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            KvCells::F32(c) => c[at..at + src.len()].copy_from_slice(src),
            KvCells::Fp8(c) => {
                // v / 1 is v: scale 1 needs no path of its own.
                // The format is matched once a row, not once an element.
                let s = c.scale;
                let dst = c.bytes[at..at + src.len()].iter_mut().zip(src);
                match c.format {
                    Fp8Format::E4m3 => dst.for_each(|(d, &v)| *d = super::e4m3::encode(v / s)),
                    Fp8Format::E5m2 => dst.for_each(|(d, &v)| *d = super::e5m2::encode(v / s)),
                }
            }
        }
    }

    /// The values of elements `at .. at + out.len()` into `out` (FP8 bytes widened under
    /// `family`'s vectors: the same values in every family).
    pub fn read(&self, at: usize, out: &mut [f32], family: Family) {
        match self {
            KvCells::F32(c) => out.copy_from_slice(&c[at..at + out.len()]),
            KvCells::Fp8(c) => simd::family_widen_fp8(
                family,
                c.format,
                &c.values,
                c.scale,
                &c.bytes[at..at + out.len()],
                out,
            ),
        }
    }

    /// Under --calculate-kv-scales, before the first rows are written: an FP8 cache waiting
    /// for its scale takes the rows' largest magnitude over its range (keeping 1 if they are
    /// all 0), once.
    pub fn calibrate<'a>(&mut self, rows: impl Iterator<Item = &'a [f32]>) {
        if let KvCells::Fp8(c) = self
            && let Some(range) = c.calibrate.take()
        {
            let amax = rows.flatten().fold(0f32, |m, x| m.max(x.abs()));
            if amax > 0.0 {
                c.set_scale(amax / range);
            }
        }
    }

    /// Copies elements `src` to `dst` (a forked beam's block).
    fn copy_within(&mut self, src: std::ops::Range<usize>, dst: usize) {
        match self {
            KvCells::F32(c) => c.copy_within(src, dst),
            KvCells::Fp8(c) => c.bytes.copy_within(src, dst),
        }
    }
}

/// The CPU, alone or as one rank of an in-process tensor-parallel group.
#[derive(Clone, Default)]
pub struct CpuDevice {
    group: Option<Arc<Member>>,
    /// With [`CpuDevice::feeding_sampled_tokens`]: samplings issued and not yet collected.
    fed: Option<Arc<std::sync::Mutex<FedSamples>>>,
    /// The kernel family it lays weights out for and runs.
    family: Family,
}

/// A feeding CPU device's samplings issued and not yet collected, by number.
#[derive(Default)]
struct FedSamples {
    issued: Vec<(u64, Vec<Sampled>)>,
    next: u64,
}

/// One rank's membership of a group; when its last handle goes (the rank's runner is
/// dropped, also after a panic), the group is broken so that the others fail, not hang.
struct Member {
    group: Arc<dyn Collective>,
    rank: usize,
    /// On rank 0 of a group that spans processes: the other ranks.
    remote: Option<Arc<dyn crate::kernels::RemoteRanks>>,
}

impl Drop for Member {
    fn drop(&mut self) {
        self.group.fail(format!("rank {} has stopped", self.rank));
    }
}

/// How long a rank of a CPU group waits at a collective for the others by default.
pub const DEFAULT_RANK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl CpuDevice {
    /// The ranks of a tensor-parallel group of `world` CPU devices (one thread each).
    pub fn group(world: usize) -> Vec<CpuDevice> {
        Self::group_with_timeout(world, DEFAULT_RANK_TIMEOUT)
    }

    /// As [`CpuDevice::group`], a rank that has not reached a collective `timeout` after
    /// another failing the group.
    pub fn group_with_timeout(world: usize, timeout: std::time::Duration) -> Vec<CpuDevice> {
        if world == 1 {
            return vec![CpuDevice::default()];
        }
        let g = Arc::new(CpuGroup::new(world, timeout));
        (0..world)
            .map(|rank| CpuDevice {
                group: Some(Arc::new(Member { group: g.clone(), rank, remote: None })),
                ..CpuDevice::default()
            })
            .collect()
    }

    /// Rank `rank` of a group whose collectives `group` carries (other processes' ranks
    /// among them); on rank 0, `remote` sends each step to those ranks.
    pub fn in_group(
        rank: usize,
        group: Arc<dyn Collective>,
        remote: Option<Arc<dyn crate::kernels::RemoteRanks>>,
    ) -> CpuDevice {
        CpuDevice { group: Some(Arc::new(Member { group, rank, remote })), ..CpuDevice::default() }
    }

    /// The same device running the kernel family `family` (which this CPU must support:
    /// [`family::choose`]), for weights uploaded from now on.
    pub fn with_family(self, family: Family) -> Self {
        assert!(family.supported(), "this CPU cannot run the {} kernels", family.name());
        Self { family, ..self }
    }

    /// The kernel family the device runs.
    pub fn family(&self) -> Family {
        self.family
    }

    /// A CPU device that, as a GPU does, leaves a step's sampled tokens to be collected
    /// later and takes them as the next step's token ids itself ([`FED_TOKEN`]): the
    /// runner then answers each step of the Scheduler's at the next message, as on a GPU.
    /// The CPU gains nothing by it (its forward runs as it is issued); it lets machines
    /// without a GPU test that protocol.
    pub fn feeding_sampled_tokens() -> Self {
        CpuDevice { fed: Some(Arc::default()), ..CpuDevice::default() }
    }

    /// The samplings issued and not yet collected, on a feeding device.
    fn fed(&self) -> DevResult<std::sync::MutexGuard<'_, FedSamples>> {
        let fed =
            self.fed.as_ref().ok_or_else(|| DeviceError::Other("this device feeds no tokens".into()))?;
        fed.lock().map_err(|_| DeviceError::Other("sampled tokens lost to a panic".into()))
    }

    /// `ids` with those that name a row of the last sampling issued put in place.
    fn fed_ids<'a>(&self, ids: &'a [u32]) -> DevResult<std::borrow::Cow<'a, [u32]>> {
        if self.fed.is_none() || ids.iter().all(|&t| t < FED_TOKEN) {
            return Ok(ids.into());
        }
        let fed = self.fed()?;
        let last = fed.issued.iter().max_by_key(|(id, _)| *id).map_or(&[][..], |(_, rows)| rows.as_slice());
        ids.iter()
            .map(|&t| match t.checked_sub(FED_TOKEN) {
                None => Ok(t),
                Some(row) => last.get(row as usize).map(|&(token, _)| token).ok_or_else(|| {
                    DeviceError::Other(format!(
                        "token id {t:#x} names no row of a sampling waiting to be collected"
                    ))
                }),
            })
            .collect::<DevResult<Vec<u32>>>()
            .map(Into::into)
    }
}

impl Device for CpuDevice {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Cache = CpuCache;
    type Lora = lora::CpuLora;
    /// The CPU has no graphs: every step runs as issued.
    type Graph = std::convert::Infallible;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }

    fn tp(&self) -> TpRank {
        match &self.group {
            Some(m) => TpRank { rank: m.rank, world: m.group.world() },
            None => TpRank::SINGLE,
        }
    }

    fn all_reduce(&self, x: &mut CpuTensor) -> DevResult<()> {
        match &self.group {
            Some(m) => m.group.all_reduce(m.rank, &mut x.data),
            None => Ok(()),
        }
    }

    fn remote_ranks(&self) -> Option<Arc<dyn crate::kernels::RemoteRanks>> {
        self.group.as_ref().and_then(|m| m.remote.clone())
    }

    fn group_health(&self) -> Option<Arc<dyn crate::kernels::GroupHealth>> {
        self.group.as_ref().map(|m| m.group.clone() as Arc<dyn crate::kernels::GroupHealth>)
    }

    fn fail_group(&self, why: &str) {
        if let Some(m) = &self.group {
            m.group.fail(format!("rank {}: {why}", m.rank));
        }
    }

    fn all_gather_cols(&self, x: &CpuTensor, keep: usize, total: usize) -> DevResult<CpuTensor> {
        Ok(match &self.group {
            Some(m) => CpuTensor {
                data: m.group.all_gather_cols(m.rank, &x.data, x.rows, keep, total)?,
                rows: x.rows,
                cols: total,
            },
            None => {
                let mut out = CpuTensor::zeros(x.rows, total);
                for (o, i) in out.data.chunks_mut(total.max(1)).zip(x.data.chunks(x.cols.max(1))) {
                    o.copy_from_slice(&i[..total]);
                }
                out
            }
        })
    }

    fn upload(&self, t: HostTensor<'_>) -> Result<CpuWeight, DeviceError> {
        let numel: usize = t.shape.iter().product();
        let need = t.dtype.row_bytes(numel);
        if t.data.len() != need {
            return Err(DeviceError::WeightSize { shape: t.shape, dtype: t.dtype, got: t.data.len(), need });
        }
        if let [experts, n, k] = t.shape[..] {
            let bytes = t.dtype.row_bytes(n * k);
            let each = (0..experts).map(|e| {
                let data = std::borrow::Cow::Borrowed(&t.data[e * bytes..(e + 1) * bytes]);
                self.upload(HostTensor { dtype: t.dtype, shape: vec![n, k], data })
            });
            let layout = Layout::Stacked(each.collect::<Result<_, _>>()?);
            return Ok(CpuWeight { shape: t.shape, layout });
        }
        if let DType::Rows(_) = t.dtype {
            let mut data = Vec::new();
            t.dtype.widened().convert_from(t.dtype, &t.data, &mut data);
            return self.upload(HostTensor { dtype: t.dtype.widened(), shape: t.shape, data: data.into() });
        }
        let b = &t.data;
        if let DType::Quant(format) = t.dtype {
            let &[n, k] = &t.shape[..] else {
                return Err(DeviceError::Other(format!(
                    "{format} blocks are kept for 2-D weights only, not one of shape {:?}",
                    t.shape
                )));
            };
            let q = quant::QuantWeight::from_blocks(format, b, n, k);
            return Ok(CpuWeight { shape: t.shape, layout: Layout::Quant(q) });
        }
        let data = match t.dtype {
            DType::F32 => WeightData::F32(bytemuck::pod_collect_to_vec(b)),
            DType::BF16 => WeightData::Bf16(bytemuck::pod_collect_to_vec(b)),
            DType::F16 => {
                WeightData::F16(b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect())
            }
            DType::Quant(_) | DType::Rows(_) => unreachable!("kept above"),
        };
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        if use_packed(&t.shape, self.family) {
            let (n, k) = (t.shape[0], t.shape[1]);
            let packed = match data {
                WeightData::F32(v) => PackedData::F32(packed::Packed::pack(&v, n, k)),
                WeightData::Bf16(v) => PackedData::Bf16(packed::Packed::pack(&v, n, k)),
                WeightData::F16(v) => PackedData::F16(packed::Packed::pack(&v, n, k)),
            };
            return Ok(CpuWeight { shape: t.shape, layout: Layout::Packed(packed) });
        }
        Ok(CpuWeight { shape: t.shape, layout: Layout::Rows(data) })
    }

    fn alloc_cache(&self, shape: CacheShape, dtype: KvDtype) -> Result<CpuCache, DeviceError> {
        let n = shape.num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
        Ok(CpuCache { shape, k: KvCells::new(dtype, n), v: KvCells::new(dtype, n) })
    }

    fn set_kv_scales(&self, cache: &mut CpuCache, scales: KvScales) -> Result<(), DeviceError> {
        match (&mut cache.k, &mut cache.v) {
            (KvCells::Fp8(k), KvCells::Fp8(v)) => {
                k.set_scale(scales.k);
                v.set_scale(scales.v);
                Ok(())
            }
            _ => Err(DeviceError::Other("KV cache scales are for an FP8 cache".into())),
        }
    }

    fn calculate_kv_scales(&self, cache: &mut CpuCache) -> Result<(), DeviceError> {
        match (&mut cache.k, &mut cache.v) {
            (KvCells::Fp8(k), KvCells::Fp8(v)) => {
                k.calibrate = Some(super::K_SCALE_RANGE);
                v.calibrate = Some(super::V_SCALE_RANGE);
                Ok(())
            }
            _ => Err(DeviceError::Other("KV cache scales are for an FP8 cache".into())),
        }
    }

    fn copy_blocks(&self, cache: &mut CpuCache, pairs: &[(u32, u32)]) -> DevResult<()> {
        let s = cache.shape;
        let n = s.block_size * s.num_kv_heads * s.head_dim;
        for &(src, dst) in pairs {
            let (src, dst) = (src as usize, dst as usize);
            if src.max(dst) >= s.num_blocks {
                return Err(DeviceError::Other(format!(
                    "copy_blocks: block {} of a {}-block cache",
                    src.max(dst),
                    s.num_blocks
                )));
            }
            for buf in [&mut cache.k, &mut cache.v] {
                buf.copy_within(src * n..(src + 1) * n, dst * n);
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> DevResult<()> {
        Ok(())
    }

    fn to_host(&self, t: &CpuTensor) -> DevResult<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32]) -> DevResult<CpuTensor> {
        let hidden = table.shape[1];
        let ids = self.fed_ids(ids)?;
        let mut out = CpuTensor::zeros(ids.len(), hidden);
        for (row, &id) in out.data.chunks_mut(hidden).zip(ids.iter()) {
            table.row_f32(id as usize, row);
        }
        Ok(out)
    }

    fn embed_positions(&self, table: &CpuWeight, positions: &[u32], offset: u32) -> DevResult<CpuTensor> {
        let hidden = table.shape[1];
        let mut out = CpuTensor::zeros(positions.len(), hidden);
        for (row, &p) in out.data.chunks_mut(hidden).zip(positions) {
            table.row_f32((p + offset) as usize, row);
        }
        Ok(out)
    }

    fn linear(&self, x: &CpuTensor, w: &CpuWeight, bias: Option<&CpuWeight>) -> DevResult<CpuTensor> {
        let (n, k) = (w.shape[0], w.shape[1]);
        assert_eq!(x.cols, k, "linear: input has {} features, weight expects {k}", x.cols);
        let mut out = CpuTensor::zeros(x.rows, n);
        match &w.layout {
            Layout::Rows(data) => matmul::matmul(&x.data, x.rows, k, data, n, &mut out.data),
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            Layout::Packed(PackedData::F32(p)) => {
                packed::matmul(self.family, &x.data, x.rows, p, &mut out.data)
            }
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            Layout::Packed(PackedData::Bf16(p)) => {
                packed::matmul(self.family, &x.data, x.rows, p, &mut out.data)
            }
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            Layout::Packed(PackedData::F16(p)) => {
                packed::matmul(self.family, &x.data, x.rows, p, &mut out.data)
            }
            Layout::Quant(q) => quant::matmul(self.family, &x.data, x.rows, q, &mut out.data),
            Layout::Stacked(_) => {
                return Err(DeviceError::Other("3-D expert weights are read by fused_moe only".into()));
            }
        }
        if let Some(b) = bias {
            let b = b.to_f32();
            for row in out.data.chunks_mut(n) {
                for (o, bi) in row.iter_mut().zip(&b) {
                    *o += bi;
                }
            }
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuWeight, eps: f32) -> DevResult<CpuTensor> {
        let w = w.to_f32();
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        out.data
            .par_chunks_mut(x.cols)
            .zip(x.data.par_chunks(x.cols))
            .for_each(|(o, xi)| rms_row(xi, &w, eps, o));
        Ok(out)
    }

    fn add_rms_norm(
        &self,
        x: &CpuTensor,
        residual: &mut CpuTensor,
        w: &CpuWeight,
        eps: f32,
    ) -> DevResult<CpuTensor> {
        self.add_inplace(residual, x)?;
        self.rms_norm(residual, w, eps)
    }

    fn add_inplace(&self, acc: &mut CpuTensor, x: &CpuTensor) -> DevResult<()> {
        assert_eq!((acc.rows, acc.cols), (x.rows, x.cols), "add: shape mismatch");
        for (a, b) in acc.data.iter_mut().zip(&x.data) {
            *a += b;
        }
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &CpuTensor,
        w: &CpuWeight,
        b: Option<&CpuWeight>,
        eps: f32,
    ) -> DevResult<CpuTensor> {
        let (w, b) = (w.to_f32(), b.map(CpuWeight::to_f32));
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        out.data.par_chunks_mut(x.cols).zip(x.data.par_chunks(x.cols)).for_each(|(o, xi)| {
            let n = xi.len() as f32;
            let mean = xi.iter().sum::<f32>() / n;
            let var = xi.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let r = 1.0 / (var + eps).sqrt();
            for (j, (o, &v)) in o.iter_mut().zip(xi).enumerate() {
                *o = (v - mean) * r * w[j] + b.as_ref().map_or(0.0, |b| b[j]);
            }
        });
        Ok(out)
    }

    fn scale(&self, x: &mut CpuTensor, s: f32) -> DevResult<()> {
        x.data.iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn softcap(&self, x: &mut CpuTensor, cap: f32) -> DevResult<()> {
        x.data.par_iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        Ok(())
    }

    fn activation(&self, x: &mut CpuTensor, act: Activation) -> DevResult<()> {
        x.data.par_iter_mut().for_each(|v| *v = act.apply(*v));
        Ok(())
    }

    fn add_sigmoid_gated(&self, acc: &mut CpuTensor, x: &CpuTensor, gate: &CpuTensor) -> DevResult<()> {
        assert_eq!((acc.rows, acc.cols), (x.rows, x.cols), "add_sigmoid_gated: shape mismatch");
        for ((a, xr), g) in
            acc.data.chunks_mut(acc.cols).zip(x.data.chunks(x.cols)).zip(gate.data.chunks(gate.cols))
        {
            let s = 1.0 / (1.0 + (-g[0]).exp());
            a.iter_mut().zip(xr).for_each(|(a, &v)| *a += s * v);
        }
        Ok(())
    }

    fn fused_moe(
        &self,
        x: &CpuTensor,
        router_logits: &CpuTensor,
        gate_up: &CpuWeight,
        down: &CpuWeight,
        spec: MoeSpec,
    ) -> DevResult<CpuTensor> {
        let (Layout::Stacked(gate_up), Layout::Stacked(down)) = (&gate_up.layout, &down.layout) else {
            return Err(DeviceError::Other("fused_moe needs 3-D expert weights".into()));
        };
        let (ids, weights) = moe::route(&router_logits.data, spec);
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        // Each expert once, over the rows routed to it, in expert order (transformers' order
        // of accumulation).
        for (e, rows, w) in moe::group_by_expert(&ids, &weights, spec) {
            let mut xs = CpuTensor::zeros(rows.len(), x.cols);
            for (dst, &r) in xs.data.chunks_mut(x.cols).zip(&rows) {
                dst.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
            }
            let act = self.act_mul(&self.linear(&xs, &gate_up[e], None)?, spec.act)?;
            let y = self.linear(&act, &down[e], None)?;
            for ((yr, &r), &w) in y.data.chunks(y.cols).zip(&rows).zip(&w) {
                out.data[r * x.cols..(r + 1) * x.cols].iter_mut().zip(yr).for_each(|(o, &v)| *o += v * w);
            }
        }
        Ok(out)
    }

    fn act_mul(&self, gate_up: &CpuTensor, act: Activation) -> DevResult<CpuTensor> {
        let i = gate_up.cols / 2;
        let mut out = CpuTensor::zeros(gate_up.rows, i);
        out.data.par_chunks_mut(i).zip(gate_up.data.par_chunks(gate_up.cols)).for_each(|(o, gu)| {
            let (g, u) = gu.split_at(i);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = act.apply(g) * u;
            }
        });
        Ok(out)
    }

    fn qk_norm(
        &self,
        qkv: &mut CpuTensor,
        s: AttnShape,
        q_w: &CpuWeight,
        k_w: &CpuWeight,
        eps: f32,
    ) -> DevResult<()> {
        let (q_w, k_w) = (q_w.to_f32(), k_w.to_f32());
        let (hd, qn, kn) = (s.head_dim, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        let mut head = vec![0f32; hd];
        for row in qkv.data.chunks_mut(qkv.cols) {
            let (q, rest) = row.split_at_mut(qn);
            for (part, w) in [(q, &q_w), (&mut rest[..kn], &k_w)] {
                for h in part.chunks_mut(hd) {
                    head.copy_from_slice(h);
                    rms_row(&head, w, eps, h);
                }
            }
        }
        Ok(())
    }

    fn split_qkv_rope(
        &self,
        qkv: &CpuTensor,
        s: AttnShape,
        rope: &RopeSpec,
        meta: &AttnMetadata,
    ) -> DevResult<(CpuTensor, CpuTensor, CpuTensor)> {
        let (qn, kn) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        let n = qkv.rows;
        let (mut q, mut k, mut v) =
            (CpuTensor::zeros(n, qn), CpuTensor::zeros(n, kn), CpuTensor::zeros(n, kn));
        let half = rope.inv_freq.len();
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        // Fixed frequencies need no lengths (an empty list: every token at 0).
        let lens = if rope.varies() { rope.lens(meta) } else { Vec::new() };
        let mut freqs: Option<(u32, std::borrow::Cow<'_, [f32]>)> = None;
        for (t, &pos) in meta.positions.iter().enumerate().take(n) {
            let row = &qkv.data[t * qkv.cols..(t + 1) * qkv.cols];
            q.data[t * qn..(t + 1) * qn].copy_from_slice(&row[..qn]);
            k.data[t * kn..(t + 1) * kn].copy_from_slice(&row[qn..qn + kn]);
            v.data[t * kn..(t + 1) * kn].copy_from_slice(&row[qn + kn..qn + 2 * kn]);
            // Angles in f32 as HF computes them (position · inv_freq), then cos/sin (times
            // the attention scaling of yarn and longrope).
            let len = lens.get(t).copied().unwrap_or(0);
            if freqs.as_ref().is_none_or(|(l, _)| *l != len) {
                freqs = Some((len, rope.inv_freq_at(len)));
            }
            let inv_freq = freqs.as_ref().map_or(&[][..], |(_, f)| f);
            let (p, m) = (pos as f32, rope.attention_scaling);
            for (i, f) in inv_freq.iter().enumerate() {
                let a = p * f;
                cos[i] = a.cos() * m;
                sin[i] = a.sin() * m;
            }
            rotate_half(&mut q.data[t * qn..(t + 1) * qn], s.head_dim, &cos, &sin);
            rotate_half(&mut k.data[t * kn..(t + 1) * kn], s.head_dim, &cos, &sin);
        }
        Ok((q, k, v))
    }

    fn paged_attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        cache: &mut CpuCache,
        shape: AttnShape,
        meta: &AttnMetadata,
    ) -> DevResult<CpuTensor> {
        attention::write_kv(cache, k, v, &meta.slot_mapping);
        Ok(attention::attend(q, cache, shape, meta, self.family))
    }

    fn alloc_lora(&self, shapes: &[LoraShape]) -> Result<Vec<lora::CpuLora>, DeviceError> {
        shapes
            .iter()
            .map(|&shape| {
                if shape.max_rank > 512 {
                    return Err(DeviceError::Other(format!("max LoRA rank {} exceeds 512", shape.max_rank)));
                }
                Ok(lora::CpuLora::new(shape))
            })
            .collect()
    }

    fn set_lora_slot(
        &self,
        l: &mut lora::CpuLora,
        slot: usize,
        weights: Option<LoraSlotWeights>,
    ) -> DevResult<()> {
        l.set(slot, weights);
        Ok(())
    }

    fn add_lora(
        &self,
        y: &mut CpuTensor,
        x: &CpuTensor,
        modules: &[(&lora::CpuLora, usize)],
        slots: &[i32],
    ) -> DevResult<()> {
        lora::apply(self.family, y, x, modules, slots);
        Ok(())
    }

    fn capture_graph(
        &self,
        _: &[u32],
        _: &AttnMetadata,
        _: usize,
        _: &mut dyn FnMut() -> DevResult<CpuTensor>,
    ) -> DevResult<Option<Self::Graph>> {
        Ok(None)
    }

    fn replay_graph<'g>(
        &self,
        graph: &'g Self::Graph,
        _: &[u32],
        _: &AttnMetadata,
    ) -> DevResult<&'g CpuTensor> {
        match *graph {}
    }

    fn sample_rows(&self, logits: CpuTensor, inputs: &[SampleInput]) -> DevResult<Vec<Sampled>> {
        // The logits are this step's own: sampled in place, not copied.
        let (cols, mut data) = (logits.cols.max(1), logits.data);
        Ok(data
            .par_chunks_mut(cols)
            .zip(inputs)
            .map(|(row, inp)| crate::sampling::sample(row, inp))
            .collect())
    }

    fn sample_rows_issue(&self, logits: CpuTensor, inputs: &[SampleInput]) -> DevResult<SampleTicket> {
        let rows = self.sample_rows(logits, inputs)?;
        if self.fed.is_none() {
            return Ok(SampleTicket::Done(rows));
        }
        let mut fed = self.fed()?;
        let id = fed.next;
        fed.next += 1;
        fed.issued.push((id, rows));
        Ok(SampleTicket::Issued(id))
    }

    fn sample_rows_collect(&self, ticket: SampleTicket) -> DevResult<Vec<Sampled>> {
        let id = match ticket {
            SampleTicket::Done(rows) => return Ok(rows),
            SampleTicket::Issued(id) => id,
        };
        let mut fed = self.fed()?;
        let at = fed.issued.iter().position(|(i, _)| *i == id);
        at.map(|i| fed.issued.remove(i).1).ok_or_else(|| {
            DeviceError::Other(format!("sampling {id} was never issued or was collected already"))
        })
    }

    fn feeds_sampled_tokens(&self) -> bool {
        self.fed.is_some()
    }

    /// On a thread of rayon's pool (`scope` runs its body there when called from outside).
    fn issue_forward<R: Send>(forward: impl FnOnce() -> R + Send) -> R {
        rayon::scope(|_| forward())
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> DevResult<CpuTensor> {
        let mut out = CpuTensor::zeros(rows.len(), x.cols);
        for (o, &r) in out.data.chunks_mut(x.cols).zip(rows) {
            o.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        Ok(out)
    }
}

/// HF's LlamaRMSNorm: `w · (x / sqrt(mean(x²) + eps))`, in f32.
fn rms_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ss + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * r);
    }
}

/// Rotary embedding in HF's rotate-half layout over each head of `x` (`[heads · head_dim]`):
/// the first rotary half pairs with the second, `x₁' = x₁·cos − x₂·sin`, `x₂' = x₂·cos + x₁·sin`.
fn rotate_half(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for h in x.chunks_mut(head_dim) {
        for i in 0..half {
            let (a, b) = (h[i], h[i + half]);
            h[i] = a * cos[i] - b * sin[i];
            h[i + half] = b * cos[i] + a * sin[i];
        }
    }
}
