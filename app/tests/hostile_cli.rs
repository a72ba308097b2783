//! Every binary against hostile command lines (huge, overflowing, negative and zero numbers, ranges
//! past the model, non-UTF-8 text): each is a usage error (exit 2) naming the option, before any GPU
//! or weight is touched, within seconds, and nothing panics. Runs with or without a GPU.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const HUGE: &str = "18446744073709551615"; // u64::MAX
const OVER: &str = "18446744073709551616"; // u64::MAX + 1

fn binary(name: &str, built: &str) -> Option<PathBuf> {
    let found = cudnn_llm_app::bench_util::package_binary(built, name);
    if found.is_none() {
        eprintln!("SKIPPED: no {name} binary where cargo built it or staged beside this test");
    }
    found
}

/// Runs `bin` with each case's arguments: exit 2, the expected text on stderr, no panic, quick.
fn expect_usage_errors(bin: &PathBuf, cases: &[(Vec<OsString>, &str)]) -> Vec<String> {
    let mut failures = Vec::new();
    for (args, want) in cases {
        let t = Instant::now();
        let out = Command::new(bin).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let line = format!("{} {args:?}: exit {:?}: {}", bin.display(), out.status.code(), err.trim());
        println!("{line}");
        if out.status.code() != Some(2) || !err.contains(want) || err.contains("panicked") {
            failures.push(format!("{line} (wanted exit 2 and `{want}`)"));
        }
        if t.elapsed() > Duration::from_secs(30) {
            failures.push(format!("{line}: took {:?}", t.elapsed()));
        }
    }
    failures
}

fn args(a: &[&str]) -> Vec<OsString> {
    a.iter().map(OsString::from).collect()
}

/// A value that is not UTF-8 (a lone 0xff byte).
fn not_utf8() -> OsString {
    OsString::from_vec(vec![b'x', 0xff])
}

#[test]
fn serve_bench() {
    let Some(bin) = binary("serve-bench", env!("CARGO_BIN_EXE_serve-bench")) else { return };
    let mut cases = vec![
        (args(&["--max-batch", HUGE]), "--max-batch"),
        (args(&["--page-size", HUGE]), "--page-size"),
        (args(&["--pages", HUGE]), "--pages"),
        (args(&["--prefill-tokens", HUGE]), "--prefill-tokens"),
        (
            args(&[
                "--requests",
                "1000000",
                "--prompt-len",
                "131000:131000",
                "--prompt-step",
                "8",
                "--output-len",
                "1",
            ]),
            "--requests",
        ),
        (args(&["--requests", HUGE]), "--requests"),
        (args(&["--requests", OVER]), "--requests"),
        (args(&["--output-len", &format!("1:{HUGE}")]), "--output-len"),
        (args(&["--prompt-len", &format!("{HUGE}:{HUGE}")]), "--prompt-len"),
        (args(&["--prompt-len=-1:4"]), "--prompt-len"),
        (args(&["--layers", HUGE]), "--layers"),
        (args(&["--layers", "0"]), "--layers"),
        (args(&["--rate=-1"]), "--rate"),
        (args(&["--temperature", "inf"]), "--temperature"),
    ];
    cases.push((vec!["--preset".into(), not_utf8()], "invalid UTF-8"));
    let failures = expect_usage_errors(&bin, &cases);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn train() {
    let Some(bin) = binary("train", env!("CARGO_BIN_EXE_train")) else { return };
    let mut cases = vec![
        (args(&["--preset", "tiny", "--sequences", HUGE]), "--sequences"),
        (args(&["--preset", "tiny", "--batch", HUGE]), "--batch"),
        (args(&["--preset", "tiny", "--seq", HUGE]), "--seq"),
        (args(&["--preset", "tiny", "--seq", "1048576"]), "--seq 1048576: the model has"),
        (args(&["--preset", "tiny", "--micro-batches", HUGE]), "--micro-batches"),
        // Each micro-batch small, the step's batch huge: still refused before it is made.
        (
            args(&[
                "--preset",
                "tiny",
                "--batch",
                "1099511627776",
                "--micro-batches",
                "1099511627776",
                "--seq",
                "8",
            ]),
            "--batch",
        ),
        (args(&["--preset", "tiny", "--steps", "0"]), "--steps"),
        (args(&["--preset", "tiny", "--steps", OVER]), "--steps"),
        (args(&["--preset", "tiny", "--layers", HUGE]), "--layers"),
        (args(&["--preset", "tiny", "--lr=-1"]), "--lr"),
        (args(&["--preset", "tiny", "--weight-decay", "nan"]), "--weight-decay"),
        (args(&["--preset", "tiny", "--fuse", &format!("fused=gqa@0-{HUGE}")]), "--fuse"),
    ];
    cases.push((vec!["--preset".into(), not_utf8()], "invalid UTF-8"));
    let failures = expect_usage_errors(&bin, &cases);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn speedup_report() {
    let Some(bin) = binary("speedup-report", env!("CARGO_BIN_EXE_speedup-report")) else { return };
    let mut cases = vec![
        (args(&["--layers", HUGE]), "--layers"),
        (args(&["--batch", HUGE]), "--batch"),
        (args(&["--seq", HUGE]), "--seq"),
        (args(&["--decode-steps", HUGE]), "--decode-steps"),
        (args(&["--repeat", "0"]), "--repeat"),
        (args(&["--tp", HUGE]), "--tp"),
        (args(&["--batch=-1"]), "--batch"),
        (args(&["--fuse", &format!("naive=rope@{HUGE}")]), "--fuse"),
    ];
    cases.push((vec!["--config".into(), not_utf8()], "invalid UTF-8"));
    let failures = expect_usage_errors(&bin, &cases);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn tp_bench() {
    let Some(bin) = binary("tp-bench", env!("CARGO_BIN_EXE_tp-bench")) else { return };
    let tiny = |a: &[&str]| args(&[&["--preset", "tiny"][..], a].concat());
    let mut cases = vec![
        (tiny(&["--prompt", HUGE]), "--prompt"),
        (tiny(&["--steps", HUGE]), "--steps"),
        (tiny(&["--batch", HUGE]), "--batch"),
        (tiny(&["--warmup", HUGE]), "--warmup"),
        (tiny(&["--reps", HUGE]), "--reps"),
        (tiny(&["--variant-rounds", HUGE]), "--variant-rounds"),
        (tiny(&["--reps", "0"]), "--reps"),
        (tiny(&["--ranks", "0"]), "ranks"),
        (tiny(&["--ranks", OVER]), "--ranks"),
        (tiny(&["--layers", "0"]), "layers"),
    ];
    cases.push((vec!["--preset".into(), not_utf8()], "invalid UTF-8"));
    let failures = expect_usage_errors(&bin, &cases);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn generate() {
    let Some(bin) = binary("generate", env!("CARGO_BIN_EXE_generate")) else { return };
    let cases = vec![
        (args(&["--model", "/nonexistent", "--prompt", "hi", "--max-new-tokens", OVER]), "--max-new-tokens"),
        (args(&["--model", "/nonexistent", "--prompt", "hi", "--top-k=-1"]), "--top-k"),
        (
            args(&["--model", "/nonexistent", "--prompt", "hi", "--tp", HUGE, "--temperature", "nan"]),
            "temperature",
        ),
        (vec!["--model".into(), not_utf8(), "--prompt".into(), "hi".into()], "not a directory"),
        (vec!["--model".into(), "/nonexistent".into(), "--prompt".into(), not_utf8()], "invalid UTF-8"),
    ];
    let failures = expect_usage_errors(&bin, &cases);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
