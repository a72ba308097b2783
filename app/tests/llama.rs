//! The Llama model on the GPU: every backend mix against the f64 CPU forward (tiny preset), fused vs
//! naive on the 1B preset, prefill + decode against a full forward, and recorded fallbacks. GPU tests are
//! ignored by default; run them with `--include-ignored` on a GPU machine.

use cudnn_llm::cudnn_ops::reference::{compare, Tolerance};
use cudnn_llm::cudnn_ops::{Backend, Cudnn, DataType, WeightScales};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{
    reference, Backends, DecodeFusion, DecodeGraph, KvCache, Llama, LlamaConfig, ModuleKind, NoObserver,
};
use cudnn_llm_app::bench_util::gpu;
use half::bf16;

/// Hidden states through a whole bf16 model, against f64.
const MODEL_TOL: Tolerance = Tolerance::rel_l2(3e-2);
/// Hidden states of a model with FP8 projections whose fused prefill quantizes the activations per
/// token too (E4M3 keeps 3 mantissa bits: up to 2^-4 relative rounding an element), against the f64
/// forward over the dequantized weights and unquantized activations.
const FP8_ACTIVATIONS_TOL: Tolerance = Tolerance::rel_l2(8e-2);

fn tokens(batch: usize, seq: usize, vocab: usize, seed: u32) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| (0..seq).map(|s| (seed + 7919 * b as u32 + 104729 * s as u32) % vocab as u32).collect())
        .collect()
}

fn hidden(ctx: &Cudnn, model: &mut Llama<bf16>, toks: &[Vec<u32>], backends: &Backends) -> Vec<bf16> {
    let rows = toks.len() * toks[0].len();
    let mut cache = model.cache(ctx, toks.len(), toks[0].len()).unwrap();
    let out = model.forward(ctx, toks, &mut cache, backends, &mut NoObserver).unwrap();
    let mut host = ctx.stream().clone_dtoh(out).unwrap();
    host.truncate(rows * model.config().hidden);
    host
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_model_matches_the_cpu_reference_on_every_backend_mix() {
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 1);
    let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
    let toks = tokens(3, 10, cfg.vocab, 5);
    let expected = reference::forward(&cfg, &w, &toks, 0);
    let mut failures = Vec::new();
    for sel in
        ["", "fused=all", "fused=prenorm,gqa", "fused=qkv_proj,rope,o_proj", "fused=all;naive=mlp@1,rope@0"]
    {
        let b = Backends::parse(sel).unwrap();
        let c = compare(&hidden(&ctx, &mut model, &toks, &b), &expected);
        println!("`{sel}`: {c}");
        if !c.passes(MODEL_TOL) {
            failures.push(format!("`{sel}`: {c}"));
        }
    }
    assert!(model.fallbacks().is_empty(), "{:?}", model.fallbacks());
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_checkpoint_loaded_straight_from_its_files_is_the_model_of_its_host_weights() {
    let ctx = gpu();
    let dir = tempfile::tempdir().unwrap();
    let toks = tokens(2, 9, LlamaConfig::tiny().vocab, 3);
    let b = Backends::all(Backend::Fused);
    for tied in [false, true] {
        let mut cfg = LlamaConfig::tiny();
        cfg.tie_embeddings = tied;
        let w = Weights::<f32>::random(&cfg, 4);
        for dtype in [DataType::BF16, DataType::F32] {
            let file = dir.path().join(format!("{dtype}-{tied}.safetensors"));
            w.save(&cfg, &file, dtype).unwrap();
            let host = Weights::<bf16>::load(&cfg, &file).unwrap();
            let want = hidden(&ctx, &mut Llama::new(&ctx, &cfg, &host, 64).unwrap(), &toks, &b);
            let got = hidden(&ctx, &mut Llama::<bf16>::load(&ctx, &cfg, &file, 64).unwrap(), &toks, &b);
            assert!(want.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()), "{dtype}, tied {tied}");
        }
    }
    // A tensor of the wrong shape is refused from the headers, before any upload.
    let cfg = LlamaConfig::tiny();
    let file = dir.path().join("bad.safetensors");
    let mut other = cfg.clone();
    other.heads /= 2;
    Weights::<f32>::random(&other, 4).save(&other, &file, DataType::BF16).unwrap();
    let e = Llama::<bf16>::load(&ctx, &cfg, &file, 64).err().expect("a mis-shaped checkpoint").to_string();
    assert!(e.contains("has shape") && e.contains("expected"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_and_naive_agree_on_the_1b_preset() {
    let ctx = gpu();
    let cfg = LlamaConfig::llama_3_2_1b();
    let w = Weights::<bf16>::random(&cfg, 2);
    let mut model = Llama::new(&ctx, &cfg, &w, 256).unwrap();
    let toks = tokens(2, 100, cfg.vocab, 11);
    let naive = hidden(&ctx, &mut model, &toks, &Backends::all(Backend::Naive));
    let naive: Vec<f64> = naive.iter().map(|v| v.to_f64()).collect();
    let fused = hidden(&ctx, &mut model, &toks, &Backends::all(Backend::Fused));
    let c = compare(&fused, &naive);
    println!("1B fused vs naive: {c}");
    // Each kind fused alone and each kind left naive, so that a failure names the module (this is how
    // cuDNN 9.14's need for a workspace zeroed before every execution showed).
    let mut alone = Vec::new();
    for kind in ModuleKind::ALL {
        let b = Backends::all(Backend::Naive).with(kind, Backend::Fused);
        let c = compare(&hidden(&ctx, &mut model, &toks, &b), &naive);
        println!("only {} fused: {c}", kind.name());
        alone.push((kind.name(), c));
        let b = Backends::all(Backend::Fused).with(kind, Backend::Naive);
        let c = compare(&hidden(&ctx, &mut model, &toks, &b), &naive);
        println!("all but {} fused: {c}", kind.name());
        alone.push((kind.name(), c));
    }
    assert!(c.passes(MODEL_TOL), "all fused: {c}; alone: {alone:?}");
    for (kind, c) in &alone {
        assert!(c.passes(MODEL_TOL), "{kind} fused alone or left naive alone: {c}");
    }
    assert!(model.fallbacks().is_empty(), "{:?}", model.fallbacks());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_then_decode_equals_a_full_forward() {
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 3);
    let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
    let (batch, prompt, steps) = (2, 6, 4);
    let all = tokens(batch, prompt + steps, cfg.vocab, 9);
    let expected = reference::forward(&cfg, &w, &all, 0);
    let h = cfg.hidden;
    for sel in ["", "fused=all"] {
        let b = Backends::parse(sel).unwrap();
        let mut cache = model.cache(&ctx, batch, prompt + steps).unwrap();
        let first: Vec<Vec<u32>> = all.iter().map(|t| t[..prompt].to_vec()).collect();
        model.forward(&ctx, &first, &mut cache, &b, &mut NoObserver).unwrap();
        for s in prompt..prompt + steps {
            let step: Vec<Vec<u32>> = all.iter().map(|t| vec![t[s]]).collect();
            let out = ctx
                .stream()
                .clone_dtoh(model.forward(&ctx, &step, &mut cache, &b, &mut NoObserver).unwrap())
                .unwrap();
            for bi in 0..batch {
                let row = &out[bi * h..][..h];
                let want = &expected[(bi * (prompt + steps) + s) * h..][..h];
                let c = compare(row, want);
                assert!(c.passes(MODEL_TOL), "`{sel}` sequence {bi} position {s}: {c}");
            }
        }
        assert_eq!(cache.uniform_len(), Some(prompt + steps));
        assert!(
            model.forward(&ctx, &[vec![1], vec![2]], &mut cache, &b, &mut NoObserver).is_err(),
            "cache full"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unsupported_fused_modules_fall_back_and_say_why() {
    let ctx = gpu();
    // Head dim 264 is past every GPU's fused-attention limit: attention must fall back, once per shape.
    let mut cfg = LlamaConfig::tiny();
    (cfg.name, cfg.heads, cfg.kv_heads, cfg.head_dim) = ("wide-heads".into(), 2, 1, 264);
    let w = Weights::<bf16>::random(&cfg, 4);
    let mut model = Llama::new(&ctx, &cfg, &w, 32).unwrap();
    let toks = tokens(1, 8, cfg.vocab, 1);
    let expected = reference::forward(&cfg, &w, &toks, 0);
    for _ in 0..2 {
        let c = compare(&hidden(&ctx, &mut model, &toks, &Backends::all(Backend::Fused)), &expected);
        assert!(c.passes(MODEL_TOL), "{c}");
    }
    let f = model.fallbacks();
    assert_eq!(f.len(), cfg.layers, "one record per layer, not per call: {f:?}");
    assert!(f.iter().all(|f| f.range == "fwd.layer.attn.gqa" && f.reason.contains("head_dim 264")), "{f:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_prefill_uses_the_bottom_right_mask_and_logits_match() {
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 6);
    let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
    let (batch, first, chunk) = (2, 6, 4);
    let all = tokens(batch, first + chunk, cfg.vocab, 13);
    let expected = reference::forward(&cfg, &w, &all, 0);
    let h = cfg.hidden;
    for sel in ["", "fused=all"] {
        let b = Backends::parse(sel).unwrap();
        let mut cache = model.cache(&ctx, batch, first + chunk).unwrap();
        let head: Vec<Vec<u32>> = all.iter().map(|t| t[..first].to_vec()).collect();
        let tail: Vec<Vec<u32>> = all.iter().map(|t| t[first..].to_vec()).collect();
        model.forward(&ctx, &head, &mut cache, &b, &mut NoObserver).unwrap();
        // Four queries against ten keys: the bottom-right causal mask.
        let out = ctx
            .stream()
            .clone_dtoh(model.forward(&ctx, &tail, &mut cache, &b, &mut NoObserver).unwrap())
            .unwrap();
        let mut want = Vec::new();
        for bi in 0..batch {
            want.extend_from_slice(&expected[(bi * (first + chunk) + first) * h..][..chunk * h]);
        }
        let c = compare(&out[..batch * chunk * h], &want);
        println!("`{sel}` chunk: {c}");
        assert!(c.passes(MODEL_TOL), "`{sel}` chunk: {c}");
        // Logits of the chunk's rows against the reference's (from the same bf16 weights).
        let logits = ctx
            .stream()
            .clone_dtoh(&model.logits(&ctx, batch * chunk, &b, &mut NoObserver).unwrap())
            .unwrap();
        let want_logits = reference::logits(&cfg, &w, &want);
        let c = compare(&logits, &want_logits);
        assert!(c.passes(MODEL_TOL), "`{sel}` logits: {c}");
        assert!(
            model.logits(&ctx, batch * chunk + 1, &b, &mut NoObserver).is_err(),
            "rows past the last forward"
        );
    }
}

/// A captured decode step on `cache`, or `None` (said why) on a cuDNN without run-time sequence
/// lengths (before 9.15), where no decode step captures.
fn capture(
    ctx: &Cudnn,
    model: &mut Llama<bf16>,
    cache: &mut KvCache<bf16>,
    backends: &Backends,
) -> Option<DecodeGraph<bf16>> {
    // SAFETY: the tests that capture use one thread and no other stream.
    match unsafe { model.capture_decode(ctx, cache, backends) } {
        Ok(g) => Some(g),
        Err(e) if ctx.info().cudnn_version < 91500 => {
            println!("cuDNN < 9.15 has no run-time sequence lengths: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn captured_decode_steps_replay_at_every_position() {
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 8);
    let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
    let (batch, prompt, steps) = (2, 7, 6);
    let all = tokens(batch, prompt + steps, cfg.vocab, 17);
    let expected = reference::forward(&cfg, &w, &all, 0);
    let fused = Backends::all(Backend::Fused);
    let h = cfg.hidden;
    let head: Vec<Vec<u32>> = all.iter().map(|t| t[..prompt].to_vec()).collect();
    let step = |s: usize| -> Vec<u32> { all.iter().map(|t| t[s]).collect() };
    // Plain launches on one cache, graph replays on another, from the same prefill.
    let mut plain = model.cache(&ctx, batch, prompt + steps).unwrap();
    let mut replay = model.cache(&ctx, batch, prompt + steps).unwrap();
    model.forward(&ctx, &head, &mut plain, &fused, &mut NoObserver).unwrap();
    model.forward(&ctx, &head, &mut replay, &fused, &mut NoObserver).unwrap();
    // Position `prompt` plainly on both (builds the decode plan outside the capture), then capture.
    for cache in [&mut plain, &mut replay] {
        let one: Vec<Vec<u32>> = step(prompt).iter().map(|&t| vec![t]).collect();
        model.forward(&ctx, &one, cache, &fused, &mut NoObserver).unwrap();
        model.logits(&ctx, batch, &fused, &mut NoObserver).unwrap();
    }
    let Some(mut graph) = capture(&ctx, &mut model, &mut replay, &fused) else { return };
    assert_eq!(replay.uniform_len(), Some(prompt + 1), "a capture runs nothing");
    assert!(model.decode(&ctx, &mut graph, &step(prompt + 1), &mut plain).is_err(), "another cache");
    for s in prompt + 1..prompt + steps {
        let one: Vec<Vec<u32>> = step(s).iter().map(|&t| vec![t]).collect();
        let p = ctx
            .stream()
            .clone_dtoh(model.forward(&ctx, &one, &mut plain, &fused, &mut NoObserver).unwrap())
            .unwrap();
        let p_logits =
            ctx.stream().clone_dtoh(&model.logits(&ctx, batch, &fused, &mut NoObserver).unwrap()).unwrap();
        let r_logits =
            ctx.stream().clone_dtoh(model.decode(&ctx, &mut graph, &step(s), &mut replay).unwrap()).unwrap();
        // The replay leaves the hidden states where a forward does.
        let r =
            ctx.stream().clone_dtoh(&model.logits(&ctx, batch, &fused, &mut NoObserver).unwrap()).unwrap();
        assert_eq!(p_logits, r_logits, "position {s}: replayed logits differ from plain launches");
        assert_eq!(r, r_logits, "position {s}: logits after the replay differ from the graph's");
        let want: Vec<f64> =
            (0..batch).flat_map(|bi| expected[(bi * (prompt + steps) + s) * h..][..h].to_vec()).collect();
        let c = compare(&p[..batch * h], &want);
        assert!(c.passes(MODEL_TOL), "position {s} (plain, device positions): {c}");
    }
    assert_eq!(replay.uniform_len(), Some(prompt + steps));
    assert!(model.decode(&ctx, &mut graph, &step(0), &mut replay).is_err(), "cache full");
    // A naive step takes its position from the host: no graph.
    let naive = Backends::all(Backend::Naive);
    let mut other = model.cache(&ctx, batch, prompt + steps).unwrap();
    model.forward(&ctx, &head, &mut other, &naive, &mut NoObserver).unwrap();
    // SAFETY: this test uses one thread and no other stream.
    let e = unsafe { model.capture_decode(&ctx, &mut other, &naive) }.unwrap_err().to_string();
    assert!(e.contains("position from the host"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_fusion_folds_launches_and_keeps_the_hidden_states() {
    // Batch 1, one-token fused steps with each DecodeFusion: the hidden states match the f64 forward
    // and the unfused steps', and the folded forms did run (the decode GEMV's kernel list names them).
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 9);
    let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
    let (prompt, steps, h) = (7, 5, cfg.hidden);
    let all = tokens(1, prompt + steps, cfg.vocab, 23);
    let expected = reference::forward(&cfg, &w, &all, 0);
    let fused = Backends::all(Backend::Fused);
    // The one-token forms' kernels; RoPE folds where the steps read their positions on the device
    // (the padded attention plan: cuDNN 9.15+).
    const FORMS: [&str; 5] = ["_m1_norm", "_m1_dual", "_m1_norm_dual", "_m1_rope", "_m1_norm_rope"];
    // Calls of each form so far: either split (warp or block) of it, or its deep tile (the rotary
    // forms where the grid has few row pairs per SM).
    let form_runs = |ctx: &Cudnn| -> Vec<u64> {
        let runs = |name: String| -> u64 {
            ctx.kernel_runs().iter().filter(|r| r.name.contains(&name)).map(|r| r.calls).sum()
        };
        FORMS.iter().map(|f| ["", "_block", "_u4"].iter().map(|t| runs(format!("{f}{t})"))).sum()).collect()
    };
    let device_positions = ctx.features().sdpa_seq_lens();
    let mut unfused: Vec<Vec<bf16>> = Vec::new();
    let mut layer_runs_before = 0u64;
    for fusion in DecodeFusion::EVERY {
        model.set_decode_fusion(fusion);
        let before: Vec<u64> = form_runs(&ctx);
        let mut cache = model.cache(&ctx, 1, prompt + steps).unwrap();
        model.forward(&ctx, &[all[0][..prompt].to_vec()], &mut cache, &fused, &mut NoObserver).unwrap();
        for s in prompt..prompt + steps {
            let out = model.forward(&ctx, &[vec![all[0][s]]], &mut cache, &fused, &mut NoObserver).unwrap();
            let mut got = ctx.stream().clone_dtoh(out).unwrap();
            got.truncate(h);
            let c = compare(&got, &expected[s * h..(s + 1) * h]);
            println!("{} position {s}: vs f64 forward {c}", fusion.name());
            assert!(c.passes(MODEL_TOL), "{} position {s}: {c}", fusion.name());
            if fusion == DecodeFusion::NONE {
                unfused.push(got);
            } else {
                let base: Vec<f64> = unfused[s - prompt].iter().map(|v| v.to_f64()).collect();
                let c = compare(&got, &base);
                println!("{} position {s}: vs unfused steps {c}", fusion.name());
                assert!(c.passes(MODEL_TOL), "{} position {s} vs unfused: {c}", fusion.name());
            }
        }
        let after: Vec<u64> = form_runs(&ctx);
        let ran: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        println!("{}: fused-form launches {FORMS:?}: {ran:?}", fusion.name());
        let l = (cfg.layers * steps) as u64;
        // The whole layer in one launch runs none of the GEMV forms in the layers (the decode
        // layer's kernel instead, once per layer and step).
        let whole = fusion.whole_layer && device_positions;
        let layer_runs: u64 =
            ctx.kernel_runs().iter().filter(|r| r.name.starts_with("decode layer")).map(|r| r.calls).sum();
        assert_eq!(
            layer_runs - layer_runs_before,
            if whole { l } else { 0 },
            "{}: decode layer launches",
            fusion.name()
        );
        layer_runs_before = layer_runs;
        let (norm, gate_up) = (fusion.norm_into_projection && !whole, fusion.gate_up && !whole);
        let rope = fusion.rope_into_qkv && device_positions && !whole;
        // qkv_proj: norm, rope or norm_rope; the MLP: up and gate each with the norm, dual or norm_dual.
        let want = vec![
            if norm && !rope { l } else { 0 } + if norm && !gate_up { 2 * l } else { 0 },
            if gate_up && !norm { l } else { 0 },
            if gate_up && norm { l } else { 0 },
            if rope && !norm { l } else { 0 },
            if rope && norm { l } else { 0 },
        ];
        assert_eq!(ran, want, "{}: fused-form launches {FORMS:?}", fusion.name());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn both_decode_attentions_give_the_reference_hidden_states_plain_and_replayed() {
    // Batch 2, fused decode steps with cuDNN's padded plan and with the split-KV kernel (launched
    // programmatically where the GPU has it, after the RoPE kernel that appends the step's K and V),
    // each on a fresh context: plain steps match the f64 forward, replayed steps give the plain
    // steps' logits, the two choices agree, and only the cuDNN choice built a one-query plan.
    use cudnn_llm::cudnn_ops::DecodeAttention;
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 10);
    let (batch, prompt, steps, h) = (2, 9, 6, cfg.hidden);
    let all = tokens(batch, prompt + steps, cfg.vocab, 31);
    let expected = reference::forward(&cfg, &w, &all, 0);
    let fused = Backends::all(Backend::Fused);
    let step = |s: usize| -> Vec<u32> { all.iter().map(|t| t[s]).collect() };
    let one = |s: usize| -> Vec<Vec<u32>> { step(s).iter().map(|&t| vec![t]).collect() };
    let head: Vec<Vec<u32>> = all.iter().map(|t| t[..prompt].to_vec()).collect();
    let mut hidden_by_choice: Vec<Vec<Vec<bf16>>> = Vec::new();
    for choice in [DecodeAttention::Cudnn, DecodeAttention::SplitKv] {
        let ctx = gpu();
        ctx.set_decode_attention(choice);
        let name = choice.name();
        let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
        let mut plain = model.cache(&ctx, batch, prompt + steps).unwrap();
        let mut replay = model.cache(&ctx, batch, prompt + steps).unwrap();
        for cache in [&mut plain, &mut replay] {
            model.forward(&ctx, &head, cache, &fused, &mut NoObserver).unwrap();
            // Position `prompt` plainly on both: plans built outside the capture.
            model.forward(&ctx, &one(prompt), cache, &fused, &mut NoObserver).unwrap();
            model.logits(&ctx, batch, &fused, &mut NoObserver).unwrap();
        }
        let Some(mut graph) = capture(&ctx, &mut model, &mut replay, &fused) else { return };
        let mut hidden = Vec::new();
        for s in prompt + 1..prompt + steps {
            let out = model.forward(&ctx, &one(s), &mut plain, &fused, &mut NoObserver).unwrap();
            let p = ctx.stream().clone_dtoh(out).unwrap();
            let want: Vec<f64> =
                (0..batch).flat_map(|bi| expected[(bi * (prompt + steps) + s) * h..][..h].to_vec()).collect();
            let c = compare(&p[..batch * h], &want);
            println!("{name} position {s}: plain vs f64 forward {c}");
            assert!(c.passes(MODEL_TOL), "{name} position {s}: {c}");
            hidden.push(p[..batch * h].to_vec());
            let p_logits = ctx
                .stream()
                .clone_dtoh(&model.logits(&ctx, batch, &fused, &mut NoObserver).unwrap())
                .unwrap();
            let r_logits = ctx
                .stream()
                .clone_dtoh(model.decode(&ctx, &mut graph, &step(s), &mut replay).unwrap())
                .unwrap();
            let base: Vec<f64> = p_logits.iter().map(|v| v.to_f64()).collect();
            let c = compare(&r_logits, &base);
            assert!(c.passes(MODEL_TOL), "{name} position {s}: replayed vs plain logits {c}");
        }
        let one_query = ctx
            .cache()
            .plans()
            .iter()
            .filter(|p| p.name().starts_with("sdpa") && p.name().contains(" sq1 "))
            .count();
        println!("{name}: one-query attention plans {one_query}");
        match choice {
            DecodeAttention::SplitKv => assert_eq!(one_query, 0, "the split-KV kernel needs no plan"),
            _ => assert!(one_query > 0, "cuDNN's padded plan did not run"),
        }
        hidden_by_choice.push(hidden);
    }
    for (i, (a, b)) in hidden_by_choice[0].iter().zip(&hidden_by_choice[1]).enumerate() {
        let base: Vec<f64> = a.iter().map(|v| v.to_f64()).collect();
        let c = compare(b, &base);
        println!("position {}: split-KV vs cuDNN {c}", prompt + 1 + i);
        assert!(c.passes(MODEL_TOL), "position {}: split-KV vs cuDNN {c}", prompt + 1 + i);
    }
}

/// A model, cache or page pool that cannot fit the GPU is an `OutOfMemory` error with both sizes,
/// raised before it allocates (free memory as before), and the context stays usable.
#[test]
#[ignore = "needs a CUDA GPU"]
fn what_does_not_fit_is_an_error_before_it_allocates() {
    use cudnn_llm::cudnn_ops::{Error as OpsError, KvCache as OpsKvCache, KvCacheShape, PagedKvCache};
    use cudnn_llm::cudnn_ops::{PageOrder, PageShape, PagedKvShape};
    use cudnn_llm::llama::Error;
    let ctx = gpu();
    let out_of_memory = |what: &str, e: Error| match e {
        Error::Ops(OpsError::OutOfMemory { what: w, needed, free }) => {
            println!("{what}: {w}: needs {needed} bytes, {free} free");
            assert!(needed > free, "{what}");
        }
        other => panic!("{what}: not OutOfMemory: {other}"),
    };
    // Llama-3.1-70B's shapes at 100 layers (174 GB of bf16 weights; the 80-layer model's 141 GB fit an
    // H200's 150 GB) on one GPU: refused before a weight is made.
    let (free_before, total) = ctx.memory_info().unwrap();
    println!("{} of {} bytes free", free_before, total);
    let big = LlamaConfig::llama_3_1_70b().with_layers(100);
    assert!(big.parameters() * 2 > total, "a GPU of {total} bytes holds this test's model");
    let e = Llama::<bf16>::ensure_fits(&ctx, &big, 4096).unwrap_err();
    out_of_memory("70B shapes, 100 layers", e);
    // A model that fits, then a KV cache of 512 x 131072 positions (550 GB) for it.
    let cfg = LlamaConfig::llama_3_1_8b().with_layers(2);
    let mut model = Llama::new(&ctx, &cfg, &Weights::<bf16>::random(&cfg, 1), 131072).unwrap();
    let free = ctx.memory_info().unwrap().0;
    out_of_memory("cache", model.cache(&ctx, 512, 131072).err().expect("a 550 GB cache"));
    // The library's caches, contiguous and paged.
    let shape = KvCacheShape::new(32, 64, 1 << 20, 8, 128).unwrap();
    out_of_memory(
        "ops cache",
        Error::Ops(OpsKvCache::<bf16>::new(&ctx, shape).err().expect("an 8.8 TB cache")),
    );
    let pages = PageShape::new(1 << 22, 16, 8, 128, PageOrder::HeadMajor).unwrap();
    let paged = PagedKvShape::new(32, 64, 4096, pages).unwrap();
    out_of_memory("paged", Error::Ops(PagedKvCache::<bf16>::new(&ctx, paged).err().expect("a 2.2 TB pool")));
    let after = ctx.memory_info().unwrap().0;
    assert!(after + (64 << 20) >= free, "the refused allocations took memory: {free} -> {after}");
    // The context and the model still work: a cache that fits, and a forward.
    let mut cache = model.cache(&ctx, 1, 64).unwrap();
    let toks = tokens(1, 8, cfg.vocab, 3);
    let fused = Backends::parse("fused=all").unwrap();
    let out = model.forward(&ctx, &toks, &mut cache, &fused, &mut NoObserver).unwrap();
    let h = ctx.stream().clone_dtoh(out).unwrap();
    assert!(h[..8 * cfg.hidden].iter().all(|v| v.is_finite()));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_projections_match_the_reference_over_their_dequantized_weights() {
    fp8_projections_match_the_reference(WeightScales::PerChannel);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_projections_with_one_factor_per_tensor_match_the_reference() {
    fp8_projections_match_the_reference(WeightScales::PerTensor);
}

fn fp8_projections_match_the_reference(scales: WeightScales) {
    // Prefill (fused: the activations quantized per token, or per tensor for per-tensor weights, and
    // FP8 GEMMs; naive: the weights dequantized and cuBLAS) and decode steps (the GEMV streaming the
    // codes in every fold, plain and replayed) against the f64 forward over the weights the FP8 model
    // multiplies by.
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 21);
    let mut model = Llama::new(&ctx, &cfg, &w, 64).unwrap();
    let bf16_bytes = model.linear_weight_bytes();
    model.quantize_to_fp8(&ctx, scales).unwrap();
    model.quantize_to_fp8(&ctx, scales).unwrap();
    assert!(model.linear_weight_bytes() * 2 < bf16_bytes + bf16_bytes / 4, "{}", model.linear_weight_bytes());
    let fp8 = w.fp8_dequantized(scales);
    let (batch, prompt, steps) = (2, 6, 4);
    let all = tokens(batch, prompt + steps, cfg.vocab, 13);
    let expected = reference::forward(&cfg, &fp8, &all, 0);
    // The bf16 reference is further away than the tolerance would hide: the test can tell FP8 from bf16.
    let bf = reference::forward(&cfg, &w, &all, 0);
    println!(
        "bf16 vs dequantized FP8 weights (f64 forwards): {}",
        compare(&bf.iter().map(|&v| v as f32).collect::<Vec<_>>(), &expected)
    );
    let h = cfg.hidden;
    let mut failures = Vec::new();
    for sel in ["", "fused=all"] {
        let b = Backends::parse(sel).unwrap();
        let tol = if sel.is_empty() { MODEL_TOL } else { FP8_ACTIVATIONS_TOL };
        for fusion in [DecodeFusion::NONE, DecodeFusion::ALL] {
            model.set_decode_fusion(fusion);
            let mut cache = model.cache(&ctx, batch, prompt + steps).unwrap();
            let first: Vec<Vec<u32>> = all.iter().map(|t| t[..prompt].to_vec()).collect();
            let out = ctx
                .stream()
                .clone_dtoh(model.forward(&ctx, &first, &mut cache, &b, &mut NoObserver).unwrap())
                .unwrap();
            for bi in 0..batch {
                for s in 0..prompt {
                    let c = compare(
                        &out[(bi * prompt + s) * h..][..h],
                        &expected[(bi * (prompt + steps) + s) * h..][..h],
                    );
                    if !c.passes(tol) {
                        failures.push(format!("`{sel}` {} prefill {bi}/{s}: {c}", fusion.name()));
                    }
                }
            }
            for s in prompt..prompt + steps {
                let step: Vec<Vec<u32>> = all.iter().map(|t| vec![t[s]]).collect();
                let out = ctx
                    .stream()
                    .clone_dtoh(model.forward(&ctx, &step, &mut cache, &b, &mut NoObserver).unwrap())
                    .unwrap();
                for bi in 0..batch {
                    let c = compare(&out[bi * h..][..h], &expected[(bi * (prompt + steps) + s) * h..][..h]);
                    println!("`{sel}` {} step {bi}/{s}: {c}", fusion.name());
                    if !c.passes(tol) {
                        failures.push(format!("`{sel}` {} step {bi}/{s}: {c}", fusion.name()));
                    }
                }
            }
        }
    }
    model.set_decode_fusion(DecodeFusion::default());
    assert!(model.fallbacks().is_empty(), "{:?}", model.fallbacks());
    assert!(failures.is_empty(), "{failures:#?}");
    // One sequence, replayed steps against plain ones: the same logits bit for bit.
    let fused = Backends::all(Backend::Fused);
    let one = tokens(1, prompt + steps, cfg.vocab, 17);
    let mut plain = Vec::new();
    let mut cache = model.cache(&ctx, 1, prompt + steps + 1).unwrap();
    model.forward(&ctx, &[one[0][..prompt].to_vec()], &mut cache, &fused, &mut NoObserver).unwrap();
    for &id in &one[0][prompt..] {
        model.forward(&ctx, &[vec![id]], &mut cache, &fused, &mut NoObserver).unwrap();
        plain
            .push(ctx.stream().clone_dtoh(&model.logits(&ctx, 1, &fused, &mut NoObserver).unwrap()).unwrap());
    }
    cache.truncate_to(prompt);
    let Some(mut graph) = capture(&ctx, &mut model, &mut cache, &fused) else { return };
    cache.truncate_to(prompt);
    for (i, s) in (prompt..prompt + steps).enumerate() {
        let logits = model.decode(&ctx, &mut graph, &[one[0][s]], &mut cache).unwrap();
        let replayed = ctx.stream().clone_dtoh(logits).unwrap();
        let same = replayed.iter().zip(&plain[i]).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
        assert_eq!(same, replayed.len().min(plain[i].len()), "step {s}: replayed vs plain logits");
    }
}
