//! Norm layers: RMSNorm (Llama's `w · x/rms`, or Gemma's `(1 + w) · x/rms`) and LayerNorm
//! with an optional bias (OPT), behind [`Norm`], whose `forward_residual` adds the residual
//! first as vLLM's `norm(x, residual)` does. A device may fuse the add and the RMSNorm into
//! the projection before it; that choice is the layers', never a model's.

use std::borrow::Cow;

use crate::kernels::{DType, DevResult, Device, HostTensor};
use crate::models::ModelError;
use crate::models::loader::ParamView;

pub struct RMSNorm<D: Device> {
    pub weight: D::Weight,
    pub eps: f32,
}

impl<D: Device> RMSNorm<D> {
    pub fn load(dev: &D, w: &ParamView, size: usize, eps: f32) -> Result<Self, ModelError> {
        check_eps(eps)?;
        Ok(Self { weight: dev.upload(w.get("weight", &[size])?)?, eps })
    }
    /// Gemma's RMSNorm, `(1 + w) · x/rms` in f32: the weight is kept as `1 + w`, added in
    /// f32 as transformers adds it, so that the norm is Llama's of that weight.
    pub fn load_offset(dev: &D, w: &ParamView, size: usize, eps: f32) -> Result<Self, ModelError> {
        check_eps(eps)?;
        let t = w.get("weight", &[size])?;
        let mut f32s = Vec::new();
        DType::F32.convert_from(t.dtype, &t.data, &mut f32s);
        let plus_one: Vec<u8> =
            bytemuck::cast_slice::<u8, f32>(&f32s).iter().flat_map(|v| (1.0 + v).to_le_bytes()).collect();
        let t = HostTensor { dtype: DType::F32, shape: vec![size], data: Cow::Owned(plus_one) };
        Ok(Self { weight: dev.upload(t)?, eps })
    }
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> DevResult<D::Tensor> {
        dev.rms_norm(x, &self.weight, self.eps)
    }
    /// `residual += x`, then the norm of the sum.
    pub fn forward_residual(&self, dev: &D, x: &D::Tensor, residual: &mut D::Tensor) -> DevResult<D::Tensor> {
        dev.add_rms_norm(x, residual, &self.weight, self.eps)
    }
    /// `forward` (or `forward_residual` with `residual`) for a projection's input: with
    /// `gemm_only` (the projection applies no adapters), [`Device::rms_norm_for_gemm`].
    pub fn forward_to_proj(
        &self,
        dev: &D,
        x: &D::Tensor,
        residual: Option<&mut D::Tensor>,
        gemm_only: bool,
    ) -> DevResult<D::Tensor> {
        match (gemm_only, residual) {
            (true, residual) => dev.rms_norm_for_gemm(x, residual, &self.weight, self.eps),
            (false, Some(r)) => self.forward_residual(dev, x, r),
            (false, None) => self.forward(dev, x),
        }
    }
}

pub struct LayerNorm<D: Device> {
    pub weight: D::Weight,
    pub bias: Option<D::Weight>,
    pub eps: f32,
}

impl<D: Device> LayerNorm<D> {
    pub fn load(dev: &D, w: &ParamView, size: usize, eps: f32, bias: bool) -> Result<Self, ModelError> {
        check_eps(eps)?;
        let bias = match bias {
            true => Some(dev.upload(w.get("bias", &[size])?)?),
            false => None,
        };
        Ok(Self { weight: dev.upload(w.get("weight", &[size])?)?, bias, eps })
    }
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> DevResult<D::Tensor> {
        dev.layer_norm(x, &self.weight, self.bias.as_ref(), self.eps)
    }
}

/// A decoder's norm of either kind.
pub enum Norm<D: Device> {
    Rms(RMSNorm<D>),
    Layer(LayerNorm<D>),
}

impl<D: Device> Norm<D> {
    pub fn forward(&self, dev: &D, x: &D::Tensor) -> DevResult<D::Tensor> {
        match self {
            Norm::Rms(n) => n.forward(dev, x),
            Norm::Layer(n) => n.forward(dev, x),
        }
    }
    /// `residual += pre(x)`, then this norm of the sum: a block's output normed before it
    /// joins the residual (Gemma 2), in one device operation where both are RMSNorms.
    pub fn forward_normed_residual(
        &self,
        dev: &D,
        x: &D::Tensor,
        pre: &Norm<D>,
        residual: &mut D::Tensor,
    ) -> DevResult<D::Tensor> {
        match (pre, self) {
            (Norm::Rms(p), Norm::Rms(n)) => {
                dev.rms_norm_add_rms_norm(x, (&p.weight, p.eps), residual, (&n.weight, n.eps))
            }
            _ => {
                let normed = pre.forward(dev, x)?;
                self.forward_residual(dev, &normed, residual)
            }
        }
    }
    /// `residual += x`, then the norm of the sum.
    pub fn forward_residual(&self, dev: &D, x: &D::Tensor, residual: &mut D::Tensor) -> DevResult<D::Tensor> {
        match self {
            Norm::Rms(n) => n.forward_residual(dev, x, residual),
            Norm::Layer(n) => {
                dev.add_inplace(residual, x)?;
                n.forward(dev, residual)
            }
        }
    }
    /// [`RMSNorm::forward_to_proj`]; a LayerNorm's output is always kept whole.
    pub fn forward_to_proj(
        &self,
        dev: &D,
        x: &D::Tensor,
        residual: Option<&mut D::Tensor>,
        gemm_only: bool,
    ) -> DevResult<D::Tensor> {
        match (self, residual) {
            (Norm::Rms(n), residual) => n.forward_to_proj(dev, x, residual, gemm_only),
            (Norm::Layer(_), Some(r)) => self.forward_residual(dev, x, r),
            (Norm::Layer(n), None) => n.forward(dev, x),
        }
    }
}

impl<D: Device> From<RMSNorm<D>> for Norm<D> {
    fn from(n: RMSNorm<D>) -> Self {
        Norm::Rms(n)
    }
}

impl<D: Device> From<LayerNorm<D>> for Norm<D> {
    fn from(n: LayerNorm<D>) -> Self {
        Norm::Layer(n)
    }
}

/// A norm's epsilon must be a positive number (zero divides by zero on a zero row).
fn check_eps(eps: f32) -> Result<(), ModelError> {
    match eps.is_finite() && eps > 0.0 {
        true => Ok(()),
        false => Err(ModelError::Config(format!(
            "config.json: the norm epsilon (rms_norm_eps / layer_norm_eps) is {eps}; it must be a positive number"
        ))),
    }
}
