//! The device greedy pick ([`argmax`]) against its f64 reference ([`reference::argmax_rows`]) and the
//! host sampler's argmax: random rows with ties, rows of −∞, NaN and +∞ rows flagged, the Llama-3
//! vocabulary and small odd ones, strided rows, every dtype; outputs poisoned first; a bad call touches
//! nothing; a captured CUDA graph replays on new logits. GPU tests are ignored by default; run them with
//! `--include-ignored` on a GPU machine.

use cudarc::driver::CudaSlice;
use cudnn_llm::cudnn_ops::reference;
use cudnn_llm::cudnn_ops::{argmax, ArgmaxArgs, ArgmaxOperands, Cudnn, Element, Pick};
use cudnn_llm::llama::sampling;
use cudnn_llm_app::bench_util::{gpu, upload};
use half::{bf16, f16};

/// Written over every output before a call: a row left unwritten shows.
const POISON: u32 = 0xdead_beef;

fn poisoned_words(ctx: &Cudnn, n: usize) -> CudaSlice<u32> {
    ctx.stream().clone_htod(&vec![POISON; n]).unwrap()
}

fn words(ctx: &Cudnn, buf: &CudaSlice<u32>) -> Vec<u32> {
    ctx.stream().clone_dtoh(buf).unwrap()
}

/// Random logits for `rows × vocab` (row stride `stride`) with what the kernel must get right: a tie
/// for the maximum (two ids, the lower one wins), a row of −∞ but one id, a row of −∞ entirely, a row
/// with NaN, a row with +∞ (after a NaN-free prefix), where the rows exist.
fn logits(seed: u64, rows: usize, vocab: usize, stride: usize) -> Vec<f64> {
    let mut v = reference::random_values(seed, rows * stride);
    let at = |r: usize, i: usize| r * stride + i % vocab;
    for r in 0..rows {
        let (a, b) = ((seed as usize * 31 + r * 977) % vocab, (seed as usize * 17 + r * 7919 + 5) % vocab);
        match r % 6 {
            0 | 3 => {
                // Ties for the maximum at a and b.
                v[at(r, a)] = 4.0;
                v[at(r, b)] = 4.0;
            }
            1 => {
                for i in 0..vocab {
                    v[at(r, i)] = f64::NEG_INFINITY;
                }
                v[at(r, b)] = -3.0;
            }
            2 if rows > 2 => {
                for i in 0..vocab {
                    v[at(r, i)] = f64::NEG_INFINITY;
                }
            }
            4 => v[at(r, b)] = f64::NAN,
            5 => v[at(r, a)] = f64::INFINITY,
            _ => {}
        }
    }
    v
}

/// Runs the argmax of `rows × vocab` logits (stride `stride`) in `T` and checks the picks against the
/// reference, the ids against the picks, and every sampleable row against the host sampler's argmax
/// (and every unsampleable one against its error).
fn check<T: Element>(ctx: &Cudnn, seed: u64, rows: usize, vocab: usize, stride: usize) -> Vec<String> {
    let tag = format!("{} rows {rows} vocab {vocab} stride {stride} seed {seed}", T::DTYPE);
    let (dev, rounded) = upload::<T>(ctx, &logits(seed, rows, vocab, stride)).unwrap();
    let args = ArgmaxArgs::new(rows, vocab).with_row_stride(stride);
    let (mut picks, mut ids) = (poisoned_words(ctx, rows), poisoned_words(ctx, rows));
    argmax(ctx, args, ArgmaxOperands::new(&dev, &mut picks).ids(&mut ids)).unwrap();
    let (got, got_ids) = (words(ctx, &picks), words(ctx, &ids));
    let want = reference::argmax_rows(&rounded, args);
    let mut failures = Vec::new();
    for r in 0..rows {
        let row: Vec<f32> = rounded[r * stride..r * stride + vocab].iter().map(|v| *v as f32).collect();
        let host = sampling::argmax(&row);
        let pick = Pick::from_word(got[r]);
        let ok = got[r] == want[r]
            && got_ids[r] < vocab as u32
            && match (pick, &host) {
                (Pick::Id(id), Ok(h)) => id == *h && got_ids[r] == id,
                (_, Err(e)) => {
                    sampling::pick_result(pick).err().map(|d| d.to_string()) == Some(e.to_string())
                }
                _ => false,
            };
        if !ok {
            failures.push(format!(
                "{tag} row {r}: device {pick:?} (word {:#x}, id {:#x}), reference {:?}, host {host:?}",
                got[r],
                got_ids[r],
                Pick::from_word(want[r])
            ));
        }
    }
    println!("{tag}: {} of {rows} rows as the reference and the host argmax", rows - failures.len());
    failures
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_argmax_equals_the_reference_and_the_host_argmax() {
    let ctx = gpu();
    let mut failures = Vec::new();
    for (rows, vocab, stride) in [
        (1, 128_256, 128_256),
        (32, 128_256, 128_256),
        (7, 128_256, 128_256),
        (6, 1, 1),
        (6, 7, 7),
        (12, 1023, 1023),
        (6, 1025, 1025),
        (13, 32_003, 32_003),
        (6, 999, 1031),
    ] {
        for seed in [1, 2] {
            failures.extend(check::<bf16>(&ctx, seed, rows, vocab, stride));
            failures.extend(check::<f16>(&ctx, seed + 10, rows, vocab, stride));
            failures.extend(check::<f32>(&ctx, seed + 20, rows, vocab, stride));
        }
    }
    assert!(failures.is_empty(), "{} rows differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_argmax_calls_touch_nothing() {
    let ctx = gpu();
    let (dev, _) = upload::<bf16>(&ctx, &reference::random_values(3, 4 * 100)).unwrap();
    let (mut picks, mut ids) = (poisoned_words(&ctx, 4), poisoned_words(&ctx, 3));
    for (args, ids_too, expected) in [
        (ArgmaxArgs::new(5, 100), false, "logits have 400"),
        (ArgmaxArgs::new(4, 100), true, "3 ids for 4 rows"),
        (ArgmaxArgs::new(2, 100).with_row_stride(99), false, "row stride 99"),
    ] {
        let x = ArgmaxOperands::new(&dev, &mut picks);
        let x = if ids_too { x.ids(&mut ids) } else { x };
        let e = argmax(&ctx, args, x).unwrap_err().to_string();
        assert!(e.contains(expected), "{expected}: {e}");
    }
    ctx.synchronize().unwrap();
    assert!(words(&ctx, &picks).iter().all(|w| *w == POISON), "picks were written");
    assert!(words(&ctx, &ids).iter().all(|w| *w == POISON), "ids were written");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_argmax_replays_on_new_logits() {
    let ctx = gpu();
    let (rows, vocab) = (4, 128_256);
    let args = ArgmaxArgs::new(rows, vocab);
    let (mut dev, _) = upload::<bf16>(&ctx, &logits(40, rows, vocab, vocab)).unwrap();
    let (mut picks, mut ids) = (poisoned_words(&ctx, rows), poisoned_words(&ctx, rows));
    // The kernels load outside the capture.
    argmax(&ctx, args, ArgmaxOperands::new(&dev, &mut picks).ids(&mut ids)).unwrap();
    // SAFETY: one thread, nothing else on this context's CUDA context meanwhile.
    let ((), graph) =
        unsafe { ctx.capture(|| argmax(&ctx, args, ArgmaxOperands::new(&dev, &mut picks).ids(&mut ids))) }
            .unwrap();
    for seed in [41, 42, 43] {
        let (new, rounded) = upload::<bf16>(&ctx, &logits(seed, rows, vocab, vocab)).unwrap();
        ctx.stream().memcpy_dtod(&new, &mut dev).unwrap();
        ctx.stream().memcpy_htod(&vec![POISON; rows], &mut picks).unwrap();
        ctx.stream().memcpy_htod(&vec![POISON; rows], &mut ids).unwrap();
        graph.launch().unwrap();
        let got = words(&ctx, &picks);
        let want = reference::argmax_rows(&rounded, args);
        println!("replay with seed {seed}: picks {got:x?}, reference {want:x?}");
        assert_eq!(got, want, "replay with seed {seed}");
        let got_ids = words(&ctx, &ids);
        for r in 0..rows {
            if let Pick::Id(id) = Pick::from_word(got[r]) {
                assert_eq!(got_ids[r], id, "replay with seed {seed}, row {r}: ids");
            }
        }
    }
}
