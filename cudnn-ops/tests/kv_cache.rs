//! The contiguous KV cache's three ways to begin a step agree: `begin` (device values uploaded),
//! `begin_on_device` (copied on the device from the cache's table) and `begin_on_host` (nothing
//! uploaded; the cache's calls take the length from the host). Over a prefill and decode steps of two
//! sequences, three caches fed the same rows hold the same K/V rows bit for bit, the device values of
//! the first two are equal, and the attention outputs agree (bit for bit where the same form ran).

use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::half::bf16;
use cudnn_llm_ops::reference::{self, BF16_TOL};
use cudnn_llm_ops::{
    AttendForm, Backend, Cudnn, KvCache, KvCacheShape, QkvRows, RopeFrequencies, RopeTables,
};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Begin {
    Upload,
    OnDevice,
    OnHost,
}

fn begin(ctx: &Cudnn, cache: &mut KvCache<bf16>, how: Begin, seq: usize) {
    match how {
        Begin::Upload => cache.begin(ctx, seq).unwrap(),
        // Only one-token steps begin on the device; a prefill uploads.
        Begin::OnDevice if seq == 1 => cache.begin_on_device(ctx).unwrap(),
        Begin::OnDevice => cache.begin(ctx, seq).unwrap(),
        Begin::OnHost => cache.begin_on_host(seq).unwrap(),
    }
}

fn host(ctx: &Cudnn, x: &CudaSlice<bf16>) -> Vec<f32> {
    ctx.stream().clone_dtoh(x).unwrap().iter().map(|v| v.to_f32()).collect()
}

fn host_i32(ctx: &Cudnn, x: &CudaSlice<i32>) -> Vec<i32> {
    ctx.stream().clone_dtoh(x).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_three_ways_to_begin_a_step_agree() {
    let ctx = Cudnn::new(0).unwrap();
    let (batch, max_seq, hq, hkv, d, prompt, steps) = (2, 32, 8, 2, 64, 7, 4);
    let shape = KvCacheShape::new(1, batch, max_seq, hkv, d).unwrap();
    let rows = QkvRows::packed(hq, &shape);
    let tables =
        RopeTables::<bf16>::from_frequencies(&ctx, &RopeFrequencies::new(d, 500_000.0).unwrap(), max_seq)
            .unwrap();
    let ways = [Begin::Upload, Begin::OnDevice, Begin::OnHost];
    let mut caches: Vec<KvCache<bf16>> =
        ways.iter().map(|_| KvCache::<bf16>::new(&ctx, shape).unwrap()).collect();
    assert!(caches.windows(2).all(|w| w[0].id() != w[1].id()), "each cache its own id");
    let mut step = 0u64;
    for seq in std::iter::once(prompt).chain(std::iter::repeat_n(1, steps)) {
        step += 1;
        let values: Vec<bf16> = reference::random_values(step, batch * seq * rows.row_stride)
            .iter()
            .map(|&v| bf16::from_f64(v))
            .collect();
        let mut outs = Vec::new();
        let mut device = Vec::new();
        for (cache, &how) in caches.iter_mut().zip(&ways) {
            let mut qkv = ctx.stream().clone_htod(&values).unwrap();
            // Poisoned: an unwritten element shows.
            let mut o = ctx.stream().clone_htod(&vec![bf16::NAN; batch * seq * hq * d]).unwrap();
            begin(&ctx, cache, how, seq);
            assert_eq!(cache.step(), Some(seq), "{how:?}");
            cache.append_rotated(&ctx, 0, &tables, rows, qkv.as_view_mut(), Backend::Fused).unwrap();
            let form = cache.attend(&ctx, 0, rows, qkv.as_view(), o.as_view_mut(), Backend::Fused).unwrap();
            if how == Begin::OnHost {
                assert_eq!(form, AttendForm::PerLength, "no device values: a plan per length");
            }
            if how != Begin::OnHost {
                let l = cache.layer_step(0).unwrap();
                let lens = (host_i32(&ctx, l.positions), host_i32(&ctx, l.kv_lens), host_i32(&ctx, l.q_lens));
                device.push(lens);
            }
            assert_eq!(cache.finish().unwrap(), seq);
            outs.push((form, host(&ctx, &o)));
        }
        let len = caches[0].uniform_len().unwrap();
        let at = (len - seq) as i32;
        assert_eq!(
            device[0],
            (vec![at; batch], vec![at + seq as i32; batch], vec![seq as i32; batch]),
            "step {step}"
        );
        assert_eq!(device[0], device[1], "begin and begin_on_device: the same device values (step {step})");
        for (i, (form, o)) in outs.iter().enumerate() {
            assert!(o.iter().all(|v| v.is_finite()), "{:?}: every output written (step {step})", ways[i]);
            if *form == outs[0].0 {
                assert_eq!(o, &outs[0].1, "{:?}, {form:?}: the same bits (step {step})", ways[i]);
            } else {
                let want: Vec<f64> = outs[0].1.iter().map(|&v| v as f64).collect();
                let c = reference::compare(o, &want);
                assert!(
                    c.passes(BF16_TOL),
                    "{:?} ({form:?}) against {:?}: {c} (step {step})",
                    ways[i],
                    outs[0].0
                );
            }
        }
        for c in &caches[1..] {
            assert_eq!(c.lens(), caches[0].lens());
            let (k, v) = c.layer(0).unwrap();
            let (k0, v0) = caches[0].layer(0).unwrap();
            assert_eq!(
                (host(&ctx, k), host(&ctx, v)),
                (host(&ctx, k0), host(&ctx, v0)),
                "K/V rows (step {step})"
            );
        }
    }
    // Lengths that differ refuse the two forms that need one length; nothing is begun then.
    let c = &mut caches[1];
    c.truncate_to(max_seq);
    assert_eq!(c.uniform_len(), Some(prompt + steps));
    c.truncate(&[3, 5]).unwrap();
    assert!(c.begin_on_device(&ctx).is_err());
    assert!(c.begin_on_host(1).is_err());
    assert_eq!(c.step(), None, "nothing begun");
    c.truncate_to(2);
    assert_eq!(c.lens(), &[2, 2]);
    assert!(!c.is_empty());
    c.clear();
    assert!(c.is_empty());
}
