//! GGUF reader: header, metadata and tensor table of a llama.cpp model file, plus exact
//! dequantization of its block formats: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
//! (32-element blocks), and the K-quants Q4_K, Q5_K and Q6_K (256-element super-blocks).
//! llama.cpp's `Q4_K_M`, `Q5_K_M` and `Q6_K` files hold K-quants, with Q5_0, Q5_1 or Q8_0
//! for tensors whose rows are not a multiple of 256.
//!
//! Format (little endian): magic `GGUF`, version (2 or 3), tensor count, metadata count,
//! metadata key/values, tensor infos (name, dims innermost-first, ggml type, offset), then the
//! data section at `general.alignment` (default 32). Every length and offset is checked
//! against the file size before use, so a truncated or malformed file is an error, never a
//! panic or a huge allocation.

pub mod import;
mod tokenizer;

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use memmap2::Mmap;

use crate::kernels::quant::QuantFormat;
use crate::mapped::FileBytes;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a GGUF file (magic {0:#010x}, expected 0x46554747 \"GGUF\")")]
    BadMagic(u32),
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    BadVersion(u32),
    #[error("GGUF file is truncated: {what} needs bytes up to {need} but the file has {have}")]
    Truncated { what: String, need: u64, have: u64 },
    #[error("malformed GGUF: {0}")]
    Malformed(String),
    #[error(
        "tensor {name}: ggml type {ty} is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)"
    )]
    UnsupportedType { name: String, ty: u32 },
    #[error("missing metadata key {0}")]
    MissingKey(String),
}

/// A metadata value as stored in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Elements of a K-quant super-block.
const QK_K: u64 = 256;

/// ggml tensor types this reader can dequantize, named as ggml names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
    BF16,
}

impl GgmlType {
    fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            30 => Self::BF16,
            _ => return None,
        })
    }
    /// The format `--keep-quantized` keeps this type in, if it keeps it.
    pub fn kept(self) -> Option<QuantFormat> {
        match self {
            Self::Q4_0 => Some(QuantFormat::Q4_0),
            Self::Q4_1 => Some(QuantFormat::Q4_1),
            Self::Q5_0 => Some(QuantFormat::Q5_0),
            Self::Q5_1 => Some(QuantFormat::Q5_1),
            Self::Q8_0 => Some(QuantFormat::Q8_0),
            Self::Q4_K => Some(QuantFormat::Q4_K),
            Self::Q5_K => Some(QuantFormat::Q5_K),
            Self::Q6_K => Some(QuantFormat::Q6_K),
            _ => None,
        }
    }
    /// (elements per block, bytes per block)
    fn block(self) -> (u64, u64) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q4_K => (QK_K, 144),
            Self::Q5_K => (QK_K, 176),
            Self::Q6_K => (QK_K, 210),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions innermost first, as ggml stores them (`[in, out]` for a linear weight).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub start: u64,
    pub nbytes: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Row-major shape as PyTorch / safetensors see it (outermost first).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

pub struct GgufFile {
    mmap: FileBytes,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
}

/// Bounds-checked little-endian cursor over the mapped file.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let end = (self.pos as u64)
            .checked_add(n)
            .ok_or_else(|| GgufError::Malformed(format!("{what}: length {n} overflows")))?;
        if end > self.buf.len() as u64 {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                need: end,
                have: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| GgufError::Malformed(format!("{what}: string is not UTF-8")))
    }
    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.arr::<1>(what)?[0]),
            1 => Value::I8(self.arr::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.arr(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.arr(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.arr(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.arr(what)?)),
            7 => Value::Bool(self.arr::<1>(what)?[0] != 0),
            8 => Value::Str(self.string(what)?),
            9 => {
                if depth > 4 {
                    return Err(GgufError::Malformed(format!("{what}: arrays nested too deep")));
                }
                let inner = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the remaining bytes
                // is a corrupt file, refused before any allocation.
                let left = (self.buf.len() - self.pos) as u64;
                if n > left {
                    return Err(GgufError::Truncated {
                        what: format!("{what} ({n} array elements)"),
                        need: self.pos as u64 + n,
                        have: self.buf.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(inner, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.arr(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.arr(what)?)),
            other => {
                return Err(GgufError::Malformed(format!("{what}: unknown value type {other}")));
            }
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the file is opened read-only and not modified while mapped by this process.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(FileBytes::Mapped(mmap))
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(FileBytes::Owned(bytes))
    }

    fn parse(mmap: FileBytes) -> Result<Self, GgufError> {
        let file_len = mmap.len() as u64;
        let mut c = Cursor { buf: &mmap, pos: 0 };
        let magic = c.u32("magic")?;
        if magic != 0x4655_4747 {
            return Err(GgufError::BadMagic(magic));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::BadVersion(version));
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        if n_tensors > file_len || n_kv > file_len {
            return Err(GgufError::Malformed(format!(
                "header claims {n_tensors} tensors and {n_kv} metadata entries in a {file_len}-byte file"
            )));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&key)?;
            let v = c.value(ty, &key, 0)?;
            metadata.insert(key, v);
        }
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(GgufError::Malformed(format!("tensor {name}: {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let ty_raw = c.u32(&name)?;
            let ty = GgmlType::from_u32(ty_raw)
                .ok_or_else(|| GgufError::UnsupportedType { name: name.clone(), ty: ty_raw })?;
            let offset = c.u64(&name)?;
            raw.push((name, dims, ty, offset));
        }
        let align = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32);
        if align == 0 || !align.is_power_of_two() {
            return Err(GgufError::Malformed(format!("general.alignment {align}")));
        }
        let data_start = (c.pos as u64).div_ceil(align) * align;
        let mut tensors: Vec<TensorInfo> = Vec::with_capacity(raw.len());
        let mut names = std::collections::HashSet::new();
        for (name, dims, ty, offset) in raw {
            if !names.insert(name.clone()) {
                return Err(GgufError::Malformed(format!("tensor {name} is listed twice")));
            }
            let numel = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| GgufError::Malformed(format!("tensor {name}: size overflows")))?;
            let (per_block, block_bytes) = ty.block();
            if numel % per_block != 0 {
                return Err(GgufError::Malformed(format!(
                    "tensor {name}: {numel} elements is not a multiple of the {per_block}-element block"
                )));
            }
            let nbytes = (numel / per_block)
                .checked_mul(block_bytes)
                .ok_or_else(|| GgufError::Malformed(format!("tensor {name}: size overflows")))?;
            let start = data_start.checked_add(offset);
            if start.and_then(|s| s.checked_add(nbytes)).is_none_or(|end| end > file_len) {
                return Err(GgufError::Truncated {
                    what: format!("tensor {name}"),
                    need: data_start.saturating_add(offset).saturating_add(nbytes),
                    have: file_len,
                });
            }
            let start = start.unwrap_or_default();
            tensors.push(TensorInfo { name, dims, ty, start, nbytes });
        }
        // Each tensor's bytes are its own: none runs into the next.
        let mut spans: Vec<(u64, u64, &str)> =
            tensors.iter().map(|t| (t.start, t.nbytes, t.name.as_str())).collect();
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(GgufError::Malformed(format!(
                "tensor {} ({} bytes at {}) overlaps tensor {} at {}",
                w[0].2, w[0].1, w[0].0, w[1].2, w[1].0
            )));
        }
        Ok(Self { mmap, version, metadata, tensors })
    }

    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get(key)?.as_u64().ok_or_else(|| GgufError::Malformed(format!("{key} is not an integer")))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.get(key)?.as_f64().ok_or_else(|| GgufError::Malformed(format!("{key} is not a number")))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get(key)?.as_str().ok_or_else(|| GgufError::Malformed(format!("{key} is not a string")))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor's bytes as the file stores them.
    pub fn raw(&self, t: &TensorInfo) -> &[u8] {
        &self.mmap[t.start as usize..(t.start + t.nbytes) as usize]
    }

    /// Dequantizes a tensor into f32, row-major in the file's own element order.
    pub fn dequantize(&self, t: &TensorInfo) -> Vec<f32> {
        dequantize(t.ty, self.raw(t), t.numel() as usize)
    }
}

/// Exact dequantization of `numel` elements stored as `ty`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], numel: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(numel);
    let h = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    match ty {
        GgmlType::F32 => {
            out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        }
        GgmlType::F16 => out.extend(bytes.chunks_exact(2).map(|b| h(b, 0))),
        GgmlType::BF16 => {
            out.extend(bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()))
        }
        // Formats `--keep-quantized` keeps, defined beside their CPU kernels.
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            if let Some(f) = ty.kept() {
                f.dequantize(bytes, &mut out)
            }
        }
        GgmlType::Q4_K => QuantFormat::Q4_K.dequantize(bytes, &mut out),
        GgmlType::Q5_K => QuantFormat::Q5_K.dequantize(bytes, &mut out),
        GgmlType::Q6_K => QuantFormat::Q6_K.dequantize(bytes, &mut out),
    }
    out
}

#[cfg(test)]
mod tests;
