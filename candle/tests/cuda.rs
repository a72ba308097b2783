//! The CUDA forms on a GPU, against the CPU forms (the library's f64 references) and candle's own ops:
//! every output element written (the memory pool is poisoned with NaN first), within the dtype's
//! tolerance, on both backends, strided inputs bound without a copy.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use cudnn_llm_candle::{
    linear_on, rms_norm_on, sdpa, sdpa_candle, sdpa_padded, Activation, Attention, Backend, Causal, Fallback,
    LinearEpilogue,
};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA GPU")
}

fn randn(shape: &[usize], seed: u64, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> =
        cudnn_llm_ops::reference::random_values(seed, n).into_iter().map(|x| x as f32).collect();
    Tensor::from_vec(v, shape, dev).unwrap()
}

/// Fills the device's memory pool with NaN in blocks of `elements`, so that an output the op leaves
/// unwritten shows (the next allocation of that size reuses a freed block).
fn poison(dev: &Device, elements: usize, dtype: DType) {
    let t = Tensor::full(f32::NAN, elements, dev).unwrap().to_dtype(dtype).unwrap();
    drop(t);
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|x| x.is_finite()), "an output element is not finite (unwritten?)");
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        _ => 1e-2,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_norm_on_candle_tensors_matches_the_reference() {
    let dev = gpu();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for backend in [Backend::Fused, Backend::Naive] {
            let x = randn(&[3, 7, 576], 1, &dev).to_dtype(dtype).unwrap();
            let w = randn(&[576], 2, &dev).to_dtype(dtype).unwrap();
            let reference = rms_norm_on(
                &x.to_device(&Device::Cpu).unwrap(),
                &w.to_device(&Device::Cpu).unwrap(),
                1e-5,
                backend,
            )
            .unwrap();
            poison(&dev, 3 * 7 * 576, dtype);
            let ours = rms_norm_on(&x, &w, 1e-5, backend).unwrap();
            assert_eq!((ours.dims(), ours.dtype()), (x.dims(), dtype));
            let e = rel(&ours, &reference);
            assert!(e < tolerance(dtype), "{dtype:?} {backend:?}: {e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sdpa_on_strided_candle_tensors_matches_the_reference() {
    let dev = gpu();
    for dtype in [DType::BF16, DType::F16] {
        // SmolLM2's heads (9 query heads over 3 K/V heads of 64), [b, s, h, d] transposed to [b, h, s, d].
        let q = randn(&[2, 33, 9, 64], 3, &dev).to_dtype(dtype).unwrap().transpose(1, 2).unwrap();
        let k = randn(&[2, 47, 3, 64], 4, &dev).to_dtype(dtype).unwrap().transpose(1, 2).unwrap();
        let v = randn(&[2, 47, 3, 64], 5, &dev).to_dtype(dtype).unwrap().transpose(1, 2).unwrap();
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            for backend in [Backend::Fused, Backend::Naive] {
                let options = Attention::causal(causal).on(backend);
                let reference = sdpa(&cpu(&q), &cpu(&k), &cpu(&v), &options).unwrap();
                poison(&dev, 2 * 9 * 33 * 64, dtype);
                let ours = sdpa(&q, &k, &v, &options).unwrap();
                assert_eq!(ours.dims(), [2, 9, 33, 64]);
                let e = rel(&ours, &reference);
                assert!(e < tolerance(dtype), "{dtype:?} {causal:?} {backend:?}: {e}");
                // candle's own attention agrees too (the baseline of the speed comparison).
                let theirs = sdpa_candle(&q, &k, &v, &options).unwrap();
                assert!(rel(&theirs, &reference) < tolerance(dtype));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_decode_step_attends_to_a_cache_prefix() {
    // One new token against the first 40 rows of a 64-row cache, sliced by candle (a strided view).
    let dev = gpu();
    let q = randn(&[1, 8, 1, 128], 6, &dev).to_dtype(DType::BF16).unwrap();
    let cache = randn(&[1, 2, 64, 128], 7, &dev).to_dtype(DType::BF16).unwrap();
    let k = cache.narrow(2, 0, 40).unwrap();
    let v = (cache.narrow(2, 0, 40).unwrap() * 0.5).unwrap();
    let options = Attention::causal(Causal::BottomRight);
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    let reference = sdpa(&cpu(&q), &cpu(&k), &cpu(&v), &options).unwrap();
    let ours = sdpa(&q, &k, &v, &options).unwrap();
    assert!(rel(&ours, &reference) < 1e-2);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_with_its_epilogue_matches_the_reference() {
    let dev = gpu();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let x = randn(&[2, 17, 256], 8, &dev).to_dtype(dtype).unwrap();
        let w = randn(&[384, 256], 9, &dev).to_dtype(dtype).unwrap();
        let b = randn(&[384], 10, &dev).to_dtype(dtype).unwrap();
        let u = randn(&[2, 17, 384], 11, &dev).to_dtype(dtype).unwrap();
        let r = randn(&[2, 17, 384], 12, &dev).to_dtype(dtype).unwrap();
        let (bc, uc, rc) = (cpu(&b), cpu(&u), cpu(&r));
        let cases = [
            (LinearEpilogue::none(), LinearEpilogue::none()),
            (
                LinearEpilogue::none().bias(&b).activation(Activation::Gelu),
                LinearEpilogue::none().bias(&bc).activation(Activation::Gelu),
            ),
            (
                LinearEpilogue::none().activation(Activation::Silu).gate(&u),
                LinearEpilogue::none().activation(Activation::Silu).gate(&uc),
            ),
            (LinearEpilogue::none().residual(&r), LinearEpilogue::none().residual(&rc)),
        ];
        for backend in [Backend::Fused, Backend::Naive] {
            for (on_gpu, on_cpu) in &cases {
                let reference = linear_on(&cpu(&x), &cpu(&w), on_cpu, backend).unwrap();
                poison(&dev, 2 * 17 * 384, dtype);
                let ours = linear_on(&x, &w, on_gpu, backend).unwrap();
                assert_eq!(ours.dims(), [2, 17, 384]);
                let e = rel(&ours, &reference);
                assert!(e < tolerance(dtype), "{dtype:?} {backend:?} {on_gpu:?}: {e}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_refused_call_is_named_or_falls_back_to_candle() {
    let dev = gpu();
    // cuDNN's attention takes 16-bit floats; f32 is refused, or computed by candle when asked.
    let q = randn(&[1, 4, 8, 64], 11, &dev);
    let k = randn(&[1, 4, 8, 64], 12, &dev);
    let e = sdpa(&q, &k, &k, &Attention::causal(Causal::TopLeft)).unwrap_err().to_string();
    assert!(e.contains("bf16 or f16"), "{e}");
    let options = Attention::causal(Causal::TopLeft).with_fallback(Fallback::Candle);
    let ours = sdpa(&q, &k, &k, &options).unwrap();
    assert!(rel(&ours, &sdpa_candle(&q, &k, &k, &options).unwrap()) < 1e-6);
    // A wrong shape is the caller's error, never a fallback.
    let bad = randn(&[1, 3, 8, 64], 13, &dev).to_dtype(DType::BF16).unwrap();
    let q16 = q.to_dtype(DType::BF16).unwrap();
    assert!(sdpa(&q16, &bad, &bad, &options).unwrap_err().to_string().contains("not a multiple of 3"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn padded_attention_serves_sequences_at_different_lengths() {
    // A batch of 3 sequences in a 256-row cache: a decode step each (one query, 5, 200 and 256 keys),
    // then a padded causal prefill (each sequence's prompt of 17, 100 and 256 tokens over itself).
    let dev = gpu();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    let lens = |v: &[i32]| Tensor::new(v, &dev).unwrap();
    let k = randn(&[3, 2, 256, 64], 14, &dev).to_dtype(DType::BF16).unwrap();
    let v = randn(&[3, 2, 256, 64], 15, &dev).to_dtype(DType::BF16).unwrap();
    let cases = [
        (
            randn(&[3, 8, 1, 64], 16, &dev),
            lens(&[1, 1, 1]),
            lens(&[5, 200, 256]),
            Causal::BottomRight,
            [1usize, 1, 1],
        ),
        (
            randn(&[3, 8, 256, 64], 17, &dev),
            lens(&[17, 100, 256]),
            lens(&[17, 100, 256]),
            Causal::TopLeft,
            [17, 100, 256],
        ),
    ];
    for (q, ql, kvl, causal, rows) in cases {
        let q = q.to_dtype(DType::BF16).unwrap();
        let options = Attention::causal(causal);
        let ours = match sdpa_padded(&q, &k, &v, &ql, &kvl, &options) {
            Ok(o) => o,
            Err(e) if e.to_string().contains("not supported") => {
                println!("SKIPPED {causal:?}: {e}");
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        let want = sdpa_padded(&cpu(&q), &cpu(&k), &cpu(&v), &cpu(&ql), &cpu(&kvl), &options).unwrap();
        for (b, &n) in rows.iter().enumerate() {
            let part = |t: &Tensor| t.narrow(0, b, 1).unwrap().narrow(2, 0, n).unwrap();
            let e = rel(&part(&ours), &part(&want));
            assert!(e < 1e-2, "{causal:?} sequence {b}: {e}");
            // The rows past the sequence's queries are zero, as the CPU form has them.
            let s_q = q.dim(2).unwrap();
            if n < s_q {
                let rest = ours.narrow(0, b, 1).unwrap().narrow(2, n, s_q - n).unwrap();
                let rest = rest.to_dtype(DType::F32).unwrap().abs().unwrap().max_all().unwrap();
                assert_eq!(rest.to_scalar::<f32>().unwrap(), 0.0, "{causal:?} sequence {b}: rows past {n}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn narrowed_weights_bind_as_their_own_elements() {
    // A weight and a bias taken out of larger buffers (a stacked tensor, a fused QKV bias): the ops see
    // the tensor's elements only, not the rest of its buffer.
    let dev = gpu();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    let x = randn(&[5, 128], 18, &dev).to_dtype(DType::BF16).unwrap();
    let stacked = randn(&[3, 128], 19, &dev).to_dtype(DType::BF16).unwrap();
    let w = stacked.get(1).unwrap();
    let ours = rms_norm_on(&x, &w, 1e-5, Backend::Fused).unwrap();
    let want = rms_norm_on(&cpu(&x), &cpu(&w), 1e-5, Backend::Fused).unwrap();
    assert!(rel(&ours, &want) < 1e-2);
    let weight = randn(&[64, 128], 20, &dev).to_dtype(DType::BF16).unwrap();
    let biases = randn(&[192], 21, &dev).to_dtype(DType::BF16).unwrap();
    let b = biases.narrow(0, 64, 64).unwrap();
    let ours = linear_on(&x, &weight, &LinearEpilogue::none().bias(&b), Backend::Fused).unwrap();
    let want =
        linear_on(&cpu(&x), &cpu(&weight), &LinearEpilogue::none().bias(&cpu(&b)), Backend::Fused).unwrap();
    assert!(rel(&ours, &want) < 1e-2);
}
