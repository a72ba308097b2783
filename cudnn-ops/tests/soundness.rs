//! Soundness on the GPU (issue 19): cross-stream buffers are ordered, device ids and sequence lengths
//! are bounded on the device, and a plan refuses a context it was not built for. GPU tests are
//! ignored by default; run them with `--include-ignored` on a GPU machine. The CPU side (checked
//! arithmetic, property tests) is in cudnn-ops' unit tests.

use cudarc::driver::CudaSlice;
use cudnn_llm_ops::testing::{download, gpu, poisoned, upload};
use cudnn_llm_ops::{
    embedding, reference, rms_norm, sdpa, Backend, Bindings, DataType, EmbeddingArgs, EmbeddingOperands,
    Error, Layout, NormPhase, RmsNormArgs, RmsNormOperands, SdpaArgs, SdpaOperands, SeqLens,
};
use half::bf16;

fn values(n: usize, seed: u64) -> Vec<f64> {
    (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f64 / 500.0) - 1.0).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_input_written_on_a_forked_stream_is_read_in_order() {
    let ctx = gpu();
    let (tokens, hidden) = (512, 4096);
    let n = tokens * hidden;
    let host = values(n, 1);
    let x_host: Vec<bf16> = reference::to_elements(&host);
    let x_ref: Vec<f64> = x_host.iter().map(|v| v.to_f64()).collect();
    let (w, w_ref) = upload::<bf16>(&ctx, &values(hidden, 2)).unwrap();
    let mut y = poisoned::<bf16>(&ctx, n).unwrap();
    let args = RmsNormArgs::new(tokens, hidden, 1e-5);
    // Build the plan first, so that the race window below is not hidden by plan building.
    rms_norm(
        &ctx,
        args,
        RmsNormOperands::new(&poisoned::<bf16>(&ctx, n).unwrap(), &w, &mut y),
        Backend::Fused,
    )
    .unwrap();
    ctx.synchronize().unwrap();

    let fork = ctx.stream().fork().unwrap();
    // Keep the forked stream busy (1 GiB of memsets), then write x there: unordered, the fused op
    // would read x before the copy lands.
    let mut busy = fork.alloc_zeros::<u8>(1 << 28).unwrap();
    for _ in 0..4 {
        fork.memset_zeros(&mut busy).unwrap();
    }
    let mut x: CudaSlice<bf16> = fork.alloc_zeros(n).unwrap();
    fork.memcpy_htod(&x_host, &mut x).unwrap();
    rms_norm(&ctx, args, RmsNormOperands::new(&x, &w, &mut y), Backend::Fused).unwrap();
    // x was allocated on the forked stream: its free there must wait for the read on ctx's stream.
    drop(x);
    drop(busy);
    let out = download(&ctx, &y).unwrap();
    let (y_ref, _) = reference::rms_norm(&x_ref, &w_ref, tokens, hidden, 1e-5);
    let c = reference::compare(&out, &y_ref);
    assert!(c.passes(reference::tolerance(DataType::BF16)), "{c}");
    fork.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_ids_outside_the_vocabulary_give_zero_rows() {
    let ctx = gpu();
    let (vocab, hidden) = (8, 64);
    let (table, table_ref) = upload::<bf16>(&ctx, &values(vocab * hidden, 3)).unwrap();
    // check_ids would refuse these on the host; uploaded directly, only the kernel can bound them.
    let ids_host = [1u32, 8, u32::MAX, 7, 1 << 31];
    let ids = ctx.stream().clone_htod(&ids_host).unwrap();
    let mut y = poisoned::<bf16>(&ctx, ids_host.len() * hidden).unwrap();
    embedding(
        &ctx,
        EmbeddingArgs::new(ids_host.len(), vocab, hidden),
        EmbeddingOperands::new(&ids, &table, &mut y),
    )
    .unwrap();
    let out = download(&ctx, &y).unwrap();
    for (r, &id) in ids_host.iter().enumerate() {
        let row: Vec<f64> = out[r * hidden..(r + 1) * hidden].iter().map(|v| v.to_f64()).collect();
        if (id as usize) < vocab {
            assert_eq!(row, table_ref[id as usize * hidden..(id as usize + 1) * hidden], "row {r} (id {id})");
        } else {
            assert!(row.iter().all(|&v| v == 0.0), "row {r} (id {id} >= {vocab}) is not zeros: {row:?}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn padded_attention_clamps_lengths_beyond_the_capacity() {
    let ctx = gpu();
    let (batch, heads, cap_kv, d) = (2, 4, 64, 64);
    let args = SdpaArgs::new(batch, heads, heads, 1, cap_kv, d, Layout::Bshd).with_seq_lens();
    let (q, _) = upload::<bf16>(&ctx, &values(batch * heads * d, 4)).unwrap();
    let (k, _) = upload::<bf16>(&ctx, &values(batch * cap_kv * heads * d, 5)).unwrap();
    let (v, _) = upload::<bf16>(&ctx, &values(batch * cap_kv * heads * d, 6)).unwrap();
    let run = |lq: &[i32], lkv: &[i32]| -> Result<Vec<bf16>, Error> {
        let (sq, skv) = (ctx.stream().clone_htod(lq)?, ctx.stream().clone_htod(lkv)?);
        let mut o = poisoned::<bf16>(&ctx, batch * heads * d)?;
        sdpa(&ctx, args, SdpaOperands::new(&q, &k, &v, &mut o).seq_lens(&sq, &skv), Backend::Fused)?;
        download(&ctx, &o)
    };
    let full = match run(&[1, 1], &[cap_kv as i32, cap_kv as i32]) {
        Err(e) if e.is_not_supported() => {
            eprintln!("SKIPPED padded attention: {e}");
            return;
        }
        other => other.unwrap(),
    };
    assert!(full.iter().all(|v| v.to_f64().is_finite()));
    // Lengths past the capacity (unclamped, cuDNN would read K/V rows past the buffers) act as the
    // capacity.
    let beyond = run(&[7, i32::MAX], &[1000, i32::MAX]).unwrap();
    assert_eq!(beyond, full);
    // Clamped once into a SeqLens and read by two calls: the same, and a SeqLens clamped into a
    // larger capacity than the call's is refused before anything runs.
    let mut lens = SeqLens::new(&ctx, batch, 1, cap_kv).unwrap();
    let (sq, skv) =
        (ctx.stream().clone_htod(&[7, i32::MAX]).unwrap(), ctx.stream().clone_htod(&[1000, -5]).unwrap());
    lens.clamp(&ctx, &sq, &skv).unwrap();
    for _ in 0..2 {
        let mut o = poisoned::<bf16>(&ctx, batch * heads * d).unwrap();
        sdpa(&ctx, args, SdpaOperands::new(&q, &k, &v, &mut o).clamped_seq_lens(&lens), Backend::Fused)
            .unwrap();
        let got = download(&ctx, &o).unwrap();
        assert_eq!(got[..heads * d], full[..heads * d], "sequence 0 clamped to the capacity");
    }
    let wide = SeqLens::new(&ctx, batch, 1, cap_kv + 1).unwrap();
    let mut o = poisoned::<bf16>(&ctx, batch * heads * d).unwrap();
    let e = sdpa(&ctx, args, SdpaOperands::new(&q, &k, &v, &mut o).clamped_seq_lens(&wide), Backend::Fused)
        .unwrap_err();
    assert!(e.to_string().contains("more than the call's capacities"), "{e}");
    assert!(download(&ctx, &o).unwrap().iter().all(|v| v.to_f64().is_nan()), "a refused call wrote O");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_plan_refuses_another_context_and_foreign_bindings() {
    let (ctx, other) = (gpu(), gpu());
    let args = RmsNormArgs::new(4, 256, 1e-5);
    let plan = args.plan(&ctx, DataType::BF16, NormPhase::Inference).unwrap();
    let [ux, uw, ue, uy] = ["X", "scale", "epsilon", "Y"].map(|name| plan.uid(name).unwrap());
    let (x, _) = upload::<bf16>(&other, &values(4 * 256, 7)).unwrap();
    let (w, _) = upload::<bf16>(&other, &values(256, 8)).unwrap();
    let mut y = poisoned::<bf16>(&other, 4 * 256).unwrap();
    {
        let mut b = Bindings::new(other.stream());
        b.input(ux, &x).input(uw, &w).scalar_f32(ue, 1e-5).output(uy, &mut y);
        let e = plan.execute(&other, &b).unwrap_err();
        assert!(matches!(e, Error::WrongContext(_)), "{e:?}");
        assert!(matches!(plan.prepare(&other, &b), Err(Error::WrongContext(_))));
        // Its own context, but bindings made for another stream.
        let e = plan.execute(&ctx, &b).unwrap_err();
        assert!(matches!(e, Error::WrongContext(_)) && e.to_string().contains("another stream"), "{e:?}");
    }
    let out = download(&other, &y).unwrap();
    assert!(out.iter().all(|v| v.to_f64().is_nan()), "a refused plan wrote its output");
    // The plan still runs on its own context with its own bindings.
    let (x, _) = upload::<bf16>(&ctx, &values(4 * 256, 7)).unwrap();
    let (w, _) = upload::<bf16>(&ctx, &values(256, 8)).unwrap();
    let mut y = poisoned::<bf16>(&ctx, 4 * 256).unwrap();
    let mut b = Bindings::new(ctx.stream());
    b.input(ux, &x).input(uw, &w).scalar_f32(ue, 1e-5).output(uy, &mut y);
    plan.execute(&ctx, &b).unwrap();
    drop(b);
    assert!(download(&ctx, &y).unwrap().iter().all(|v| v.to_f64().is_finite()));
}
