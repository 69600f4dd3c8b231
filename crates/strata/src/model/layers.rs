//! Functional building blocks shared by the reference models. Each takes its parameters
//! as tensors, so units stay plain data and the engine decides where weights live.
use crate::Result;
use tch::Tensor;

/// `x @ w.T + b` with PyTorch's `[out, in]` weight layout.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    Ok(x.f_linear(w, b)?)
}

pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let dim = *x.size().last().unwrap_or(&1);
    Ok(x.f_layer_norm([dim], Some(w), Some(b), eps, true)?)
}

pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dim = *x.size().last().unwrap_or(&1);
    Ok(x.f_rms_norm([dim], Some(w), eps)?)
}

/// Causal multi-head attention over `[B, H, T, D]` queries, keys and values.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    Ok(Tensor::f_scaled_dot_product_attention(q, k, v, None::<&Tensor>, 0.0, true, None, false)?)
}

/// `[B, T, H*D]` -> `[B, H, T, D]`.
pub fn split_heads(x: &Tensor, heads: i64) -> Result<Tensor> {
    let (b, t, c) = x.size3()?;
    Ok(x.f_view([b, t, heads, c / heads])?.f_transpose(1, 2)?)
}

/// `[B, H, T, D]` -> `[B, T, H*D]`.
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.size4()?;
    Ok(x.f_transpose(1, 2)?.f_contiguous()?.f_view([b, t, h * d])?)
}

/// Mean cross-entropy of `[B, T, V]` logits against `[B, T]` targets.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let v = *logits.size().last().unwrap_or(&1);
    Ok(logits.f_reshape([-1, v])?.f_cross_entropy_loss::<&Tensor>(
        &targets.f_reshape([-1])?,
        None,
        tch::Reduction::Mean,
        -100,
        0.0,
    )?)
}
