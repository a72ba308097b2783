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
