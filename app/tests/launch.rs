//! `cudnn-llm-launch`: the environment each rank gets, a failing rank ending the others, and no rank
//! outliving the launcher. CPU only: the ranks here are shell scripts.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn launch() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cudnn-llm-launch"))
}

fn alive(pid: u32) -> bool {
    // A zombie is as good as gone: it runs nothing (its parent reaps it).
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

/// Pids the ranks wrote to `dir` (one file per rank), waiting until `n` are there.
fn pids(dir: &Path, n: usize) -> Vec<u32> {
    let t = Instant::now();
    loop {
        let v: Vec<u32> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        if v.len() == n || t.elapsed() > Duration::from_secs(10) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_rank_gets_the_environment_torchrun_sets() {
    let out = launch()
        .args(["--nproc", "3", "--", "sh", "-c"])
        .arg("echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $CUDNN_LLM_JOB\"")
        .env_remove("CUDNN_LLM_JOB")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut lines: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(lines.len(), 3);
    let port = lines[0].split(' ').nth(5).unwrap().to_string();
    assert!(port.parse::<u16>().unwrap() > 0);
    let job = lines[0].split(' ').nth(6).unwrap().to_string();
    assert!(!job.is_empty(), "a fresh job token on one host");
    for (r, l) in lines.iter().enumerate() {
        assert_eq!(l, &format!("{r} 3 {r} 3 127.0.0.1 {port} {job}"));
    }
    // The second host of two: ranks 4..8, the given address and port.
    let out = launch()
        .args(["--nnodes", "2", "--node-rank", "1", "--nproc", "4", "--master-addr", "node0"])
        .args(["--master-port", "29500", "--job", "j7", "--", "sh", "-c"])
        .arg("echo $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR:$MASTER_PORT $CUDNN_LLM_JOB")
        .output()
        .unwrap();
    let mut lines: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(
        lines,
        ["4 8 0 node0:29500 j7", "5 8 1 node0:29500 j7", "6 8 2 node0:29500 j7", "7 8 3 node0:29500 j7"]
    );
}

#[test]
fn a_failing_rank_ends_the_others_and_gives_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let out = launch()
        .args(["--nproc", "3", "--grace", "5", "--", "sh", "-c"])
        .arg(format!(
            "echo $$ > {d}/$RANK; if [ $RANK = 1 ]; then while [ $(ls {d} | wc -l) -lt 3 ]; do sleep 0.05; done; \
             exit 3; fi; exec sleep 60",
            d = dir.path().display()
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("rank 1 exited with code 3"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10), "the sleeping ranks were not ended: {:?}", t.elapsed());
    let ranks = pids(dir.path(), 3);
    assert_eq!(ranks.len(), 3);
    for pid in ranks {
        assert!(!alive(pid), "rank process {pid} outlived the launcher");
    }
    // A rank killed by a signal: 128 + the signal, as a shell reports it.
    let out = launch()
        .args(["--nproc", "2", "--", "sh", "-c", "[ $RANK = 0 ] && kill -9 $$; sleep 60"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(128 + 9), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 0 was killed by signal 9"));
}

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let out = launch()
        .args(["--nproc", "2", "--grace", "0.5", "--", "sh", "-c"])
        .arg(format!(
            "if [ $RANK = 0 ]; then echo $$ > {d}/0; while [ ! -s {d}/1 ]; do sleep 0.05; done; exit 1; fi; \
             trap '' TERM; echo $$ > {d}/1; while :; do sleep 0.1; done",
            d = dir.path().display()
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("still running after") && err.contains("SIGKILL"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10));
    let ranks = pids(dir.path(), 2);
    assert_eq!(ranks.len(), 2);
    for pid in ranks {
        assert!(!alive(pid), "rank process {pid} outlived the launcher");
    }
}

#[test]
fn no_rank_outlives_a_killed_launcher() {
    let dir = tempfile::tempdir().unwrap();
    let mut l = launch()
        .args(["--nproc", "3", "--", "sh", "-c"])
        .arg(format!("echo $$ > {}/$RANK; exec sleep 60", dir.path().display()))
        .spawn()
        .unwrap();
    let ranks = pids(dir.path(), 3);
    assert_eq!(ranks.len(), 3);
    l.kill().unwrap(); // SIGKILL: the launcher cannot end them itself
    l.wait().unwrap();
    let t = Instant::now();
    while ranks.iter().any(|&p| alive(p)) && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for pid in ranks {
        assert!(!alive(pid), "rank process {pid} outlived the killed launcher");
    }
}

#[test]
fn a_terminated_launcher_ends_its_ranks_first() {
    let dir = tempfile::tempdir().unwrap();
    let l = launch()
        .args(["--nproc", "2", "--grace", "5", "--", "sh", "-c"])
        .arg(format!("echo $$ > {}/$RANK; sleep 60", dir.path().display()))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ranks = pids(dir.path(), 2);
    assert_eq!(ranks.len(), 2);
    let t = Instant::now();
    // SAFETY: a signal to the launcher, our own unreaped child.
    unsafe { libc::kill(l.id() as libc::pid_t, libc::SIGTERM) };
    let out = l.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 15), "{err}");
    assert!(err.contains("signal 15: ending the ranks"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    for pid in ranks {
        assert!(!alive(pid), "rank process {pid} outlived the launcher");
    }
}

#[test]
fn bad_command_lines_are_usage_errors() {
    for (args, says) in [
        (vec!["--nproc", "0", "--", "true"], "--nproc 0"),
        (vec!["--nproc", "100000", "--", "true"], "--nproc 100000"),
        (vec!["--nproc", "2", "--nnodes", "2", "--", "true"], "--master-addr"),
        (vec!["--nproc", "2", "--nnodes", "2", "--master-addr", "n0", "--", "true"], "--master-port"),
        (vec!["--nproc", "2", "--node-rank", "1", "--", "true"], "--node-rank 1"),
        (vec!["--nproc", "2", "--master-port", "0", "--", "true"], "--master-port 0"),
        (vec!["--nproc", "2", "--grace", "nan", "--", "true"], "--grace"),
        (vec!["--nproc", "2"], "COMMAND"),
    ] {
        let out = launch().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let out = launch().args(["--nproc", "2", "--", "/no/such/program"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("rank 0: cannot start /no/such/program"), "{err}");
}

/// Two `tp-bench` ranks launched as processes with `args`: stdout and stderr, with the exit code
/// `None` on success; either way within 60 s (every rank fails within its 20 s timeout without NCCL).
fn two_tp_bench_ranks(args: &[&str]) -> (Option<i32>, String, String) {
    let t = Instant::now();
    let out = launch()
        .args(["--nproc", "2", "--grace", "5", "--", env!("CARGO_BIN_EXE_tp-bench")])
        .args(args)
        .args(["--timeout", "20"])
        .env("BENCH_RESULTS_DIR", std::env::temp_dir().join("cudnn-llm-launch-test"))
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    let failed = if out.status.success() { None } else { Some(out.status.code().unwrap_or(-1)) };
    // Where the ranks can run (two GPUs, NCCL), they must.
    let can_run = cudnn_llm::cudnn_ops::device_count().is_ok_and(|n| n >= 2)
        && cudnn_llm::llama::nccl::library().is_ok();
    assert!(!(can_run && failed.is_some()), "two GPUs and NCCL are here: {stdout}\n{stderr}");
    if failed.is_some() {
        assert_eq!(failed, Some(1), "{stdout}\n{stderr}");
        assert!(stderr.contains("cudnn-llm-launch: rank"), "{stderr}");
    }
    (failed, stdout.into_owned(), stderr.into_owned())
}

/// Two `tp-bench --allreduce-only` ranks as processes: with NCCL and two GPUs they time the all-reduces
/// (rank 0 prints the table); without them rank 0 cannot make the unique id, and every rank ends
/// with an error naming the cause, the launcher with the failed rank's code, all within the timeout.
#[test]
fn tp_bench_ranks_as_processes_measure_or_fail_together() {
    match two_tp_bench_ranks(&["--allreduce-only", "--preset", "tiny"]) {
        (None, stdout, stderr) => assert!(stdout.contains("2 ranks as processes"), "{stdout}\n{stderr}"),
        (Some(_), _, stderr) => {
            assert!(stderr.contains("tp-bench: rank 0 of 2: rendezvous (rank 0 of 2):"), "{stderr}")
        }
    }
    // A rank's --ranks must be the world size.
    let out = Command::new(env!("CARGO_BIN_EXE_tp-bench"))
        .args(["--preset", "tiny"])
        .envs([("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("give --ranks 2 (the world size)"), "{err}");
}

/// The model's ranks as processes (`TpLlama::join`): two `tp-bench --ranks 2` ranks measure the tiny
/// model with NCCL and two GPUs (rank 0 alone prints); without them each rank ends with an error
/// naming the cause and the launcher with a rank's code, within the timeout.
#[test]
fn tp_bench_model_ranks_as_processes_measure_or_fail_together() {
    let args = ["--preset", "tiny", "--ranks", "2", "--prompt", "16", "--steps", "2"];
    match two_tp_bench_ranks(&args) {
        (None, stdout, stderr) => {
            let once = stdout.matches("2 ranks as processes (rank 0's times)").count();
            assert_eq!(once, 1, "{stdout}\n{stderr}");
        }
        (Some(_), stdout, stderr) => {
            let named = ["tp-bench: rank 0 of 2: ", "tp-bench: rank 1 of 2: "];
            assert!(named.iter().any(|n| stderr.contains(n)), "{stderr}");
            assert!(!stdout.contains("ranks as processes"), "nothing measured: {stdout}");
        }
    }
}
