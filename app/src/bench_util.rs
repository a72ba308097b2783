//! Helpers shared by benches, GPU tests, reports and the binaries: timing with CUDA events, medians,
//! greedy comparisons, results files; and, re-exported from [`cudnn_llm_ops::testing`], opening the
//! GPU, random device data and poisoning.

use cudarc::driver::sys::CUevent_flags;
pub use cudnn_llm_ops::testing::{
    download, expect_untouched, gpu, gpu_or_skip, gpus_or_skip, poisoned, upload,
};
use cudnn_llm_ops::{reference, Cudnn, Element, Result};
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// Two logits closer than this × their row's RMS are a near-tie: greedy runs that should agree
/// (a request alone and in a batch, fused and naive, on one GPU and two) may part there, as bf16
/// rounds differently, and GPU tests accept a first difference at a near-tie only.
pub const NEAR_TIE: f32 = 0.1;

/// The root mean square of a row of logits (what [`NEAR_TIE`] scales).
pub fn rms(row: &[f32]) -> f32 {
    (row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32).sqrt()
}

/// One request run alone on `g` (reset first; its contiguous cache), greedy: its `n` new ids and the
/// logits each was picked from (what GPU tests and `serve-bench --check-alone` compare batched runs to).
pub fn greedy_alone<T: Element>(
    ctx: &Cudnn,
    g: &mut cudnn_llm_llama::generate::Generator<T>,
    prompt: &[u32],
    n: usize,
) -> cudnn_llm_llama::Result<(Vec<u32>, Vec<Vec<f32>>)> {
    use cudnn_llm_llama::sampling::argmax;
    g.reset();
    let mut logits = vec![g.prefill(ctx, prompt)?];
    let mut ids = vec![argmax(&logits[0])?];
    while ids.len() < n {
        let l = g.step(ctx, *ids.last().expect("at least the first id"))?;
        ids.push(argmax(&l)?);
        logits.push(l);
    }
    Ok((ids, logits))
}

/// For GPU tests: `got` against `want` (greedy ids of the same request run alone, and the logits of
/// each of its steps, as [`greedy_alone`] gives them): equal, or equal up to a first difference where
/// the alone run's top two logits are a near-tie ([`NEAR_TIE`]). Returns the failure, if any.
pub fn same_greedy_ids(tag: &str, got: &[u32], want: &[u32], logits: &[Vec<f32>]) -> Option<String> {
    let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) else {
        return (got.len() != want.len()).then(|| format!("{tag}: {} ids, alone {}", got.len(), want.len()));
    };
    let row = &logits[i];
    let gap = row[want[i] as usize] - row[got[i] as usize];
    println!(
        "{tag}: first difference at new id {i}: {} vs {} alone, logit gap {gap} (rms {})",
        got[i],
        want[i],
        rms(row)
    );
    (gap > NEAR_TIE * rms(row))
        .then(|| format!("{tag}: new id {i} is {}, alone {} (gap {gap}, rms {})", got[i], want[i], rms(row)))
}

/// For batching-engine GPU tests: ends each request of `handles` (its sequence -> its index `r`) whose
/// `got[r]` holds its `outputs[r]` new ids, checking that the engine kept its prompt then exactly those
/// ids (`tag` names the run in the failure). Panics on an error, as a test does.
pub fn end_finished<T: Element>(
    engine: &mut cudnn_llm_llama::BatchEngine<T>,
    handles: &mut std::collections::HashMap<cudnn_llm_ops::SeqId, usize>,
    (prompts, got, outputs): (&[Vec<u32>], &[Vec<u32>], &[usize]),
    tag: &str,
) {
    for (id, r) in handles.clone() {
        if got[r].len() == outputs[r] {
            let all = engine.remove(id).unwrap();
            assert_eq!(all, [&prompts[r][..], &got[r][..]].concat(), "{tag} request {r}: its ids");
            handles.remove(&id);
        }
    }
}

/// A binary of this package for an integration test: where cargo built it (`cargo_path`, i.e.
/// `env!("CARGO_BIN_EXE_<name>")`), else `bin-<name>` beside the test executable, where
/// `../shared/gpu/stage` puts it (staged tests run at another path than the one cargo compiled in).
pub fn package_binary(cargo_path: &str, name: &str) -> Option<PathBuf> {
    let built = Path::new(cargo_path);
    if built.exists() {
        return Some(built.to_path_buf());
    }
    let staged = std::env::current_exe().ok()?.parent()?.join(format!("bin-{name}"));
    staged.exists().then_some(staged)
}

/// The body of a bench's `main`: opens GPU 0 and runs `run`; without a GPU it says so and returns
/// (exit 0, so `cargo bench` on a machine without one is not a failure); an error exits 1.
pub fn bench_main<E: Display>(name: &str, run: impl FnOnce(&Cudnn) -> std::result::Result<(), E>) {
    let Some(ctx) = gpu_or_skip(name) else {
        println!("{name}: no usable GPU, nothing measured");
        return;
    };
    if let Err(e) = run(&ctx) {
        eprintln!("{name} failed: {e}");
        std::process::exit(1);
    }
}

/// `line` and a newline on stderr in one write, so that the lines of processes sharing stderr (ranks
/// under a launcher) do not interleave.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// The body of a binary's `main`: `setup` (the options resolved, input read), its error a usage error
/// (exit 2); GPU 0 (a rank of a job of processes: `LOCAL_RANK`) opened, else why not (exit 1); then `run` on both, its error exiting 1. Each message
/// starts with `name: `.
pub fn tool_main<P, E: Display, F: Display>(
    name: &str,
    setup: impl FnOnce() -> std::result::Result<P, E>,
    run: impl FnOnce(&Cudnn, P) -> std::result::Result<(), F>,
) -> ExitCode {
    let plan = match setup() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(2);
        }
    };
    // A rank of a job of processes (WORLD_SIZE set) works on its own GPU, LOCAL_RANK.
    let device =
        cudnn_llm_llama::nccl::rendezvous::RankEnv::of_several().ok().flatten().map_or(0, |e| e.local_rank);
    let ctx = match Cudnn::new(device) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{name}: cannot run without a usable GPU: {e}");
            return ExitCode::from(1);
        }
    };
    match run(&ctx, plan) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::from(1)
        }
    }
}

/// `x` rounded to `digits` decimals, for result tables.
pub fn round(x: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (x * p).round() / p
}

/// Median of a sample (one definition, shared with the profile tables).
pub use cudnn_llm_llama::profile::median;

/// GPU time in milliseconds of `iters` back-to-back calls of `f`, measured with CUDA events on the
/// context's stream.
pub fn gpu_time_ms(ctx: &Cudnn, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let cuda = ctx.stream().context();
    let start = cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    start.record(ctx.stream())?;
    for _ in 0..iters {
        f()?;
    }
    end.record(ctx.stream())?;
    Ok(start.elapsed_ms(&end)? as f64)
}

/// Wall ms of one run of `f` from an idle stream to its end: synchronize, launch, synchronize.
pub fn wall_ms<E: From<cudnn_llm_ops::Error>>(
    ctx: &Cudnn,
    f: impl FnOnce() -> std::result::Result<(), E>,
) -> std::result::Result<f64, E> {
    ctx.synchronize()?;
    let t = Instant::now();
    f()?;
    ctx.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// One run of `f` from an idle stream: GPU ms between CUDA events around it, and its [`wall_ms`].
pub fn gpu_and_wall_ms<E: From<cudnn_llm_ops::Error>>(
    ctx: &Cudnn,
    f: impl FnOnce() -> std::result::Result<(), E>,
) -> std::result::Result<(f64, f64), E> {
    let cuda = ctx.stream().context();
    let events = || cuda.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(cudnn_llm_ops::Error::from);
    let (start, end) = (events()?, events()?);
    let record = |e: &cudarc::driver::CudaEvent| e.record(ctx.stream()).map_err(|e| E::from(e.into()));
    let wall = wall_ms(ctx, || {
        record(&start)?;
        f()?;
        record(&end)
    })?;
    Ok((start.elapsed_ms(&end).map_err(cudnn_llm_ops::Error::from)? as f64, wall))
}

/// Median over `reps` samples of the per-call GPU time (ms), each sample timing `batch` calls, after
/// `warmup` untimed calls.
pub fn median_call_ms(
    ctx: &Cudnn,
    warmup: usize,
    reps: usize,
    batch: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    ctx.synchronize()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        samples.push(gpu_time_ms(ctx, batch, &mut f)? / batch as f64);
    }
    Ok(median(samples))
}

/// Median host time (µs) per call of `f` over `reps` batches of `batch` calls. The device work must be
/// short enough for the GPU to keep up, so the launch queue never blocks the host.
pub fn median_host_us(
    ctx: &Cudnn,
    reps: usize,
    batch: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        ctx.synchronize()?;
        let t = Instant::now();
        for _ in 0..batch {
            f()?;
        }
        samples.push(t.elapsed().as_secs_f64() * 1e6 / batch as f64);
    }
    ctx.synchronize()?;
    Ok(median(samples))
}

/// Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of `reps` copies of
/// `bytes` bytes.
pub fn copy_bandwidth_gbps(ctx: &Cudnn, bytes: usize, reps: usize) -> Result<f64> {
    // Random non-zero values: a 4 MiB block made on the host, tiled on the device.
    const BLOCK: usize = 1 << 20;
    let n = bytes / 4;
    let block = ctx
        .stream()
        .clone_htod(&reference::to_elements::<f32>(&reference::random_values(1, BLOCK.min(n))))?;
    let mut src = ctx.stream().alloc_zeros::<f32>(n)?;
    for at in (0..n).step_by(BLOCK) {
        let len = BLOCK.min(n - at);
        ctx.stream().memcpy_dtod(&block.slice(..len), &mut src.slice_mut(at..at + len))?;
    }
    let mut dst = ctx.stream().alloc_zeros::<f32>(n)?;
    let ms = median_call_ms(ctx, 3, reps, 1, || Ok(ctx.stream().memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * bytes as f64 / (ms * 1e-3) / 1e9)
}

/// One line naming the GPU, driver, cuDNN and build, for result summaries.
pub fn environment(info: &cudnn_llm_ops::DeviceInfo) -> String {
    format!(
        "GPU {} (sm_{}{}), driver API {}, cuDNN {} ({}), build {} ({}), bindings from cuDNN {} headers.",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.driver_version,
        info.cudnn_version_string(),
        info.cudnn_library,
        crate::BUILD.git_revision,
        crate::BUILD.rustc,
        crate::BUILD.cudnn_headers
    )
}

/// Renders rows as CSV (serde field names as headers) and, from the same records, a markdown table.
pub fn csv_and_markdown<R: serde::Serialize>(
    rows: &[R],
) -> std::result::Result<(String, String), csv::Error> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in rows {
        w.serialize(r)?;
    }
    let csv = String::from_utf8(w.into_inner().map_err(|e| e.into_error())?).expect("csv writes UTF-8");
    let mut reader = csv::Reader::from_reader(csv.as_bytes());
    let mut md = String::new();
    let headers = reader.headers()?.clone();
    md.push_str(&format!("| {} |\n", headers.iter().collect::<Vec<_>>().join(" | ")));
    md.push_str(&format!("|{}\n", "---|".repeat(headers.len())));
    for record in reader.records() {
        md.push_str(&format!("| {} |\n", record?.iter().collect::<Vec<_>>().join(" | ")));
    }
    Ok((csv, md))
}

/// The workspace's `benches/results`: cargo runs a bench in its package's directory (`app/`) and says
/// so in `CARGO_MANIFEST_DIR`; a staged bench runs from the workspace root.
fn default_results_dir() -> String {
    match std::env::var("CARGO_MANIFEST_DIR") {
        Ok(app) => format!("{app}/../benches/results"),
        Err(_) => "benches/results".into(),
    }
}

/// Writes `name.csv` and `name.md` to `$BENCH_RESULTS_DIR` (default: the workspace's `benches/results`)
/// and prints where.
pub fn write_results(name: &str, csv: &str, md: &str) {
    let dir = std::env::var("BENCH_RESULTS_DIR").unwrap_or_else(|_| default_results_dir());
    std::fs::create_dir_all(&dir).ok();
    for (ext, text) in [("csv", csv), ("md", md)] {
        let path = format!("{dir}/{name}.{ext}");
        match std::fs::write(&path, text) {
            Ok(()) => println!("wrote {path}"),
            Err(e) => eprintln!("cannot write {path}: {e}"),
        }
    }
}

/// The summed negative log-likelihood (natural log, f64) of each row's target under the row's logits:
/// `Σ_r (logsumexp(logits[r]) - logits[r][targets[r]])`, rows of `vocab` values. A target outside the
/// vocabulary or a non-finite logit is an error naming the row.
pub fn next_token_nll(logits: &[f32], vocab: usize, targets: &[u32]) -> std::result::Result<f64, String> {
    if vocab == 0 || logits.len() != vocab * targets.len() {
        return Err(format!("{} logits are not {} rows of {vocab}", logits.len(), targets.len()));
    }
    let mut sum = 0.0;
    for (r, (row, &t)) in logits.chunks(vocab).zip(targets).enumerate() {
        let t = t as usize;
        if t >= vocab {
            return Err(format!("row {r}: target {t} is outside the vocabulary of {vocab}"));
        }
        if let Some(bad) = row.iter().find(|v| !v.is_finite()) {
            return Err(format!("row {r}: logit {bad}"));
        }
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        sum += lse - row[t] as f64;
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_token_nll_is_the_log_softmax_loss() {
        // Uniform logits over 4: ln 4 per row; a certain row: 0; rows checked.
        let uniform = [1.0f32; 4];
        assert!((next_token_nll(&uniform, 4, &[2]).unwrap() - 4f64.ln()).abs() < 1e-12);
        let sure = [0.0, 0.0, 100.0, 0.0];
        assert!(next_token_nll(&sure, 4, &[2]).unwrap() < 1e-40);
        let two: Vec<f32> = uniform.iter().chain(&sure).copied().collect();
        let nll = next_token_nll(&two, 4, &[0, 1]).unwrap();
        // Row 2 puts its mass on id 2, the target is 1: logsumexp ≈ 100, the loss ≈ 100.
        assert!((nll - (4f64.ln() + 100.0)).abs() < 1e-9, "{nll}");
        assert!(next_token_nll(&uniform, 4, &[4]).unwrap_err().contains("target 4 is outside"));
        assert!(next_token_nll(&[f32::NAN, 0.0], 2, &[0]).unwrap_err().contains("row 0"));
        assert!(next_token_nll(&uniform, 3, &[0]).is_err());
    }

    #[derive(serde::Serialize)]
    struct Row {
        name: &'static str,
        ms: f64,
        note: Option<f64>,
    }

    #[test]
    fn csv_and_markdown_share_the_records() {
        let rows = [Row { name: "a, b", ms: 0.5, note: None }, Row { name: "c", ms: 12.0, note: Some(1.5) }];
        let (csv, md) = csv_and_markdown(&rows).unwrap();
        assert_eq!(csv, "name,ms,note\n\"a, b\",0.5,\nc,12.0,1.5\n");
        assert_eq!(md, "| name | ms | note |\n|---|---|---|\n| a, b | 0.5 |  |\n| c | 12.0 | 1.5 |\n");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(round(0.123456, 4), 0.1235);
        assert_eq!(round(12.345, 1), 12.3);
    }
}
