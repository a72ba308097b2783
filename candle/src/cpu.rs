//! The ops' CPU forms: the library's f64 references over candle's CPU storage, read through the
//! layout's strides and rounded once to the output dtype.

use crate::shapes::{refuse, strides};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result};
use half::{bf16, f16};

/// The elements of `layout` over `storage` in row-major order, as f64.
pub(crate) fn gather(storage: &CpuStorage, layout: &Layout) -> Result<Vec<f64>> {
    fn read<T: Copy>(data: &[T], layout: &Layout, f: impl Fn(T) -> f64) -> Vec<f64> {
        let dims = layout.dims();
        let st = strides(layout);
        let n: usize = dims.iter().product();
        let mut out = Vec::with_capacity(n);
        let mut index = vec![0usize; dims.len()];
        for _ in 0..n {
            let at = layout.start_offset() + index.iter().zip(&st).map(|(i, s)| i * s).sum::<usize>();
            out.push(f(data[at]));
            for d in (0..dims.len()).rev() {
                index[d] += 1;
                if index[d] < dims[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        out
    }
    Ok(match storage {
        CpuStorage::BF16(v) => read(v, layout, |x| x.to_f64()),
        CpuStorage::F16(v) => read(v, layout, |x| x.to_f64()),
        CpuStorage::F32(v) => read(v, layout, f64::from),
        CpuStorage::F64(v) => read(v, layout, |x| x),
        other => return Err(refuse("cpu form", format!("takes float tensors, not {:?}", other.dtype()))),
    })
}

/// `values` rounded to `dtype`.
pub(crate) fn store(values: &[f64], dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::BF16 => CpuStorage::BF16(values.iter().map(|&x| bf16::from_f64(x)).collect()),
        DType::F16 => CpuStorage::F16(values.iter().map(|&x| f16::from_f64(x)).collect()),
        DType::F32 => CpuStorage::F32(values.iter().map(|&x| x as f32).collect()),
        DType::F64 => CpuStorage::F64(values.to_vec()),
        other => return Err(refuse("cpu form", format!("writes float tensors, not {other:?}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Shape;

    #[test]
    fn a_transposed_view_is_read_in_its_logical_order() {
        let s = CpuStorage::F32((0..6).map(|x| x as f32).collect());
        let l = Layout::contiguous(Shape::from((2, 3))).transpose(0, 1).unwrap();
        assert_eq!(gather(&s, &l).unwrap(), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        let offset = Layout::new(Shape::from((2,)), vec![2], 1);
        assert_eq!(gather(&s, &offset).unwrap(), [1.0, 3.0]);
        assert!(gather(&CpuStorage::U8(vec![1]), &Layout::contiguous(1)).is_err());
    }
}
