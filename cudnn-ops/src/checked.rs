//! Checked size arithmetic shared by every op: sizes, offsets and strides derived from caller input are
//! computed here, so that an overflow is an [`Error::InvalidArgument`] naming the argument instead of a
//! wrapped value that passes a length check (release) or a panic (debug).
//!
//! cuDNN takes sizes and strides as `i64` and the kernels index with 64-bit signed integers, so every
//! size handed on is also checked to fit `i64` ([`fits_i64`]).

use crate::{Error, Result};

fn overflow(what: &str) -> Error {
    Error::invalid(format!("{what} overflows"))
}

/// `a · b`, or an error naming `what`.
pub(crate) fn mul(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| overflow(what))
}

/// `a + b`, or an error naming `what`.
pub(crate) fn add(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_add(b).ok_or_else(|| overflow(what))
}

/// The most elements a tensor may span: its bytes, for elements of up to 8 bytes, fit `i64`.
pub(crate) const MAX_ELEMENTS: usize = (i64::MAX / 8) as usize;

/// `v` if at most [`MAX_ELEMENTS`], else an error naming `what`.
pub(crate) fn elements(what: &str, v: usize) -> Result<usize> {
    if v <= MAX_ELEMENTS {
        Ok(v)
    } else {
        Err(Error::invalid(format!("{what} = {v} elements: their bytes do not fit a 64-bit signed size")))
    }
}

/// The product of `factors`, checked to be at most [`MAX_ELEMENTS`], or an error naming `what`.
pub(crate) fn product(what: &str, factors: &[usize]) -> Result<usize> {
    let p = factors.iter().try_fold(1usize, |p, &f| p.checked_mul(f)).ok_or_else(|| overflow(what))?;
    elements(what, p)
}

/// Elements a buffer must hold for `dims` over element `strides`: one past the furthest element
/// reached (0 when a dim is 0), checked to be at most [`MAX_ELEMENTS`].
pub(crate) fn extent(what: &str, dims: &[usize], strides: &[usize]) -> Result<usize> {
    if dims.contains(&0) {
        return Ok(0);
    }
    let mut last = 0usize;
    for (&d, &s) in dims.iter().zip(strides) {
        last = last
            .checked_add((d - 1).checked_mul(s).ok_or_else(|| overflow(what))?)
            .ok_or_else(|| overflow(what))?;
    }
    elements(what, add(what, last, 1)?)
}

/// `v` if it fits `i64` (what cuDNN and the kernels index with), else an error naming `what`.
pub(crate) fn fits_i64(what: &str, v: usize) -> Result<usize> {
    if i64::try_from(v).is_ok() {
        Ok(v)
    } else {
        Err(Error::invalid(format!("{what} = {v} does not fit a 64-bit signed size")))
    }
}

/// `v` as `i64`, or an error naming `what`.
pub(crate) fn to_i64(what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid(format!("{what} = {v} does not fit a 64-bit signed size")))
}

/// `v` as a CUDA grid or block dimension (at most `i32::MAX`), or an error naming `what`.
pub(crate) fn launch_dim(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v)
        .ok()
        .filter(|&d| d <= i32::MAX as u32)
        .ok_or_else(|| Error::invalid(format!("{what} = {v} exceeds a CUDA launch dimension")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflows_are_errors_naming_the_argument() {
        assert_eq!(mul("x", 3, 4).unwrap(), 12);
        assert!(mul("rows", usize::MAX, 2).unwrap_err().to_string().contains("rows overflows"));
        assert!(add("start + seq", usize::MAX, 1).unwrap_err().to_string().contains("start + seq"));
        assert_eq!(product("n", &[2, 3, 4]).unwrap(), 24);
        assert!(product("n", &[1 << 62, 2]).is_err(), "2^63 does not fit i64");
        assert!(product("n", &[1 << 60, 2]).is_err(), "2^61 elements of 8 bytes do not fit i64");
        assert_eq!(product("n", &[MAX_ELEMENTS]).unwrap(), MAX_ELEMENTS);
        assert!(extent("n", &[2, 2], &[MAX_ELEMENTS / 2, 1]).is_ok());
        assert!(extent("n", &[2, 2], &[MAX_ELEMENTS, 1]).is_err());
        assert!(product("n", &[usize::MAX, 2]).is_err());
        assert_eq!(extent("Q", &[2, 3], &[3, 1]).unwrap(), 6);
        assert_eq!(extent("Q", &[0, 3], &[usize::MAX, 1]).unwrap(), 0);
        // The review's reproduction: batch 5 with a 2^62 batch stride wraps to 0 without checks.
        let e = extent("sdpa: Q", &[5, 1, 1, 8], &[1 << 62, 8, 8, 1]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("sdpa: Q"), "{e}");
        assert!(extent("Q", &[2], &[1 << 63]).is_err(), "2^63 + 1 does not fit i64");
        assert_eq!(to_i64("v", i64::MAX as usize).unwrap(), i64::MAX);
        assert!(to_i64("v", i64::MAX as usize + 1).is_err());
        assert!(fits_i64("v", usize::MAX).is_err());
        assert_eq!(launch_dim("grid", 7).unwrap(), 7);
        assert!(launch_dim("grid", 1 << 31).is_err());
        assert!(launch_dim("grid", usize::MAX).is_err());
    }
}
