//! Checkpoint loading: safetensors files (one, or sharded through
//! `model.safetensors.index.json`) memory-mapped, their tensors mapped onto model
//! parameters by a stacked-params table (vLLM's `load_weights`), and read back by layers
//! through a prefix-scoped view (`w.pp("model.layers").pp(i)`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::mapped::FileBytes;

use super::ModelError;
use super::kv_scales;
use super::packed::{self, Packing};
use crate::kernels::quant::QuantFormat;
use crate::kernels::rows::{RowFormat, RowKind};
use crate::kernels::{DType, HostTensor, KvScales};

/// One stacked parameter entry: checkpoint tensors named `*.{shard}.*` are loaded as shard
/// `index` of the fused parameter `*.{param}.*` (q/k/v → qkv_proj, gate/up → gate_up_proj).
#[derive(Debug, Clone, Copy)]
pub struct StackedParam {
    pub param: &'static str,
    pub shard: &'static str,
    pub index: usize,
}

/// A tensor inside a mapped checkpoint file.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// A tensor's entry in a file header: name, dtype, shape, byte range in the data section.
struct Entry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    range: (usize, usize),
}

struct MappedFile {
    path: PathBuf,
    mmap: FileBytes,
    header_len: usize,
    tensors: Vec<Entry>,
    /// Quantized tensors served only once rebuilt (`Checkpoint::rebuild`): FP8 (e4m3)
    /// weights and GPTQ/AWQ's int32 words.
    raw: Vec<Raw>,
}

/// A stored tensor the loader does not hand out as it is.
struct Raw {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    range: (usize, usize),
}

/// The memory-mapped safetensors files of a model directory.
pub struct Checkpoint {
    files: Vec<MappedFile>,
    /// Quantized weights rebuilt, in the dtype of the checkpoint's other weights (FP8) or
    /// of their scales (GPTQ, AWQ): name, dtype, shape, bytes.
    rebuilt: Vec<(String, DType, Vec<usize>, Vec<u8>)>,
    /// Stored tensors read into `rebuilt` (scales, zero points, group indices) or not
    /// read at all (FP8's activation and KV cache scales): not handed out.
    consumed: std::collections::HashSet<String>,
}

/// The values of an integer tensor of sizes (compressed-tensors' `weight_shape`: int64, or
/// int32 as older writers stored it).
fn dims(dtype: safetensors::Dtype, bytes: &[u8]) -> Vec<usize> {
    match dtype {
        safetensors::Dtype::I64 => bytes
            .chunks_exact(8)
            .map(|d| i64::from_le_bytes(std::array::from_fn(|i| d[i])) as usize)
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|d| i32::from_le_bytes(std::array::from_fn(|i| d[i])) as usize)
            .collect(),
    }
}

/// The safetensors metadata key that marks tensor `name` as llama.cpp blocks (the value
/// names the format: `Q4_1`). Such a tensor is stored as bytes, `[rows, row bytes]`.
pub fn quant_key(name: &str) -> String {
    format!("ggml_type:{name}")
}

/// A tensor's dtype and its shape in elements.
fn dtype_of(
    info: &safetensors::tensor::TensorInfo,
    name: &str,
    meta: Option<&HashMap<String, String>>,
    path: &Path,
) -> Result<(DType, Vec<usize>), ModelError> {
    let quant = meta.and_then(|m| m.get(&quant_key(name)));
    if let (safetensors::Dtype::U8, Some(format)) = (info.dtype, quant) {
        let f = QuantFormat::from_name(format).ok_or_else(|| {
            ModelError::Weights(format!(
                "{}: tensor {name} is in blocks of unknown format {format}",
                path.display()
            ))
        })?;
        let &[rows, bytes] = &info.shape[..] else {
            return Err(ModelError::Weights(format!(
                "{}: {f} tensor {name} has shape {:?}, not [rows, row bytes]",
                path.display(),
                info.shape
            )));
        };
        if !bytes.is_multiple_of(f.block_bytes()) {
            return Err(ModelError::Weights(format!(
                "{}: {f} tensor {name} has rows of {bytes} bytes, not whole blocks of {}",
                path.display(),
                f.block_bytes()
            )));
        }
        return Ok((DType::Quant(f), vec![rows, bytes / f.block_bytes() * f.block_elems()]));
    }
    let d = info.dtype;
    Ok((
        match d {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::Weights(format!(
                    "{}: tensor {name} has dtype {other:?} (supported: F32, F16, BF16)",
                    path.display()
                )));
            }
        },
        info.shape.clone(),
    ))
}

impl Checkpoint {
    /// Opens `model.safetensors`, or every shard listed in `model.safetensors.index.json`;
    /// `packing` is how its config.json says integer weights are packed (GPTQ, AWQ).
    pub fn open(dir: &Path, packing: Option<Packing>) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Weights(format!("{}: {e}", index.display())))?;
            let map = v["weight_map"]
                .as_object()
                .ok_or_else(|| ModelError::Weights(format!("{}: no weight_map object", index.display())))?;
            let mut files: Vec<String> =
                map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(ModelError::MissingFile {
                    path: single,
                    hint: "a model directory needs model.safetensors or model.safetensors.index.json \
                           (for a GGUF file, run `actorllm import-gguf FILE DIR` first)",
                });
            }
            vec![single]
        };
        let files = paths.into_iter().map(Self::map_file).collect::<Result<_, _>>()?;
        Self::rebuild(files, packing)
    }

    /// Opens one safetensors file (a LoRA adapter's).
    pub fn open_file(path: &Path) -> Result<Self, ModelError> {
        Self::rebuild(vec![Self::map_file(path.to_path_buf())?], None)
    }

    /// One safetensors file held in memory, named `name` in errors.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self, ModelError> {
        Self::rebuild(vec![Self::read_file(PathBuf::from(name), FileBytes::Owned(bytes))?], None)
    }

    /// The checkpoint of `files` with its quantized weights rebuilt: FP8 ones, `X.weight`
    /// times `X.weight_scale_inv` or `X.weight_scale` (see [`super::fp8`]); packed integer
    /// ones, `X.weight` from `X.qweight` and the rest (see [`super::packed`]).
    fn rebuild(files: Vec<MappedFile>, packing: Option<Packing>) -> Result<Self, ModelError> {
        let mut this = Self { files, rebuilt: Vec::new(), consumed: Default::default() };
        // KV cache scales are read apart (`Checkpoint::kv_scales`), never as weights.
        this.consumed = this
            .stored()
            .map(|(n, _)| n)
            .filter(|n| kv_scales::scale_of(n).is_some())
            .map(str::to_string)
            .collect();
        if this.files.iter().all(|f| f.raw.is_empty()) {
            return Ok(this);
        }
        let is_fp8_scale = |n: &str| {
            ["weight_scale", "weight_scale_inv", "input_scale", "k_scale", "v_scale"]
                .iter()
                .any(|s| n.strip_suffix(s).is_some_and(|p| p.is_empty() || p.ends_with('.')))
        };
        let found: HashMap<&str, TensorRef<'_>> = this.stored().collect();
        let raw: HashMap<&str, (&MappedFile, &Raw)> =
            this.files.iter().flat_map(|f| f.raw.iter().map(move |r| (r.name.as_str(), (f, r)))).collect();
        fn bytes<'f>(f: &'f MappedFile, r: &Raw) -> &'f [u8] {
            &f.mmap[f.header_len + r.range.0..f.header_len + r.range.1]
        }
        // The unquantized weights' dtype (norms, embeddings, an ignored LM head), else f32.
        let dtype = this.stored().find(|(n, _)| !is_fp8_scale(n)).map_or(DType::F32, |(_, t)| t.dtype);
        let dtype = if matches!(dtype, DType::Quant(_)) { DType::F32 } else { dtype };
        let (mut rebuilt, mut consumed) = (Vec::new(), Vec::new());
        for (f, r) in raw.values() {
            let name = &r.name;
            let fail = |e: String| ModelError::Weights(format!("{}: {e}", f.path.display()));
            let widened = |t: TensorRef| -> Vec<f32> {
                let mut values = Vec::new();
                DType::F32.convert_from(t.dtype, t.bytes, &mut values);
                bytemuck::pod_collect_to_vec(&values)
            };
            match r.dtype {
                safetensors::Dtype::F8_E4M3 => {
                    let scale = [format!("{name}_scale_inv"), format!("{name}_scale")]
                        .into_iter()
                        .find_map(|s| found.get(s.as_str()).copied())
                        .ok_or_else(|| {
                            fail(format!(
                                "FP8 tensor {name} has no {name}_scale or {name}_scale_inv beside it"
                            ))
                        })?;
                    let (rows, cols) = match &r.shape[..] {
                        [rows, rest @ ..] if !rest.is_empty() => (*rows, rest.iter().product()),
                        _ => (1, r.shape.iter().product()),
                    };
                    let scales = super::fp8::Scales::of((rows, cols), scale.shape, widened(scale))
                        .map_err(|e| fail(format!("{name}: {e}")))?;
                    let kept = match r.shape.len() {
                        2 => super::fp8::kept(bytes(f, r), (rows, cols), &scales, dtype),
                        _ => None,
                    };
                    match kept {
                        Some((format, data)) => {
                            rebuilt.push((name.clone(), DType::Rows(format), r.shape.clone(), data))
                        }
                        None => {
                            let data = super::fp8::dequantize(bytes(f, r), (rows, cols), &scales, dtype);
                            rebuilt.push((name.clone(), dtype, r.shape.clone(), data));
                        }
                    }
                }
                // Read beside the weight they belong to.
                _ if ["qzeros", "g_idx", "weight_zero_point", "weight_shape"]
                    .iter()
                    .any(|s| name.ends_with(s)) => {}
                _ if packing == Some(Packing::CompressedInt)
                    && (name.ends_with("weight_packed")
                        || name.ends_with("weight") && r.dtype == safetensors::Dtype::I8) =>
                {
                    let base = name.strip_suffix("_packed").unwrap_or(name);
                    let ints = |suffix: &str| {
                        raw.get(format!("{base}{suffix}").as_str()).map(|(f, r)| match r.dtype {
                            safetensors::Dtype::I8 => packed::Ints::Bytes(&r.shape, bytes(f, r)),
                            _ => packed::Ints::Words(&r.shape, bytes(f, r)),
                        })
                    };
                    let shape =
                        raw.get(format!("{base}_shape").as_str()).map(|(f, r)| dims(r.dtype, bytes(f, r)));
                    let shape = match shape.as_deref() {
                        None => None,
                        Some(&[out, cols]) => Some((out, cols)),
                        Some(other) => return Err(fail(format!("{base}_shape is {other:?}, not [out, in]"))),
                    };
                    let scales = *found.get(format!("{base}_scale").as_str()).ok_or_else(|| {
                        fail(format!("integer weight {name} has no {base}_scale beside it"))
                    })?;
                    let c = packed::Compressed {
                        weight: ints(if name.ends_with("_packed") { "_packed" } else { "" })
                            .expect("this tensor"),
                        shape,
                        scales: (scales.shape, widened(scales)),
                        zero_point: ints("_zero_point"),
                        g_idx: raw
                            .get(format!("{base}_g_idx").as_str())
                            .map(|(f, r)| (r.shape.as_slice(), bytes(f, r))),
                    };
                    let w = packed::unpack_compressed(&c).map_err(|e| fail(format!("{name}: {e}")))?;
                    rebuilt.push(int_weight(base.to_string(), &w, scales.dtype));
                }
                _ => {
                    let base = name
                        .strip_suffix("qweight")
                        .filter(|_| matches!(packing, Some(Packing::Gptq { .. } | Packing::Awq { .. })))
                        .ok_or_else(|| {
                            fail(format!(
                                "tensor {name} is {:?}: integer weights are read only as a GPTQ, AWQ or \
                                 compressed-tensors checkpoint's, with config.json's quantization_config naming \
                                 the method",
                                r.dtype
                            ))
                        })?;
                    let int = |suffix: &str| {
                        raw.get(format!("{base}{suffix}").as_str())
                            .map(|(f, r)| (r.shape.as_slice(), bytes(f, r)))
                    };
                    let need =
                        |what: &str| fail(format!("packed weight {name} has no {base}{what} beside it"));
                    let scales =
                        *found.get(format!("{base}scales").as_str()).ok_or_else(|| need("scales"))?;
                    let packed = packed::Packed {
                        qweight: (&r.shape, bytes(f, r)),
                        qzeros: int("qzeros").ok_or_else(|| need("qzeros"))?,
                        scales: (scales.shape, widened(scales)),
                        g_idx: int("g_idx"),
                    };
                    let packing = packing.expect("checked above");
                    let w = packing.unpack(&packed).map_err(|e| fail(format!("{name}: {e}")))?;
                    rebuilt.push(int_weight(format!("{base}weight"), &w, scales.dtype));
                    consumed.push(format!("{base}scales"));
                }
            }
        }
        consumed.extend(this.stored().map(|(n, _)| n).filter(|n| is_fp8_scale(n)).map(str::to_string));
        this.rebuilt = rebuilt;
        this.consumed.extend(consumed);
        Ok(this)
    }

    fn map_file(path: PathBuf) -> Result<MappedFile, ModelError> {
        let file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
        // SAFETY: mapped read-only; checkpoints are not modified while the engine runs.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
        Self::read_file(path, FileBytes::Mapped(mmap))
    }

    fn read_file(path: PathBuf, mmap: FileBytes) -> Result<MappedFile, ModelError> {
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&mmap)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
        let mut tensors = Vec::new();
        let data_len = mmap.len().saturating_sub(header_len + 8);
        let mut raw = Vec::new();
        for (name, info) in meta.tensors() {
            let (start, end) = info.data_offsets;
            // FP8 weights and integers wait for their scales: `Checkpoint::rebuild`.
            let (dtype, shape) = match info.dtype {
                safetensors::Dtype::F8_E4M3
                | safetensors::Dtype::I32
                | safetensors::Dtype::I8
                | safetensors::Dtype::I64 => (None, info.shape.clone()),
                _ => dtype_of(info, &name, meta.metadata().as_ref(), &path).map(|(d, s)| (Some(d), s))?,
            };
            let size = match dtype {
                None => info.dtype.size(),
                Some(DType::Quant(_)) => 1,
                Some(d) => d.size(),
            };
            let want = info
                .shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .and_then(|n| n.checked_mul(size));
            if start > end || end > data_len || want != Some(end - start) {
                return Err(ModelError::Weights(format!(
                    "{}: tensor {name} has offsets {start}..{end} for shape {:?} of {} in a data section of \
                     {data_len} bytes",
                    path.display(),
                    info.shape,
                    dtype.map_or(format!("{:?}", info.dtype), |d| format!("{d:?}"))
                )));
            }
            match dtype {
                Some(dtype) => tensors.push(Entry { name, dtype, shape, range: info.data_offsets }),
                None => raw.push(Raw { name, dtype: info.dtype, shape, range: info.data_offsets }),
            }
        }
        Ok(MappedFile { path, mmap, header_len: header_len + 8, tensors, raw })
    }

    /// Every tensor of every file: (checkpoint name, tensor).
    pub fn tensors(&self) -> impl Iterator<Item = (&str, TensorRef<'_>)> {
        let stored = self.stored().filter(|(n, _)| !self.consumed.contains(*n));
        let rebuilt = self.rebuilt.iter().map(|(n, dtype, shape, data)| {
            (n.as_str(), TensorRef { dtype: *dtype, shape: shape.as_slice(), bytes: data.as_slice() })
        });
        stored.chain(rebuilt)
    }

    /// The tensors of the files as stored (FP8 weights and int32 words aside), the scales
    /// of quantized ones included.
    fn stored(&self) -> impl Iterator<Item = (&str, TensorRef<'_>)> {
        self.files.iter().flat_map(|f| {
            f.tensors.iter().map(move |e| {
                let bytes = &f.mmap[f.header_len + e.range.0..f.header_len + e.range.1];
                (e.name.as_str(), TensorRef { dtype: e.dtype, shape: &e.shape, bytes })
            })
        })
    }

    /// The FP8 KV cache scales of a model of `layers` layers, if the checkpoint has any
    /// ([`kv_scales::read`]).
    pub fn kv_scales(&self, layers: usize) -> Result<Option<(Vec<KvScales>, usize)>, ModelError> {
        kv_scales::read(self.stored(), layers)
    }

    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }
}

/// Checkpoint tensors keyed by model parameter name; a stacked parameter holds its shards
/// by index.
pub struct WeightStore<'a> {
    params: HashMap<String, BTreeMap<usize, TensorRef<'a>>>,
    /// The dtype every weight is converted to on load.
    pub dtype: DType,
    /// `--load-format dummy`: no checkpoint; every parameter the model asks for is made of
    /// deterministic values of its kind (see [`super::random::param_bytes`]).
    dummy: bool,
    /// A dummy store of a quantized checkpoint's config: its projections are made kept
    /// packed in rows of this kind, in groups of this size (None: one a row), as the
    /// checkpoint would hold them.
    dummy_rows: Option<(RowKind, Option<usize>)>,
    /// `--quantization fp8` on a checkpoint that is not quantized: projections are
    /// quantized to FP8 as they load ([`super::fp8::quantize_rows`]).
    online_fp8: bool,
    /// Bytes of every parameter handed out so far, as loaded (blocks kept as blocks).
    served: std::sync::atomic::AtomicUsize,
}

impl<'a> WeightStore<'a> {
    /// vLLM's `load_weights`: routes each checkpoint tensor to its parameter, through the
    /// model's stacked-params table. `skip` names tensors the model does not use.
    pub fn load_weights(
        tensors: impl Iterator<Item = (&'a str, TensorRef<'a>)>,
        stacked: &[StackedParam],
        skip: impl Fn(&str) -> bool,
        dtype: DType,
    ) -> Self {
        let mut params: HashMap<String, BTreeMap<usize, TensorRef<'a>>> = HashMap::new();
        for (name, t) in tensors {
            if skip(name) {
                continue;
            }
            let routed = stacked.iter().find_map(|s| {
                let pat = format!(".{}.", s.shard);
                name.contains(&pat).then(|| (name.replacen(&pat, &format!(".{}.", s.param), 1), s.index))
            });
            let (param, index) = routed.unwrap_or_else(|| (name.to_string(), 0));
            params.entry(param).or_default().insert(index, t);
        }
        Self { params, dtype, dummy: false, dummy_rows: None, online_fp8: false, served: Default::default() }
    }

    /// A store without a checkpoint (vLLM's `--load-format dummy`): each parameter is made
    /// when the model loads it, of the shape it asks for, so that benchmarks of a model's
    /// shapes need its config.json and tokenizer only.
    pub fn dummy(dtype: DType, rows: Option<(RowKind, Option<usize>)>) -> Self {
        let dummy_rows = rows.filter(|_| matches!(dtype, DType::BF16 | DType::F16));
        Self {
            params: HashMap::new(),
            dtype,
            dummy: true,
            dummy_rows,
            online_fp8: false,
            served: Default::default(),
        }
    }

    pub fn root(&self) -> ParamView<'_, 'a> {
        ParamView { store: self, prefix: String::new() }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.dummy || self.params.contains_key(name)
    }

    /// The bytes of the parameters the model has loaded from this store: its weights as
    /// they are held (a kept GGUF block format at its own size, a tensor-parallel rank's
    /// part alone).
    pub fn served_bytes(&self) -> usize {
        self.served.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`Self::served_bytes`] in the share `part / whole` of the parameters (what one
    /// token reads of a mixture of experts).
    pub fn served_share(&self, part: usize, whole: usize) -> usize {
        (self.served_bytes() as u128 * part as u128 / whole.max(1) as u128) as usize
    }

    /// The store quantizing its projections to FP8 as they load, or not.
    pub fn with_online_fp8(self, on: bool) -> Self {
        Self { online_fp8: on, ..self }
    }

    /// Parameter `name` as the model gets it: quantized at load where `--quantization fp8`
    /// asks for it, its bytes counted.
    fn serve(&self, name: &str, t: HostTensor<'a>) -> HostTensor<'a> {
        let t = match (&t.shape[..], t.dtype) {
            (&[rows, cols], DType::F32 | DType::BF16 | DType::F16)
                if self.online_fp8 && is_projection(name) =>
            {
                let (dtype, data) = super::fp8::quantize_rows(&t.data, (rows, cols), t.dtype);
                HostTensor { dtype, shape: t.shape, data: data.into() }
            }
            _ => t,
        };
        self.served.fetch_add(t.data.len(), std::sync::atomic::Ordering::Relaxed);
        t
    }
}

/// A prefix-scoped view of the store.
pub struct ParamView<'s, 'a> {
    store: &'s WeightStore<'a>,
    prefix: String,
}

impl<'s, 'a> ParamView<'s, 'a> {
    /// Pushes one path component: `pp("model").pp(3)` → `model.3.`.
    pub fn pp(&self, part: impl std::fmt::Display) -> Self {
        Self { store: self.store, prefix: format!("{}{part}.", self.prefix) }
    }

    fn shards(&self, name: &str) -> Result<(String, &BTreeMap<usize, TensorRef<'a>>), ModelError> {
        let full = format!("{}{name}", self.prefix);
        match self.store.params.get(&full) {
            Some(s) => Ok((full, s)),
            None => Err(ModelError::MissingTensor(full)),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.store.contains(&format!("{}{name}", self.prefix))
    }

    /// A plain parameter, checked against the expected shape, in the store's dtype.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<HostTensor<'a>, ModelError> {
        self.get_part(name, shape, Part::Whole)
    }

    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// A parameter of a dummy store: `shape`'s values for `name`.
    fn made(&self, name: &str, shape: Vec<usize>) -> HostTensor<'a> {
        let full = format!("{}{name}", self.prefix);
        let projection = is_projection(&full);
        let f16 = self.store.dtype == DType::F16;
        if let (Some((kind, group)), true, &[_, k]) = (self.store.dummy_rows, projection, &shape[..])
            && let Some(format) = match kind {
                RowKind::Int4 => RowFormat::int4(k, group, f16),
                RowKind::Fp8 => RowFormat::fp8(k, group, f16),
            }
        {
            let data = super::random::rows_param_bytes(&full, &shape, format);
            return HostTensor { dtype: DType::Rows(format), shape, data: data.into() };
        }
        let data = super::random::param_bytes(&full, &shape, self.store.dtype);
        HostTensor { dtype: self.store.dtype, shape, data: data.into() }
    }

    /// A part of a parameter (this rank's shard under tensor parallelism), checked against
    /// the full expected shape, in the store's dtype.
    pub fn get_part(&self, name: &str, shape: &[usize], part: Part) -> Result<HostTensor<'a>, ModelError> {
        if self.store.dummy {
            let mut out = shape.to_vec();
            match part {
                Part::Whole => {}
                Part::Rows(r) => out[0] = r.len(),
                Part::Cols(c) => out[1] = c.len(),
            }
            return Ok(self.store.serve(&self.full(name), self.made(name, out)));
        }
        let (full, shards) = self.shards(name)?;
        let t = shards.get(&0).ok_or_else(|| ModelError::MissingTensor(full.clone()))?;
        check_tensor(&full, shape, t)?;
        Ok(self.store.serve(&full, self.convert(t, shape, part, true)))
    }

    /// A stacked parameter: the shards' rows concatenated in order. `rows[i]` is shard i's
    /// full row count (names in `shard_names` for error messages) and `picks[i]` the rows of
    /// it this rank keeps.
    pub fn get_stacked(
        &self,
        name: &str,
        shard_names: &[&str],
        rows: &[usize],
        picks: &[std::ops::Range<usize>],
        cols: Option<usize>,
    ) -> Result<HostTensor<'a>, ModelError> {
        if self.store.dummy {
            let total = picks.iter().map(|p| p.len()).sum();
            return Ok(self
                .store
                .serve(&self.full(name), self.made(name, cols.map_or(vec![total], |c| vec![total, c]))));
        }
        let (full, shards) = self.shards(name)?;
        // Blocks stay blocks when every shard is in the same format (q, k and v of one
        // GGUF file may not be); else every shard loads in the store's dtype.
        let first = shards.values().next().map(|t| t.dtype);
        let keep_blocks = shards.len() == rows.len() && shards.values().all(|t| Some(t.dtype) == first);
        let mut dtype = self.store.dtype;
        let mut data = Vec::new();
        for (i, (&r, shard)) in rows.iter().zip(shard_names).enumerate() {
            let shard_name = full.replacen(
                &format!(".{}", name.split('.').next().unwrap_or(name)),
                &format!(".{shard}"),
                1,
            );
            let t = shards.get(&i).ok_or_else(|| ModelError::MissingTensor(shard_name.clone()))?;
            let want: Vec<usize> = match cols {
                Some(c) => vec![r, c],
                None => vec![r],
            };
            check_tensor(&shard_name, &want, t)?;
            let part = self.convert(t, &want, Part::Rows(picks[i].clone()), keep_blocks);
            dtype = part.dtype;
            data.extend_from_slice(&part.data);
        }
        let total: usize = picks.iter().map(|p| p.len()).sum();
        let shape = match cols {
            Some(c) => vec![total, c],
            None => vec![total],
        };
        Ok(self.store.serve(&full, HostTensor { dtype, shape, data: data.into() }))
    }

    /// Rows `picks` of one parameter of `shape`, concatenated in order (a fused
    /// checkpoint tensor's parts that this rank keeps).
    pub fn get_rows(
        &self,
        name: &str,
        shape: &[usize],
        picks: &[std::ops::Range<usize>],
    ) -> Result<HostTensor<'a>, ModelError> {
        if self.store.dummy {
            let mut out = shape.to_vec();
            out[0] = picks.iter().map(|p| p.len()).sum();
            return Ok(self.store.serve(&self.full(name), self.made(name, out)));
        }
        let (full, shards) = self.shards(name)?;
        let t = shards.get(&0).ok_or_else(|| ModelError::MissingTensor(full.clone()))?;
        check_tensor(&full, shape, t)?;
        let (mut data, mut dtype) = (Vec::new(), self.store.dtype);
        for p in picks {
            let part = self.convert(t, shape, Part::Rows(p.clone()), true);
            dtype = part.dtype;
            data.extend_from_slice(&part.data);
        }
        let mut out_shape = shape.to_vec();
        out_shape[0] = picks.iter().map(|p| p.len()).sum();
        Ok(self.store.serve(&full, HostTensor { dtype, shape: out_shape, data: data.into() }))
    }

    /// `part` of a checked tensor of `shape`: borrowed from the mapped file when it is whole
    /// rows already in the dtype it loads in, else converted. It loads in the store's dtype,
    /// except that blocks stay blocks with `keep_blocks` where the part is whole blocks.
    fn convert(&self, t: &TensorRef<'a>, shape: &[usize], part: Part, keep_blocks: bool) -> HostTensor<'a> {
        let whole_blocks = match (&part, t.dtype) {
            (Part::Cols(c), DType::Quant(f)) => {
                c.start.is_multiple_of(f.block_elems()) && c.end.is_multiple_of(f.block_elems())
            }
            // A row's groups and values lie apart: a part of its columns is widened.
            (Part::Cols(_), DType::Rows(_)) => false,
            _ => true,
        };
        let dtype = match t.dtype {
            DType::Quant(_) if keep_blocks && whole_blocks => t.dtype,
            // Kept where the model is served in the scales' type, which the values widen
            // to exactly.
            DType::Rows(_) if keep_blocks && whole_blocks && t.dtype.widened() == self.store.dtype => t.dtype,
            _ => self.store.dtype,
        };
        let row_len: usize = shape[1..].iter().product();
        let row_bytes = t.dtype.row_bytes(row_len);
        let mut out_shape = shape.to_vec();
        let bytes: &'a [u8] = match &part {
            Part::Whole => t.bytes,
            Part::Rows(r) => {
                out_shape[0] = r.len();
                &t.bytes[r.start * row_bytes..r.end * row_bytes]
            }
            Part::Cols(c) => {
                let mut data = Vec::new();
                for row in t.bytes.chunks_exact(row_bytes) {
                    match (t.dtype, dtype == t.dtype) {
                        (_, true) => {
                            data.extend_from_slice(&row[t.dtype.row_bytes(c.start)..t.dtype.row_bytes(c.end)])
                        }
                        // Columns inside blocks: the whole row dequantized, then cut.
                        (DType::Quant(_) | DType::Rows(_), false) => {
                            let mut f32s = Vec::new();
                            DType::F32.convert_from(t.dtype, row, &mut f32s);
                            dtype.convert_from(DType::F32, &f32s[c.start * 4..c.end * 4], &mut data);
                        }
                        (src, false) => {
                            dtype.convert_from(src, &row[c.start * src.size()..c.end * src.size()], &mut data)
                        }
                    }
                }
                return HostTensor { dtype, shape: vec![shape[0], c.len()], data: data.into() };
            }
        };
        let data = match t.dtype == dtype {
            true => std::borrow::Cow::Borrowed(bytes),
            false => {
                let mut data = Vec::new();
                dtype.convert_from(t.dtype, bytes, &mut data);
                data.into()
            }
        };
        HostTensor { dtype, shape: out_shape, data }
    }
}

/// A rebuilt integer weight named `name`: kept as 4-bit rows where the kernels take its
/// layout and its scales are 16-bit, else its values in the scales' dtype.
fn int_weight(name: String, w: &packed::IntWeight, scales: DType) -> (String, DType, Vec<usize>, Vec<u8>) {
    let shape = vec![w.out, w.cols];
    let half = match scales {
        DType::BF16 => Some(false),
        DType::F16 => Some(true),
        _ => None,
    };
    match half.and_then(|f16| w.int4(f16)) {
        Some((format, bytes)) => (name, DType::Rows(format), shape, bytes),
        None => (name, scales, shape, scales.encode_f32(&w.values())),
    }
}

/// Whether parameter `name` is a decoder layer's projection: what quantized checkpoints
/// quantize (and `--quantization fp8` at load), embeddings, norms, routers and the LM head
/// aside.
fn is_projection(name: &str) -> bool {
    name.contains(".layers.") && name.ends_with("proj.weight")
}

/// Which part of a parameter a rank loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Whole,
    /// Rows (dim 0) `start..end`: column-parallel layers and the vocabulary shards.
    Rows(std::ops::Range<usize>),
    /// Columns (dim 1) `start..end` of a 2-D weight: row-parallel layers.
    Cols(std::ops::Range<usize>),
}

/// The tensor's shape is `expected` and every value is finite (NaN or infinite weights are
/// refused at load, not found in the outputs).
fn check_tensor(name: &str, expected: &[usize], t: &TensorRef) -> Result<(), ModelError> {
    check_shape(name, expected, t.shape)?;
    let bad = match t.dtype {
        DType::F32 => t.bytes.chunks_exact(4).position(|b| b[3] & 0x7f == 0x7f && b[2] & 0x80 != 0),
        DType::BF16 => t.bytes.chunks_exact(2).position(|b| b[1] & 0x7f == 0x7f && b[0] & 0x80 != 0),
        DType::F16 => t.bytes.chunks_exact(2).position(|b| b[1] & 0x7c == 0x7c),
        DType::Quant(f) => f.bad_scale(t.bytes).map(|b| b * f.block_elems()),
        DType::Rows(f) => f.bad_value(t.bytes),
    };
    match bad {
        Some(i) => {
            Err(ModelError::Weights(format!("tensor {name} holds a NaN or infinite value at index {i}")))
        }
        None => Ok(()),
    }
}

fn check_shape(name: &str, expected: &[usize], got: &[usize]) -> Result<(), ModelError> {
    if expected != got {
        return Err(ModelError::Shape {
            name: name.to_string(),
            expected: expected.to_vec(),
            got: got.to_vec(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of one U8 tensor `w` of `shape`, marked as `format` blocks when
    /// given.
    fn file(shape: [usize; 2], format: Option<&str>, bytes: &[u8]) -> Result<Checkpoint, ModelError> {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::U8, shape.to_vec(), bytes).unwrap();
        let meta = format.map(|f| HashMap::from([(quant_key("w"), f.to_string())]));
        let data = safetensors::tensor::serialize([("w", view)], &meta).unwrap();
        Checkpoint::from_bytes("test.safetensors", data)
    }

    /// Blocks are read by the format the metadata names, in elements; rows split at block
    /// boundaries stay blocks, and rows split inside a block are dequantized.
    #[test]
    fn marked_byte_tensors_load_as_blocks_and_split_by_whole_blocks() {
        let values: Vec<f32> = (0..2 * 64).map(|i| (i as f32 - 60.0) / 16.0).collect();
        let blocks = QuantFormat::Q4_1.quantize(&values);
        let c = file([2, 40], Some("Q4_1"), &blocks).unwrap();
        let (_, t) = c.tensors().next().unwrap();
        assert_eq!((t.dtype, t.shape), (DType::Quant(QuantFormat::Q4_1), &[2, 64][..]));

        let store = WeightStore::load_weights(c.tensors(), &[], |_| false, DType::F32);
        let whole = store.root().get_part("w", &[2, 64], Part::Cols(32..64)).unwrap();
        assert_eq!((whole.dtype, whole.shape.clone()), (DType::Quant(QuantFormat::Q4_1), vec![2, 32]));
        assert_eq!(&whole.data[..], [&blocks[20..40], &blocks[60..80]].concat());
        let inside = store.root().get_part("w", &[2, 64], Part::Cols(16..48)).unwrap();
        assert_eq!((inside.dtype, inside.shape.clone()), (DType::F32, vec![2, 32]));
        let mut dense = Vec::new();
        QuantFormat::Q4_1.dequantize(&blocks, &mut dense);
        let got: Vec<f32> = bytemuck::pod_collect_to_vec(&inside.data);
        assert_eq!(got, [&dense[16..48], &dense[80..112]].concat());

        let refused = |r: Result<Checkpoint, ModelError>| r.err().expect("refused").to_string();
        assert!(refused(file([2, 40], Some("Q9_9"), &blocks)).contains("unknown format Q9_9"));
        assert!(refused(file([4, 20], None, &blocks)).contains("has dtype U8"));
        let e = refused(file([5, 16], Some("Q4_1"), &blocks));
        assert!(e.contains("rows of 16 bytes, not whole blocks of 20"), "{e}");
    }
}
