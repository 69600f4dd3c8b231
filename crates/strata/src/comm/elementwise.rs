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

/// Bytes a collective writes into its outputs from which it writes them with streaming
/// (non-temporal) stores: past one core's L2 the output is evicted before anyone reads
/// it, so pulling each line into cache first (a read for ownership) only adds traffic on
/// the memory bus that every rank shares. Below it, the output stays where the caller
/// reads it next. The shm arena reduce-scatter is the exception: it writes its output with
/// ordinary stores at any size, which measured faster there.
const STREAM_FROM: usize = 1 << 20;

/// Whether a collective that writes `bytes` into its outputs streams them ([`STREAM_FROM`]).
pub(crate) fn streams(bytes: usize) -> bool {
    bytes >= STREAM_FROM
}

/// Copies `len` bytes from `src` to `dst` (which must not overlap); with `stream`, the
/// destination's aligned middle is written with non-temporal stores, fenced before
/// returning so that a peer told afterwards sees every byte.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes, and the ranges disjoint.
pub(crate) unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize, stream: bool) {
    if stream && stream_unfenced(dst, src, len) {
        fence_streams();
    } else {
        std::ptr::copy_nonoverlapping(src, dst, len);
    }
}

/// Copies `len` bytes from `src` to `first` (with streaming stores when `stream_first`)
/// and to `streamed` (always with streaming stores, as [`copy_bytes`] with `stream`),
/// reading `src` from memory once: a few KiB at a time, the second copy reads the piece
/// while the first left it in L1.
///
/// # Safety
/// As [`copy_bytes`], for both destinations; neither overlaps `src` or the other.
pub(crate) unsafe fn copy_twice(first: *mut u8, stream_first: bool, streamed: *mut u8, src: *const u8, len: usize) {
    const PIECE: usize = 8 << 10;
    let mut fence = false;
    for at in (0..len).step_by(PIECE) {
        let (n, from) = (PIECE.min(len - at), src.add(at));
        for (dst, stream) in [(first.add(at), stream_first), (streamed.add(at), true)] {
            if stream && stream_unfenced(dst, from, n) {
                fence = true;
            } else {
                std::ptr::copy_nonoverlapping(from, dst, n);
            }
        }
    }
    if fence {
        fence_streams();
    }
}

/// Copies as [`copy_bytes`] does with `stream`, without the closing fence; false (nothing
/// copied) where streaming stores do not apply: other architectures, or fewer bytes than a
/// few cache lines.
///
/// # Safety
/// As [`copy_bytes`]; the caller fences ([`fence_streams`]) before telling anyone.
unsafe fn stream_unfenced(dst: *mut u8, src: *const u8, len: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if len >= 256 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // From the first cache-line boundary, so each step's four stores fill one line of
        // the write-combining buffer. SSE2 is part of x86-64: no feature check is needed.
        let head = dst.align_offset(64).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let body = (len - head) / 64 * 64;
        let (mut d, mut s) = (dst.add(head), src.add(head));
        let end = d.add(body);
        while d < end {
            for lane in 0..4 {
                let v = _mm_loadu_si128(s.add(16 * lane) as *const __m128i);
                _mm_stream_si128(d.add(16 * lane) as *mut __m128i, v);
            }
            d = d.add(64);
            s = s.add(64);
        }
        std::ptr::copy_nonoverlapping(s, d, len - head - body);
        return true;
    }
    let _ = (dst, src, len);
    false
}

/// Orders every streaming store before what follows (the release store a peer waits on):
/// they bypass the cache, which orders ordinary stores, so nothing else orders them.
fn fence_streams() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a store fence has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Writes into `dst` the reduction of `first` with each of `rest` (the average of all of
/// them for avg), streamed (see [`copy_bytes`]): piece by piece in a small buffer that stays
/// in L1, so `dst` is written once and never read.
pub(crate) fn reduce_streamed(kind: Kind, op: ReduceOp, dst: &mut [u8], first: &[u8], rest: &[&[u8]]) {
    // u64s, so the buffer is aligned for every dtype; 4 KiB holds whole elements of each.
    let mut piece = [0u64; 512];
    let step = std::mem::size_of_val(&piece);
    for start in (0..dst.len()).step_by(step) {
        let end = (start + step).min(dst.len());
        // SAFETY: the u64 buffer viewed as its own bytes.
        let tmp = unsafe { std::slice::from_raw_parts_mut(piece.as_mut_ptr() as *mut u8, end - start) };
        match rest.split_first() {
            Some((second, others)) => {
                combine_into(kind, op, tmp, &first[start..end], &second[start..end]);
                others.iter().for_each(|o| reduce_into(kind, op, tmp, &o[start..end]));
            }
            None => tmp.copy_from_slice(&first[start..end]),
        }
        if op == ReduceOp::Avg {
            divide(kind, tmp, rest.len() + 1);
        }
        // SAFETY: `dst[start..end]` is writable and distinct from the stack buffer.
        if !unsafe { stream_unfenced(dst[start..end].as_mut_ptr(), tmp.as_ptr(), end - start) } {
            dst[start..end].copy_from_slice(tmp);
        }
    }
    fence_streams();
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

    proptest::proptest! {
        /// Streamed copies land every byte, whatever the destination's alignment and the
        /// length's remainder, and touch nothing beyond the destination range.
        #[test]
        fn streamed_copies_equal_plain_ones(src_at in 0usize..64, dst_at in 0usize..64, len in 0usize..9000) {
            let src: Vec<u8> = (0..src_at + len).map(|i| (i * 7 + 3) as u8).collect();
            let mut dst = vec![0xAAu8; dst_at + len + 64];
            // SAFETY: both ranges lie inside their vectors, which are distinct.
            unsafe { copy_bytes(dst[dst_at..].as_mut_ptr(), src[src_at..].as_ptr(), len, true) };
            proptest::prop_assert_eq!(&dst[dst_at..dst_at + len], &src[src_at..]);
            proptest::prop_assert!(dst[..dst_at].iter().chain(&dst[dst_at + len..]).all(|&b| b == 0xAA));
        }

        /// Copying to two destinations lands every byte in both, whatever their alignments,
        /// the length's place among the pieces and how the first is written, and touches
        /// nothing beyond either range.
        #[test]
        fn copies_to_two_places_equal_plain_ones(
            first_at in 0usize..64, second_at in 0usize..64, len in 0usize..20_000, stream_first: bool,
        ) {
            let src: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let mut first = vec![0xAAu8; first_at + len + 64];
            let mut second = vec![0x55u8; second_at + len + 64];
            // SAFETY: each range lies inside its own vector.
            unsafe {
                copy_twice(first[first_at..].as_mut_ptr(), stream_first, second[second_at..].as_mut_ptr(), src.as_ptr(), len)
            };
            proptest::prop_assert_eq!(&first[first_at..first_at + len], &src[..]);
            proptest::prop_assert_eq!(&second[second_at..second_at + len], &src[..]);
            proptest::prop_assert!(first[..first_at].iter().chain(&first[first_at + len..]).all(|&b| b == 0xAA));
            proptest::prop_assert!(second[..second_at].iter().chain(&second[second_at + len..]).all(|&b| b == 0x55));
        }

        /// A streamed reduction equals reducing in place one contribution after another, for
        /// every dtype and op, over lengths that end inside a piece of its buffer.
        #[test]
        fn streamed_reductions_equal_plain_ones(numel in 0usize..3000, peers in 0usize..4, which in 0usize..9) {
            let (kind, op) = [
                (Kind::Float, ReduceOp::Sum), (Kind::Float, ReduceOp::Avg), (Kind::Double, ReduceOp::Max),
                (Kind::Half, ReduceOp::Avg), (Kind::BFloat16, ReduceOp::Sum), (Kind::Int, ReduceOp::Min),
                (Kind::Int64, ReduceOp::Sum), (Kind::Float, ReduceOp::Min), (Kind::Half, ReduceOp::Max),
            ][which];
            let contribution = |c: usize| {
                let t = tch::Tensor::arange(numel as i64, (Kind::Int64, tch::Device::Cpu)) * (c as i64 + 1);
                let t = t.remainder(13) - 6;
                let t = t.to_kind(kind);
                let mut bytes = vec![0u8; numel * kind.elt_size_in_bytes()];
                t.copy_data_u8(&mut bytes, numel);
                bytes
            };
            let first = contribution(0);
            let rest: Vec<Vec<u8>> = (1..=peers).map(contribution).collect();
            let mut expected = first.clone();
            rest.iter().for_each(|r| reduce_into(kind, op, &mut expected, r));
            if op == ReduceOp::Avg {
                divide(kind, &mut expected, peers + 1);
            }
            // u64 storage, aligned for every dtype as tensor storage is.
            let mut out = vec![0u64; expected.len().div_ceil(8)];
            // SAFETY: the u64 vector viewed as its first `expected.len()` bytes.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, expected.len()) };
            let rest: Vec<&[u8]> = rest.iter().map(Vec::as_slice).collect();
            reduce_streamed(kind, op, dst, &first, &rest);
            proptest::prop_assert_eq!(&*dst, &expected[..]);
        }
    }
}
