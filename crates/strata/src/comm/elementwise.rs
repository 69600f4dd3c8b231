//! Element-wise work on raw tensor bytes that every transport and backend shares: splitting a
//! buffer into per-rank shares, and reducing or averaging one buffer into another per dtype.
//! A leaf: it knows dtypes and bytes, nothing of groups, transports or rings.
use super::ReduceOp;
use crate::{Error, Result};
use half::{bf16, f16};
use tch::Kind;

/// Splits `numel` elements into `n` near-equal byte ranges.
pub(crate) fn split(numel: usize, n: usize, esize: usize) -> Vec<std::ops::Range<usize>> {
    let (base, extra) = (numel / n, numel % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let count = base + usize::from(i < extra);
            let r = start * esize..(start + count) * esize;
            start += count;
            r
        })
        .collect()
}

pub(crate) fn check_reducible(kind: Kind, op: ReduceOp) -> Result<()> {
    let float = matches!(kind, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16);
    if !float && !matches!(kind, Kind::Int | Kind::Int64) {
        return Err(Error::Comm(format!("cannot reduce {kind:?} tensors; supported: f32, f64, f16, bf16, i32, i64")));
    }
    if op == ReduceOp::Avg && !float {
        return Err(Error::Comm(format!("avg needs a floating-point tensor, got {kind:?}")));
    }
    Ok(())
}

/// `dst[i] = op(dst[i], src[i])` over elements of `kind`.
pub(crate) fn reduce_into(kind: Kind, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    apply(kind, op, dst, None, src)
}

/// `dst[i] = op(a[i], b[i])`: a reduction that reads its first operand from elsewhere, so
/// the result needs no copy of it first.
pub(crate) fn combine_into(kind: Kind, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    apply(kind, op, dst, Some(a), b)
}

/// `dst = op(a, src)` with `a` defaulting to `dst` itself.
fn apply(kind: Kind, op: ReduceOp, dst: &mut [u8], a: Option<&[u8]>, src: &[u8]) {
    fn typed<T: Copy>(dst: &mut [u8], a: Option<&[u8]>, src: &[u8], f: impl Fn(T, T) -> T) {
        let n = dst.len() / std::mem::size_of::<T>();
        if n == 0 {
            return;
        }
        // SAFETY: every buffer is aligned for T (tensor storage, shared slots or u64 scratch,
        // at element offsets) and holds at least n elements.
        let view = |b: &[u8]| unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, n) };
        let d = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut T, n) };
        let s = view(src);
        match a {
            None => d.iter_mut().zip(s).for_each(|(x, &y)| *x = f(*x, y)),
            Some(a) => d.iter_mut().zip(view(a).iter().zip(s)).for_each(|(x, (&l, &r))| *x = f(l, r)),
        }
    }
    macro_rules! arith {
        ($t:ty, $to:expr, $from:expr) => {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => typed::<$t>(dst, a, src, |a, b| $from($to(a) + $to(b))),
                ReduceOp::Max => typed::<$t>(dst, a, src, |a, b| if $to(b) > $to(a) { b } else { a }),
                ReduceOp::Min => typed::<$t>(dst, a, src, |a, b| if $to(b) < $to(a) { b } else { a }),
            }
        };
    }
    match kind {
        Kind::Float => arith!(f32, (|x: f32| x), (|x: f32| x)),
        Kind::Double => arith!(f64, (|x: f64| x), (|x: f64| x)),
        Kind::Half => arith!(f16, f16::to_f32, f16::from_f32),
        Kind::BFloat16 => arith!(bf16, bf16::to_f32, bf16::from_f32),
        Kind::Int => match op {
            ReduceOp::Max => typed::<i32>(dst, a, src, i32::max),
            ReduceOp::Min => typed::<i32>(dst, a, src, i32::min),
            _ => typed::<i32>(dst, a, src, i32::wrapping_add),
        },
        Kind::Int64 => match op {
            ReduceOp::Max => typed::<i64>(dst, a, src, i64::max),
            ReduceOp::Min => typed::<i64>(dst, a, src, i64::min),
            _ => typed::<i64>(dst, a, src, i64::wrapping_add),
        },
        _ => unreachable!("checked by check_reducible"),
    }
}

/// Divides a block of floating-point elements by `n` (the second half of avg).
pub(crate) fn divide(kind: Kind, block: &mut [u8], n: usize) {
    fn typed<T: Copy>(b: &mut [u8], f: impl Fn(T) -> T) {
        let len = b.len() / std::mem::size_of::<T>();
        if len == 0 {
            return;
        }
        // SAFETY: aligned tensor storage holding `len` elements of T.
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, len) }.iter_mut().for_each(|x| *x = f(*x));
    }
    let d = n as f64;
    match kind {
        Kind::Float => typed::<f32>(block, |x| x / d as f32),
        Kind::Double => typed::<f64>(block, |x| x / d),
        Kind::Half => typed::<f16>(block, |x| f16::from_f32(x.to_f32() / d as f32)),
        Kind::BFloat16 => typed::<bf16>(block, |x| bf16::from_f32(x.to_f32() / d as f32)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_every_element_once() {
        let r = split(10, 4, 4);
        assert_eq!(r, vec![0..12, 12..24, 24..32, 32..40]);
        assert!(split(0, 3, 8).iter().all(|r| r.is_empty()));
    }

    #[test]
    fn reductions_per_dtype() {
        let mut a = [1.5f32, -2.0].map(f32::to_le_bytes).concat();
        let b = [2.0f32, -3.0].map(f32::to_le_bytes).concat();
        reduce_into(Kind::Float, ReduceOp::Max, &mut a, &b);
        assert_eq!(a, [2.0f32, -2.0].map(f32::to_le_bytes).concat());
        let mut h = [f16::from_f32(1.0), f16::from_f32(2.0)].map(|x| x.to_le_bytes()).concat();
        let g = [f16::from_f32(0.5), f16::from_f32(0.25)].map(|x| x.to_le_bytes()).concat();
        reduce_into(Kind::Half, ReduceOp::Sum, &mut h, &g);
        assert_eq!(h, [f16::from_f32(1.5), f16::from_f32(2.25)].map(|x| x.to_le_bytes()).concat());
        let mut out = [0u8; 8];
        combine_into(Kind::Float, ReduceOp::Sum, &mut out, &[1.0f32, 2.0].map(f32::to_le_bytes).concat(), &b);
        assert_eq!(out.to_vec(), [3.0f32, -1.0].map(f32::to_le_bytes).concat());
        assert!(check_reducible(Kind::Int64, ReduceOp::Avg).is_err());
        assert!(check_reducible(Kind::Bool, ReduceOp::Sum).is_err());
    }
}
