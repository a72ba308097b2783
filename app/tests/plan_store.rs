//! Persistent plans on the GPU: plans built and autotuned by one context, saved to a plan directory,
//! loaded by a new context (no heuristics, no autotuning) and giving the same bits; a damaged file
//! rebuilt with an event; the plan directory chosen by the environment variable; and the time to a
//! first fused forward with a cold and a warm plan directory. Every plan directory is a temporary one,
//! never the user's cache. The file format, its checks and the atomic write are tested without a GPU
//! in `cudnn-llm-ops` (`plan::store`). GPU tests are ignored by default; run them with
//! `--include-ignored` on a GPU machine.

use cudnn_llm::cudnn_ops::cudarc::driver::CudaSlice;
use cudnn_llm::cudnn_ops::{
    matmul, reference, rms_norm, sdpa, Backend, CacheStats, Cudnn, DataType, DiskEventKind, Layout, Mask,
    MatmulArgs, MatmulOperands, PlanOrigin, RmsNormArgs, RmsNormOperands, SdpaArgs, SdpaOperands,
    PLAN_DIR_ENV,
};
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{Backends, Generator, Llama, LlamaConfig};
use cudnn_llm_app::bench_util::{download, gpu, poisoned, upload};
use half::bf16;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A fresh directory under the system's temporary directory, removed on drop.
fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("cudnn-llm-plans-{tag}-")).tempdir().unwrap()
}

/// A context keeping its plans in `dir`.
fn context(dir: &Path) -> Cudnn {
    let ctx = gpu();
    ctx.set_plan_dir(Some(dir));
    assert_eq!(ctx.plan_dir().as_deref(), Some(dir));
    ctx
}

/// The `.plan` files of `dir`.
fn plan_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "plan"))
        .collect();
    files.sort();
    files
}

/// One op on fixed inputs: its output's bits (bf16 as u16).
type Op = fn(&Cudnn) -> Vec<u16>;

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// An autotuned matmul (the context's default candidates), Llama's q/k/v projection shape.
fn run_matmul(ctx: &Cudnn) -> Vec<u16> {
    let args = MatmulArgs::linear(128, 2048, 3072);
    let (a, _) = upload::<bf16>(ctx, &reference::random_values(1, args.a.min_elements().unwrap())).unwrap();
    let scaled: Vec<f64> =
        reference::random_values(2, args.b.min_elements().unwrap()).iter().map(|v| v / 45.0).collect();
    let (b, _) = upload::<bf16>(ctx, &scaled).unwrap();
    let mut d = poisoned::<bf16>(ctx, args.d_len()).unwrap();
    matmul::<bf16, bf16, bf16>(ctx, &args, MatmulOperands::new(&a, &b, &mut d), Backend::Fused).unwrap();
    bits(&download(ctx, &d).unwrap())
}

const EPS: f32 = 1e-5;
const NORM: (usize, usize) = (128, 2048);

/// RMSNorm's x and weight on the device, and the f64 reference of y.
fn norm_inputs(ctx: &Cudnn) -> (CudaSlice<bf16>, CudaSlice<bf16>, Vec<f64>) {
    let (tokens, hidden) = NORM;
    let (x, xr) = upload::<bf16>(ctx, &reference::random_values(3, tokens * hidden)).unwrap();
    let (w, wr) = upload::<bf16>(ctx, &reference::random_values(4, hidden)).unwrap();
    let (y, _) = reference::rms_norm(&xr, &wr, tokens, hidden, EPS as f64);
    (x, w, y)
}

fn run_norm(ctx: &Cudnn) -> Vec<u16> {
    let (x, w, _) = norm_inputs(ctx);
    let mut y = poisoned::<bf16>(ctx, NORM.0 * NORM.1).unwrap();
    rms_norm(
        ctx,
        RmsNormArgs::new(NORM.0, NORM.1, EPS),
        RmsNormOperands::new(&x, &w, &mut y),
        Backend::Fused,
    )
    .unwrap();
    bits(&download(ctx, &y).unwrap())
}

/// Causal grouped-query attention, Llama-3.2-1B's heads.
fn run_sdpa(ctx: &Cudnn) -> Vec<u16> {
    let a = SdpaArgs::new(1, 32, 8, 128, 128, 64, Layout::Bshd).with_mask(Mask::CausalTopLeft);
    let q_len = 128 * 32 * 64;
    let kv_len = 128 * 8 * 64;
    let (q, _) = upload::<bf16>(ctx, &reference::random_values(5, q_len)).unwrap();
    let (k, _) = upload::<bf16>(ctx, &reference::random_values(6, kv_len)).unwrap();
    let (v, _) = upload::<bf16>(ctx, &reference::random_values(7, kv_len)).unwrap();
    let mut o = poisoned::<bf16>(ctx, q_len).unwrap();
    sdpa(ctx, a, SdpaOperands::new(&q, &k, &v, &mut o), Backend::Fused).unwrap();
    bits(&download(ctx, &o).unwrap())
}

/// Each op in a context that builds (and autotunes) its plans and saves them, then in a new context
/// on the same directory that loads them: the disk-hit counter moves, no plan is built or timed, and
/// the output has the same bits (where the engine is deterministic: two runs of the fresh plan agree).
/// Plans come back through their JSON where cuDNN serializes the engine, else through their stored
/// engine choice; at least one of the three must come through its JSON.
#[test]
#[ignore = "needs a CUDA GPU"]
fn plans_saved_by_one_context_load_in_the_next_with_the_same_bits() {
    let ops: [(&str, Op); 3] = [("matmul", run_matmul), ("rmsnorm", run_norm), ("sdpa", run_sdpa)];
    let (mut failures, mut origins, mut deserialized) = (Vec::new(), Vec::new(), false);
    for (name, op) in ops {
        let dir = temp_dir(name);
        let (fresh, fresh_again, built) = {
            let ctx = context(dir.path());
            let t = Instant::now();
            let fresh = op(&ctx);
            let built = t.elapsed();
            let again = op(&ctx);
            let s = ctx.cache().stats();
            assert_eq!((s.disk_hits, s.disk_rejects), (0, 0), "{name}: a fresh directory: {s:?}");
            assert!(s.disk_misses >= 1 && s.disk_writes == s.disk_misses, "{name}: every plan saved: {s:?}");
            for p in ctx.cache().plans() {
                assert_eq!(p.origin(), PlanOrigin::Built, "{name}");
                println!(
                    "{name}: built {} ({}; {} candidates timed)",
                    p.name(),
                    p.engine(),
                    p.timings().len()
                );
            }
            (fresh, again, built)
        };
        let files = plan_files(dir.path());
        assert!(!files.is_empty(), "{name}: no plan file in {}", dir.path().display());
        let ctx = context(dir.path());
        let t = Instant::now();
        let loaded = op(&ctx);
        let load = t.elapsed();
        let s = ctx.cache().stats();
        println!("{name}: first call {built:?} building, {load:?} loading; {s:?}");
        assert_eq!(s.disk_hits, s.misses, "{name}: every miss loaded from disk: {s:?}");
        assert_eq!((s.disk_rejects, s.disk_writes), (0, 0), "{name}: {s:?}");
        // A plan JSON cuDNN gave but will not take back is noted (its engine choice stands in); nothing
        // else may go wrong with a directory this test wrote.
        let events = ctx.cache().disk_events();
        println!("{name}: plan-file events: {events:?}");
        assert!(events.iter().all(|e| e.kind == DiskEventKind::Unloadable), "{name}: {events:?}");
        for p in ctx.cache().plans() {
            println!("{name}: loaded {} as {:?} ({})", p.name(), p.origin(), p.engine());
            origins.push(format!("{name} {}: {:?}", p.name(), p.origin()));
            deserialized |= p.origin() == PlanOrigin::Deserialized;
            assert_ne!(p.origin(), PlanOrigin::Built, "{name}");
            assert!(p.timings().is_empty() && p.tune_time() == Duration::ZERO, "{name}: no autotuning");
            assert_eq!(p.candidates().len(), 1, "{name}");
        }
        let differing = fresh.iter().zip(&loaded).filter(|(a, b)| a != b).count();
        if fresh == fresh_again {
            println!("{name}: loaded vs fresh: {differing} of {} elements differ", fresh.len());
            if differing != 0 {
                failures.push(format!("{name}: {differing} elements differ from the fresh plan's"));
            }
        } else {
            // A nondeterministic engine: compare the values instead.
            let f: Vec<f64> = fresh.iter().map(|&b| bf16::from_bits(b).to_f64()).collect();
            let c = reference::compare(&loaded.iter().map(|&b| bf16::from_bits(b)).collect::<Vec<_>>(), &f);
            println!("{name}: the fresh plan is not deterministic (two runs differ); loaded vs fresh: {c}");
            if !c.passes(reference::tolerance(DataType::BF16)) {
                failures.push(format!("{name}: {c}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        deserialized,
        "no plan came back through its JSON (all rebuilt from engine choices): {origins:?}"
    );
}

/// A damaged plan file is rejected with an event, the plan rebuilt (right output) and the file
/// replaced, so that the next context loads it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_damaged_plan_file_is_rebuilt_with_an_event_and_replaced() {
    let dir = temp_dir("damaged");
    let fresh = run_norm(&context(dir.path()));
    let files = plan_files(dir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&files[0], &bytes).unwrap();

    let ctx = context(dir.path());
    let (x, w, y_ref) = norm_inputs(&ctx);
    let mut y = poisoned::<bf16>(&ctx, NORM.0 * NORM.1).unwrap();
    rms_norm(
        &ctx,
        RmsNormArgs::new(NORM.0, NORM.1, EPS),
        RmsNormOperands::new(&x, &w, &mut y),
        Backend::Fused,
    )
    .unwrap();
    let out = download(&ctx, &y).unwrap();
    let c = reference::compare(&out, &y_ref);
    println!("rebuilt after a flipped byte: {c}; same bits as the first build: {}", bits(&out) == fresh);
    assert!(c.passes(reference::tolerance(DataType::BF16)), "{c}");
    let s = ctx.cache().stats();
    assert_eq!((s.disk_hits, s.disk_misses, s.disk_rejects, s.disk_writes), (0, 0, 1, 1), "{s:?}");
    let events = ctx.cache().disk_events();
    println!("{events:?}");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0].kind, &events[0].path), (DiskEventKind::Corrupt, &files[0]));
    assert!(events[0].reason.contains("checksum"), "{events:?}");
    drop(ctx);

    let ctx = context(dir.path());
    assert_eq!(run_norm(&ctx), bits(&out), "the replaced file loads and gives the rebuilt plan's bits");
    let s = ctx.cache().stats();
    assert_eq!((s.disk_hits, s.disk_rejects), (1, 0), "{s:?}");
}

/// The environment variable, read by `Cudnn::new`, in a child process of this test binary (setting
/// it here would reach the other tests' contexts): a path, `off`, and unset (off: the library
/// default). `set_plan_dir` moves and disables it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_plan_directory_follows_the_environment_variable_and_the_api() {
    let dir = temp_dir("env");
    let exe = std::env::current_exe().unwrap();
    for value in [Some(dir.path().to_str().unwrap()), Some("off"), None] {
        let mut child = std::process::Command::new(&exe);
        child.args(["--exact", "plan_dir_in_a_child_process", "--include-ignored", "--nocapture"]);
        match value {
            Some(v) => child.env(PLAN_DIR_ENV, v),
            None => child.env_remove(PLAN_DIR_ENV),
        };
        let out = child.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        println!("{PLAN_DIR_ENV}={value:?}: {}", text.lines().find(|l| l.contains("plan_dir")).unwrap_or(""));
        assert!(out.status.success() && text.contains("1 passed"), "{value:?}: {text}");
    }
    let ctx = gpu();
    ctx.set_plan_dir(Some(dir.path()));
    assert_eq!(ctx.plan_dir(), Some(dir.path().to_path_buf()));
    ctx.set_plan_dir(None);
    assert_eq!(ctx.plan_dir(), None);
    run_norm(&ctx);
    assert_eq!(ctx.cache().stats().disk_writes, 0);
    assert!(plan_files(dir.path()).is_empty());
}

/// The child of [`the_plan_directory_follows_the_environment_variable_and_the_api`]: the context's
/// plan directory is what the variable says.
#[test]
#[ignore = "needs a CUDA GPU"]
fn plan_dir_in_a_child_process() {
    let value = std::env::var(PLAN_DIR_ENV).ok();
    let expected = match value.as_deref() {
        None | Some("off") => None,
        Some(path) => Some(PathBuf::from(path)),
    };
    let ctx = gpu();
    println!("plan_dir {:?} for {PLAN_DIR_ENV}={value:?}", ctx.plan_dir());
    assert_eq!(ctx.plan_dir(), expected);
}

/// Time to the first fused forward (a 128-token prefill and a decode step, through
/// `Generator::prebuild`) of Llama-3.2-1B's shapes with 2 layers, with a cold and then a warm plan
/// directory, each in a new context; the warm run loads every plan, and both give the same logits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn first_forward_with_a_cold_and_a_warm_plan_directory() {
    let dir = temp_dir("forward");
    let cfg = LlamaConfig::llama_3_2_1b().with_layers(2);
    let weights = Weights::<bf16>::random(&cfg, 11);
    let n = 128;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % cfg.vocab as u32).collect();
    let first = |label: &str| -> (Duration, CacheStats, Vec<f32>) {
        let ctx = context(dir.path());
        let model = Llama::new(&ctx, &cfg, &weights, n + 1).unwrap();
        let mut g = Generator::new(&ctx, model, Backends::all(Backend::Fused), n + 1).unwrap();
        ctx.synchronize().unwrap();
        let t = Instant::now();
        g.prebuild(&ctx, &[n]).unwrap();
        ctx.synchronize().unwrap();
        let took = t.elapsed();
        let s = ctx.cache().stats();
        println!("{label}: first prefill of {n} tokens and decode step: {took:.2?}; {s:?}");
        for f in g.model().fallbacks() {
            println!("{label}: {} (layer {:?}) ran naive: {}", f.range, f.layer, f.reason);
        }
        (took, s, g.prefill(&ctx, &prompt).unwrap())
    };
    let (cold, cold_stats, cold_logits) = first("cold plan directory");
    let (warm, warm_stats, warm_logits) = first("warm plan directory");
    println!(
        "time to the first fused forward: {:.2} s cold, {:.3} s warm ({:.1}x); {} plan files",
        cold.as_secs_f64(),
        warm.as_secs_f64(),
        cold.as_secs_f64() / warm.as_secs_f64(),
        plan_files(dir.path()).len()
    );
    assert!(cold_stats.misses > 0 && cold_stats.disk_hits == 0, "{cold_stats:?}");
    assert_eq!(cold_stats.disk_writes, cold_stats.misses, "{cold_stats:?}");
    assert_eq!(warm_stats.disk_hits, warm_stats.misses, "the warm run loads every plan: {warm_stats:?}");
    assert_eq!(warm_stats.misses, cold_stats.misses, "{warm_stats:?}");
    let same = cold_logits.iter().zip(&warm_logits).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
    println!("logits: {same} of {} bit-identical", cold_logits.len());
    assert_eq!(same, cold_logits.len(), "the loaded plans compute what the built ones did");
}
