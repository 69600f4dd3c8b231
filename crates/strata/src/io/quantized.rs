//! Quantized weights as released folders hold them, read back into the floats they encode.
//!
//! Two schemes, each a pair of tensors per quantized weight, which may lie in different files
//! and come in either order:
//! - gpt-oss's MXFP4 expert stacks (the OCP microscaling format): `L.mlp.experts.gate_up_proj_blocks`
//!   `[E, 2F, D/32, 16]` bytes, two 4-bit E2M1 codes each (low nibble first), and
//!   `L.mlp.experts.gate_up_proj_scales` `[E, 2F, D/32]`, one E8M0 exponent (biased by 127)
//!   per 32 values; `down_proj` alike `[E, D, F/32, 16]`. A pair is the output-major stack,
//!   transposed here to the stack's input-major layout (`stacked` takes it apart).
//! - Fine-grained fp8 (DeepSeek-V3's, Qwen3's, MiniMax-M2's and GLM's fp8 releases):
//!   `X` in E4M3 (or E5M2) `[.., R, C]` beside `X_scale_inv` `[.., ⌈R/b₀⌉, ⌈C/b₁⌉]`, the factor
//!   that restores each `b₀ × b₁` tile (the tiles at the far edges cut short; a grid that
//!   divides the values evenly into other tiles, as stacked experts' may, is taken as it is),
//!   in float32, bfloat16 or as E8M0 exponents stored as bytes; one scale where the whole
//!   tensor shares it.
//!
//! Both decode exactly into fp32 (a code's value times its scale); a static fp8 scheme's
//! `activation_scale`s are left out. Owns the decoding alone:
//! which names are parameters is the folder's business.
use super::stacked::is_stacked;
use crate::model::hf::Quantization;
use crate::{Error, Result};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// The values of the 16 E2M1 codes.
const FP4_VALUES: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// E8M0 exponent bytes as the powers of two they stand for.
fn powers_of_two(exponents: &Tensor) -> Result<Tensor> {
    Ok(exponents.f_to_kind(Kind::Float)?.f_sub_scalar(127.0)?.f_exp2()?)
}

/// MXFP4 blocks `[E, R, G, 16]` (bytes) and scales `[E, R, G]` as the `[E, G·32, R]` fp32
/// tensor they encode.
fn dequantize_mxfp4(name: &str, blocks: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let (b, s) = (blocks.size(), scales.size());
    if b.len() != 4 || b[..3] != s[..] || blocks.kind() != Kind::Uint8 || scales.kind() != Kind::Uint8 {
        return Err(Error::Model(format!(
            "{name}: MXFP4 blocks {b:?} and scales {s:?} (bytes, blocks one dimension more) do not fit"
        )));
    }
    let lut = Tensor::f_from_slice(&FP4_VALUES)?.f_to_device(blocks.device())?;
    let bytes = blocks.f_to_kind(Kind::Int64)?;
    let value = |codes: Tensor| -> Result<Tensor> {
        Ok(lut.f_index_select(0, &codes.f_reshape([-1])?)?.f_reshape(b.as_slice())?)
    };
    let low = value(bytes.f_remainder(16)?)?;
    let high = value(bytes.f_floor_divide_scalar(16)?)?;
    // Low nibble first: values 2j and 2j + 1 of each block.
    let values = Tensor::f_stack(&[low, high], -1)?.f_reshape([b[0], b[1], b[2], 2 * b[3]])?;
    let powers = powers_of_two(scales)?.f_unsqueeze(-1)?;
    Ok(values.f_mul(&powers)?.f_reshape([b[0], b[1], b[2] * 2 * b[3]])?.f_transpose(1, 2)?.f_contiguous()?)
}

/// Fine-grained fp8 `values` `[.., R, C]` and their `scales` (one per tile of `block`, or
/// one in all) as the fp32 tensor they encode. Without a block, the tiles are what divides
/// the values evenly by the scales.
fn dequantize_fp8(name: &str, values: &Tensor, scales: &Tensor, block: Option<[i64; 2]>) -> Result<Tensor> {
    let (v, s) = (values.size(), scales.size());
    let bad = |why: &str| Error::Model(format!("{name}: fp8 values {v:?} and scales {s:?} do not fit ({why})"));
    let scales = match scales.kind() {
        Kind::Uint8 => powers_of_two(scales)?,
        Kind::Float | Kind::BFloat16 | Kind::Half => scales.f_to_kind(Kind::Float)?,
        other => return Err(bad(&format!("scales of kind {other:?}"))),
    };
    let values = values.f_to_kind(Kind::Float)?;
    if scales.numel() == 1 {
        return Ok(values.f_mul(&scales.f_reshape([])?)?);
    }
    let n = v.len();
    if n < 2 || s.len() != n || v[..n - 2] != s[..n - 2] {
        return Err(bad("a scale grid over the last two dimensions"));
    }
    let (rows, cols, grid_rows, grid_cols) = (v[n - 2], v[n - 1], s[n - 2], s[n - 1]);
    // The block's tiles, the far edges cut short; else (no block, or stacked experts' scales,
    // which keep at least two rows where the block would give one) what divides the values
    // evenly.
    let fits = |[r, c]: [i64; 2]| (rows + r - 1) / r == grid_rows && (cols + c - 1) / c == grid_cols;
    let evenly = (rows % grid_rows == 0 && cols % grid_cols == 0).then_some([rows / grid_rows, cols / grid_cols]);
    let [tile_rows, tile_cols] = match (block.filter(|b| fits(*b)), evenly, block) {
        (Some(tiles), _, _) | (None, Some(tiles), _) => tiles,
        (None, None, Some([r, c])) => return Err(bad(&format!("tiles of {r} × {c}"))),
        (None, None, None) => return Err(bad("no weight_block_size, and the grid does not divide the values")),
    };
    let (row_dim, col_dim) = (n as i64 - 2, n as i64 - 1);
    let spread = scales
        .f_repeat_interleave_self_int(tile_rows, row_dim, None)?
        .f_narrow(row_dim, 0, rows)?
        .f_repeat_interleave_self_int(tile_cols, col_dim, None)?
        .f_narrow(col_dim, 0, cols)?;
    Ok(values.f_mul(&spread)?)
}

/// Which half of a quantized pair a tensor is.
#[derive(Clone, Copy, PartialEq)]
enum Half {
    Values,
    Scales,
}

/// Takes a folder's tensors as they are read and passes each on as floats: a quantized
/// pair, once both halves are in, dequantized under the name of the tensor it stands for;
/// any other tensor as it is.
pub(super) struct Dequantizer {
    scheme: Option<Quantization>,
    /// The kind dequantized tensors are passed on in.
    kind: Kind,
    /// Halves read so far whose partners have not come, by the name they stand for.
    waiting: HashMap<String, (Half, Tensor)>,
}

impl Dequantizer {
    /// A dequantizer of the folder's `scheme` (`None`: its weights are floats), passing
    /// dequantized tensors on in `kind` (the parameters', so a large model's weights are not
    /// all held in fp32 on their way in).
    pub(super) fn new(scheme: Option<Quantization>, kind: Kind) -> Dequantizer {
        Dequantizer { scheme, kind, waiting: HashMap::new() }
    }

    /// The half of a pair `name` is, and the name of the tensor the pair stands for; `None`
    /// where it is no half.
    fn half<'a>(&self, name: &'a str, t: &Tensor) -> Result<Option<(&'a str, Half)>> {
        let fp8 = matches!(t.kind(), Kind::Float8e4m3fn | Kind::Float8e5m2);
        Ok(match self.scheme {
            Some(Quantization::Mxfp4) => match (name.strip_suffix("_blocks"), name.strip_suffix("_scales")) {
                (Some(stack), _) if is_stacked(stack) => Some((stack, Half::Values)),
                (_, Some(stack)) if is_stacked(stack) => Some((stack, Half::Scales)),
                _ => None,
            },
            Some(Quantization::Fp8 { .. }) => match name.strip_suffix("_scale_inv") {
                Some(weight) => Some((weight, Half::Scales)),
                None => fp8.then_some((name, Half::Values)),
            },
            None if fp8 => {
                return Err(Error::Model(format!(
                    "{name}: fp8 values, where config.json names no quantization_config to restore them"
                )))
            }
            None => None,
        })
    }

    /// `Some((name, tensor))` to pass on; `None` while `t` waits for the other half of its
    /// pair, or where floats have no use for it.
    pub(super) fn take(&mut self, name: String, t: Tensor) -> Result<Option<(String, Tensor)>> {
        // Static fp8 activation scales quantize a product's inputs; floats need none.
        if matches!(self.scheme, Some(Quantization::Fp8 { .. })) && name.ends_with("activation_scale") {
            return Ok(None);
        }
        let Some((stands_for, half)) = self.half(&name, &t)? else { return Ok(Some((name, t))) };
        let partner = match self.waiting.remove(stands_for) {
            Some((other, partner)) if other != half => partner,
            Some(_) => return Err(Error::Model(format!("{stands_for}: stored twice"))),
            None => {
                self.waiting.insert(stands_for.to_string(), (half, t));
                return Ok(None);
            }
        };
        let (values, scales) = match half {
            Half::Values => (&t, &partner),
            Half::Scales => (&partner, &t),
        };
        let floats = match self.scheme {
            Some(Quantization::Fp8 { block }) => dequantize_fp8(stands_for, values, scales, block)?,
            _ => dequantize_mxfp4(stands_for, values, scales)?,
        };
        Ok(Some((stands_for.to_string(), floats.f_to_kind(self.kind)?)))
    }

    /// Fails naming a tensor whose other half never came.
    pub(super) fn finish(self) -> Result<()> {
        match self.waiting.iter().next() {
            Some((name, (Half::Values, _))) => {
                Err(Error::Model(format!("{name}: quantized values without their scales")))
            }
            Some((name, (Half::Scales, _))) => Err(Error::Model(format!(
                "{name}: scales without quantized values to restore (none stored, or not fp8)"
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp8(values: &Tensor) -> Tensor {
        values.to_kind(Kind::Float8e4m3fn)
    }

    /// Each value times the scale of its tile, the tiles at the far edges cut short,
    /// whichever way the scales are stored.
    #[test]
    fn fp8_tiles_restore_each_value_by_its_own_scale() {
        // Small integers: exact in E4M3.
        let values = Tensor::arange(35, (Kind::Float, tch::Device::Cpu)).remainder(9).view([5, 7]) - 4.0;
        // The values, each times the scale of its 4 × 4 tile in `table`.
        let tiled = |table: [[f32; 2]; 2]| {
            let scaled: Vec<f32> = (0..35).map(|k| ((k % 9) as f32 - 4.0) * table[k / 7 / 4][k % 7 / 4]).collect();
            Tensor::from_slice(&scaled).view([5, 7])
        };
        let expected = tiled([[2.0, 3.0], [5.0, 0.5]]);
        let floats = Tensor::from_slice(&[2.0f32, 3.0, 5.0, 0.5]).view([2, 2]);
        let exponents = Tensor::from_slice(&[128u8, 128 + 1, 128 + 1, 126]).view([2, 2]);
        let by_exponents = tiled([[2.0, 4.0], [4.0, 0.5]]);
        let restored = dequantize_fp8("w", &fp8(&values), &floats, Some([4, 4])).unwrap();
        assert!(restored.equal(&expected), "{restored}");
        let restored = dequantize_fp8("w", &fp8(&values), &floats.to_kind(Kind::BFloat16), Some([4, 4])).unwrap();
        assert!(restored.equal(&expected));
        let restored = dequantize_fp8("w", &fp8(&values), &exponents, Some([4, 4])).unwrap();
        assert!(restored.equal(&by_exponents), "{restored}");
        // One scale for the whole tensor, and a stack of experts with a grid each.
        let restored = dequantize_fp8("w", &fp8(&values), &Tensor::from_slice(&[0.25f32]), Some([4, 4])).unwrap();
        assert!(restored.equal(&(&values * 0.25)));
        let stack = Tensor::stack(&[&values, &(-&values)], 0);
        let grids = Tensor::stack(&[&floats, &(&floats * 2.0)], 0);
        let restored = dequantize_fp8("w", &fp8(&stack), &grids, Some([4, 4])).unwrap();
        assert!(restored.get(1).equal(&(&expected * -2.0)));
    }

    #[test]
    fn fp8_scales_that_do_not_tile_the_values_are_refused() {
        let values = fp8(&Tensor::ones([5, 7], (Kind::Float, tch::Device::Cpu)));
        let grid = |r: i64, c: i64| Tensor::ones([r, c], (Kind::Float, tch::Device::Cpu));
        let err = dequantize_fp8("w", &values, &grid(3, 2), Some([4, 4])).unwrap_err().to_string();
        assert!(err.contains("w: fp8 values [5, 7] and scales [3, 2] do not fit (tiles of 4 × 4)"), "{err}");
        let err = dequantize_fp8("w", &values, &grid(2, 2), None).unwrap_err().to_string();
        assert!(err.contains("no weight_block_size"), "{err}");
        assert!(dequantize_fp8("w", &values, &grid(5, 7), None).is_ok(), "a grid that divides sets the tiles");
        assert!(dequantize_fp8("w", &values, &grid(5, 1), Some([8, 8])).is_ok(), "whatever the block says");
        let err = dequantize_fp8("w", &values, &grid(2, 2).to_kind(Kind::Int64), Some([4, 4])).unwrap_err();
        assert!(err.to_string().contains("scales of kind Int64"), "{err}");
    }

    /// A pair in either order becomes one tensor under the name it stands for; other tensors
    /// pass as they are, static activation scales not at all; a half alone, or fp8 in a
    /// folder that names no quantization, fails.
    #[test]
    fn pairs_meet_in_either_order_and_a_half_alone_is_named() {
        let ones = |kind| Tensor::ones([4, 4], (kind, tch::Device::Cpu));
        let scale = || Tensor::from_slice(&[2.0f32]).view([1, 1]);
        let mut d = Dequantizer::new(Some(Quantization::Fp8 { block: Some([4, 4]) }), Kind::Float);
        assert!(d.take("a.weight_scale_inv".into(), scale()).unwrap().is_none());
        assert!(d.take("n.weight".into(), ones(Kind::Float)).unwrap().is_some_and(|(n, _)| n == "n.weight"));
        let (name, t) = d.take("a.weight".into(), ones(Kind::Float8e4m3fn)).unwrap().unwrap();
        assert_eq!((name.as_str(), t.kind(), t.sum(Kind::Double).double_value(&[])), ("a.weight", Kind::Float, 32.0));
        assert!(d.take("b.weight".into(), ones(Kind::Float8e4m3fn)).unwrap().is_none());
        assert!(d.take("b.weight".into(), ones(Kind::Float8e4m3fn)).unwrap_err().to_string().contains("stored twice"));
        let mut d = Dequantizer::new(Some(Quantization::Fp8 { block: Some([4, 4]) }), Kind::Float);
        assert!(d.take("b.weight".into(), ones(Kind::Float8e4m3fn)).unwrap().is_none());
        assert!(d.finish().unwrap_err().to_string().ends_with(": b.weight: quantized values without their scales"));
        let mut d = Dequantizer::new(Some(Quantization::Fp8 { block: None }), Kind::Float);
        assert!(d.take("d.activation_scale".into(), scale()).unwrap().is_none(), "floats need no input scales");
        let stacked = "L.experts.gate_up_proj_activation_scale";
        assert!(d.take(stacked.into(), scale()).unwrap().is_none(), "nor do stacked experts");
        assert!(d.finish().is_ok(), "nor wait for any");
        let err = Dequantizer::new(None, Kind::Float).take("c.weight".into(), ones(Kind::Float8e4m3fn)).unwrap_err();
        assert!(err.to_string().contains("c.weight: fp8 values, where config.json names no quantization_config"));
    }
}
