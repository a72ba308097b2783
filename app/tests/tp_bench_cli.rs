//! tp-bench's NCCL and decode-variant options without a GPU: bad values exit 2 naming the option
//! before anything is opened, and a setting's values come out in the printed settings, the CSV
//! columns and the file names (the all-reduce run itself fails here without two GPUs and NCCL, or
//! runs where they are).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The binary, where cargo built it or staged beside this test; `None` (said as SKIPPED) when neither.
fn binary() -> Option<PathBuf> {
    let found = cudnn_llm_app::bench_util::package_binary(env!("CARGO_BIN_EXE_tp-bench"), "tp-bench");
    if found.is_none() {
        eprintln!("SKIPPED: no tp-bench binary where cargo built it or staged beside this test");
    }
    found
}

/// `bin` with `args`, its results under `dir`, no NCCL protocol or algorithm from the environment:
/// the output, its stdout and its stderr.
fn run_into(bin: &Path, args: &[&str], dir: &Path) -> (Output, String, String) {
    let out = Command::new(bin)
        .args(args)
        .env("BENCH_RESULTS_DIR", dir)
        .env_remove("NCCL_PROTO")
        .env_remove("NCCL_ALGO")
        .output()
        .unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into());
    (out, stdout, stderr)
}

#[test]
fn bad_nccl_options_exit_2_naming_the_option() {
    let Some(bin) = binary() else { return };
    let cases: [(&[&str], &str, &str); 12] = [
        (&["--nccl-max-ctas", "65"], "--nccl-max-ctas", "65 is not between 1 and 64"),
        (&["--nccl-max-ctas", "0"], "--nccl-max-ctas", "0 is not between 1 and 64"),
        (&["--nccl-min-ctas", "8", "--nccl-max-ctas", "4"], "--nccl-min-ctas", "8 is above maxCTAs 4"),
        (&["--nccl-min-ctas", "8"], "--nccl-min-ctas", "needs maxCTAs"),
        (&["--nccl-cga-cluster-size", "9"], "--nccl-cga-cluster-size", "9 is above 8"),
        (&["--nccl-min-ctas=-1"], "--nccl-min-ctas", "invalid value"),
        (&["--nccl-proto", "ll"], "--nccl-proto", "is not LL, LL128 or Simple"),
        (&["--nccl-algo", "NVLS"], "--nccl-algo", "is not Ring or Tree"),
        (
            &["--decode-variants", "default;attention=flash"],
            "--decode-variants",
            "`attention=flash`: a decode variant takes",
        ),
        (&["--decode-variants", "split=rows"], "--decode-variants", "`split=rows`"),
        (&["--decode-variants", "attention=cudnn,pdl=maybe"], "--decode-variants", "`pdl=maybe`"),
        (&["--decode-variants", "default", "--variant-rounds", "0"], "--variant-rounds", "at least 1"),
    ];
    for (args, option, why) in cases {
        let out =
            Command::new(&bin).args(args).env_remove("NCCL_PROTO").env_remove("NCCL_ALGO").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(option) && err.contains(why) && !err.contains("panicked"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}: nothing runs: {}", String::from_utf8_lossy(&out.stdout));
    }
    // A protocol the environment already sets otherwise: refused, not silently replaced.
    let out = Command::new(&bin).args(["--nccl-proto", "Simple"]).env("NCCL_PROTO", "LL").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--nccl-proto: NCCL NCCL_PROTO: is LL in the environment"), "{err}");
    let out = Command::new(&bin).args(["--allreduce-only", "--ranks", "1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--allreduce-only needs a rank count above 1"));
}

#[test]
fn a_settings_values_are_printed_and_written_as_columns_and_file_names() {
    let Some(bin) = binary() else { return };
    let dir = std::env::temp_dir().join(format!("tp-bench-cli-{}", std::process::id()));
    let args = [
        "--allreduce-only",
        "--ranks",
        "2",
        "--nccl-min-ctas",
        "4",
        "--nccl-max-ctas",
        "8",
        "--nccl-proto",
        "LL128",
        "--nccl-algo",
        "Ring",
        "--rank-spin-us",
        "0",
        "--timeout",
        "120",
    ];
    let (out, stdout, stderr) = run_into(&bin, &args, &dir);
    // 0 where two GPUs and NCCL ran it, 1 where they are missing (the row says why).
    assert!(matches!(out.status.code(), Some(0 | 1)), "{stdout}\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stdout.contains(
            "# settings `min4-max8-LL128-Ring-spin0`: minCTAs=4 maxCTAs=8, NCCL_PROTO=LL128, NCCL_ALGO=Ring, \
             ranks poll 0 us for a call"
        ),
        "{stdout}"
    );
    let csv = std::fs::read_to_string(dir.join("tp-allreduce-min4-max8-LL128-Ring-spin0.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| {
        header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no {name}: {header:?}"))
    };
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert!(!rows.is_empty());
    for row in &rows {
        assert_eq!(
            [
                col("nccl_min_ctas"),
                col("nccl_max_ctas"),
                col("nccl_cga_cluster_size"),
                col("nccl_proto"),
                col("nccl_algo"),
                col("rank_spin_us")
            ]
            .map(|c| row[c]),
            ["4", "8", "", "LL128", "Ring", "0"],
            "{csv}"
        );
    }
    if out.status.code() == Some(0) {
        // 2 model sizes and 8 KB to 64 MB.
        assert_eq!(rows.len(), 16, "{csv}");
        assert!(rows.iter().all(|r| r[col("us")].parse::<f64>().unwrap() > 0.0), "{csv}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn each_rank_count_runs_in_a_process_of_its_own_and_the_rows_come_back() {
    let Some(bin) = binary() else { return };
    let dir = std::env::temp_dir().join(format!("tp-bench-children-{}", std::process::id()));
    let args = ["--preset", "tiny", "--ranks", "1,2", "--steps", "2", "--reps", "1", "--warmup", "0"];
    let (out, stdout, stderr) = run_into(&bin, &args, &dir);
    assert!(!stderr.contains("panicked"), "{stderr}");
    for r in [1, 2] {
        assert!(stdout.contains(&format!("# {r} rank(s): a process of its own")), "{stdout}");
    }
    // The settings once, from this process: the rank counts' processes leave them out.
    assert_eq!(stdout.matches("# settings `default`").count(), 1, "{stdout}");
    let csv = std::fs::read_to_string(dir.join("tp-tiny-2l.csv"));
    match out.status.code() {
        // No GPU (or one): each process says why its row failed, no results are written.
        Some(1) => {
            assert!(
                stderr.contains("tp-bench: 1 rank(s):") && stderr.contains("tp-bench: 2 rank(s):"),
                "{stderr}"
            );
            assert!(csv.is_err(), "no row ran, yet results were written");
        }
        // Two GPUs: both rows came back from their processes, in the order of --ranks.
        Some(0) => {
            let csv = csv.unwrap();
            let rows: Vec<&str> = csv.lines().skip(1).collect();
            assert_eq!(rows.len(), 2, "{csv}");
            assert!(rows[0].starts_with("tiny,2,1,") && rows[1].starts_with("tiny,2,2,"), "{csv}");
        }
        other => panic!("exit {other:?}: {stdout}\n{stderr}"),
    }
    // In one process: no process of its own.
    let out =
        Command::new(&bin).args(args).arg("--same-process").env("BENCH_RESULTS_DIR", &dir).output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("a process of its own"));
    std::fs::remove_dir_all(&dir).ok();
}
