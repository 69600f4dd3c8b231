//! Chat templates: the Jinja program a model folder ships (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`) that turns a conversation into the text the
//! model was trained on, run by the MiniJinja engine with Python's string methods.
//!
//! Owns rendering a conversation and finding which characters of the rendering each
//! assistant turn produced. Must not tokenize or read datasets.
use crate::{Error, Result};
use minijinja::{Environment, ErrorKind, Value};
use serde_json::json;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

const TEMPLATE_NAME: &str = "chat";

/// A model's chat template and the special-token texts it reads.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's source, for cache keys.
    pub source: String,
    /// The tokenizer's named special tokens by name (`bos_token`, `eos_token`, ...:
    /// [`named_tokens`]), given to every rendering.
    special_tokens: BTreeMap<String, String>,
    /// Variables given to every rendering (a run's `chat_template_kwargs`, such as
    /// `enable_thinking`), beneath a record's own.
    arguments: serde_json::Map<String, serde_json::Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("special_tokens", &self.special_tokens).finish()
    }
}

/// A special token in `tokenizer_config.json` (`bos_token`, `eos_token`): its text, or an
/// object whose `content` is.
pub fn special_token(config: &serde_json::Value, key: &str) -> Option<String> {
    token_text(config.get(key)?)
}

/// A token as a tokenizer configuration gives it: its text, or an object whose `content` is.
fn token_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The named special tokens of a tokenizer configuration, as `apply_chat_template` gives
/// them to a template: every `…_token` key whose value is a token (`bos_token`, `eos_token`,
/// `unk_token`, `pad_token`, ..., and a model's own, such as Gemma 3's `image_token`), and
/// those named in an `extra_special_tokens` or `model_specific_special_tokens` object.
pub fn named_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    let Some(config) = config.as_object() else { return BTreeMap::new() };
    let tokens = |map: &serde_json::Map<String, serde_json::Value>| -> Vec<(String, String)> {
        map.iter().filter_map(|(name, value)| Some((name.clone(), token_text(value)?))).collect()
    };
    let mut named: BTreeMap<String, String> =
        tokens(config).into_iter().filter(|(name, _)| name.ends_with("_token")).collect();
    for key in ["extra_special_tokens", "model_specific_special_tokens"] {
        if let Some(serde_json::Value::Object(map)) = config.get(key) {
            named.extend(tokens(map));
        }
    }
    named
}

/// A folder's `tokenizer_config.json` (an empty object where it has none), with the
/// special tokens it leaves out that `special_tokens_map.json` names, as `transformers`
/// reads an older save's.
pub fn tokenizer_config(dir: &Path) -> Result<serde_json::Value> {
    let read = |name: &str| -> Result<serde_json::Value> {
        let path = dir.join(name);
        if !path.is_file() {
            return Ok(json!({}));
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: not JSON ({e})", path.display())))
    };
    let mut config = read("tokenizer_config.json")?;
    if let (Some(config), serde_json::Value::Object(map)) = (config.as_object_mut(), read("special_tokens_map.json")?) {
        for (key, token) in map {
            config.entry(key).or_insert(token);
        }
    }
    Ok(config)
}

impl ChatTemplate {
    /// The template of a model folder: `chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of named templates of which `default` is taken).
    /// `None` when the folder has none.
    pub fn from_model_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let config = tokenizer_config(dir)?;
        let file = dir.join("chat_template.jinja");
        let source = if file.is_file() {
            std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?
        } else {
            match config.get("chat_template") {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .ok_or_else(|| {
                        Error::Data(format!(
                            "{}: chat_template lists no template named \"default\"",
                            dir.join("tokenizer_config.json").display()
                        ))
                    })?
                    .to_owned(),
                Some(_) => {
                    return Err(Error::Data(format!(
                        "{}: chat_template is neither a string nor a list of named templates",
                        dir.join("tokenizer_config.json").display()
                    )))
                }
            }
        };
        Ok(Some(ChatTemplate::new(source, named_tokens(&config), &dir.display().to_string())?))
    }

    /// The template a run uses: the Jinja file `file` where one is given (with the special
    /// tokens of `folder`'s tokenizer configuration), else `folder`'s own; `None` without
    /// either.
    pub fn choose(file: Option<&Path>, folder: Option<&Path>) -> Result<Option<ChatTemplate>> {
        let Some(file) = file else { return folder.map(ChatTemplate::from_model_dir).transpose().map(Option::flatten) };
        let config = match folder {
            Some(dir) => tokenizer_config(dir)?,
            None => json!({}),
        };
        let source = std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?;
        Ok(Some(ChatTemplate::new(source, named_tokens(&config), &file.display().to_string())?))
    }

    /// A template from its Jinja source, given `special_tokens` by name (`bos_token`, ...);
    /// `origin` names it in errors.
    pub fn new(source: String, special_tokens: BTreeMap<String, String>, origin: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        // `message.content.strip()`, `.startswith(...)`, `dict.items()`: templates are
        // written for Jinja under Python.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_filter("tojson", to_json);
        env.add_function("strftime_now", strftime_now);
        // As `transformers` configures Jinja for chat templates.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Data(format!("{e:#}")))?;
        env.set_syntax(syntax);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| Error::Data(format!("the chat template of {origin} does not parse: {e:#}")))?;
        Ok(ChatTemplate { env, source, special_tokens, arguments: serde_json::Map::new() })
    }

    /// The text of the special token `name` (`eos_token`) the template is given.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.get(name).map(String::as_str)
    }

    /// The template with `arguments` given to every rendering, as TRL's `GRPOConfig` gives
    /// its `chat_template_kwargs`; a record's own variables replace them where both name one.
    pub fn with_arguments(mut self, arguments: serde_json::Map<String, serde_json::Value>) -> ChatTemplate {
        self.arguments = arguments;
        self
    }

    /// What decides the template's renderings, for cache keys: its source, the special
    /// tokens and arguments it is given, and today's date where it reads the time
    /// (`strftime_now`), so a cache of yesterday's renderings is not taken for today's.
    pub fn identity(&self) -> String {
        let mut identity = self.source.clone();
        for (name, token) in &self.special_tokens {
            identity += &format!("\u{0}{name}\u{0}{token}");
        }
        if !self.arguments.is_empty() {
            identity += &format!("\u{0}{}", serde_json::Value::Object(self.arguments.clone()));
        }
        if self.source.contains("strftime_now") {
            identity += &format!("\u{0}{}", strftime_now("%Y-%m-%d".into()).unwrap_or_default());
        }
        identity
    }

    /// The text of `messages`, with the opening of an assistant turn after them where
    /// `add_generation_prompt` says.
    pub fn render(&self, messages: &[serde_json::Value], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`ChatTemplate::render`] with more of the template's variables: a record's `tools`
    /// and its `chat_template_kwargs` (`enable_thinking`), as `apply_chat_template` takes them.
    pub fn render_with(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        variables: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Data(format!("{e:#}")))?;
        // The special tokens first, as `apply_chat_template` gives them: an argument of the
        // same name replaces one, and a token the tokenizer lacks is undefined. `tools` and
        // `documents` are none unless given: a template asking `tools is not none` finds them so.
        let mut context: serde_json::Map<String, serde_json::Value> =
            self.special_tokens.iter().map(|(name, token)| (name.clone(), json!(token))).collect();
        context.extend([("tools".into(), json!(null)), ("documents".into(), json!(null))]);
        context.extend(self.arguments.clone());
        context.extend(variables.clone());
        context.insert("messages".into(), json!(messages.iter().map(as_templates_read).collect::<Vec<_>>()));
        context.insert("add_generation_prompt".into(), json!(add_generation_prompt));
        template
            .render(Value::from(minijinja::value::Serde(&context)))
            .map_err(|e| Error::Data(format!("the chat template failed: {}", describe(&e))))
    }

    /// The text of a conversation and the byte ranges of it that the turns from message
    /// `first_learned` on whose role is `assistant` produced: what the model learns to say.
    /// Each turn's range runs from the end of the text of the messages before it with an
    /// assistant turn opened, to the end of the text of the messages up to it, so it holds
    /// the turn's content and its closing tokens but not the template's opening of it.
    /// `variables` as [`ChatTemplate::render_with`] takes them.
    pub fn render_with_turns(
        &self,
        messages: &[serde_json::Value],
        first_learned: usize,
        variables: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(String, Vec<Range<usize>>)> {
        let whole = self.render_with(messages, false, variables)?;
        let mut turns = vec![];
        for (k, message) in messages.iter().enumerate().skip(first_learned) {
            if message.get("role").and_then(|r| r.as_str()) != Some("assistant") {
                continue;
            }
            let opened = self.render_with(&messages[..k], true, variables)?;
            let closed = self.render_with(&messages[..=k], false, variables)?;
            if !whole.starts_with(&opened) || !whole.starts_with(&closed) || closed.len() < opened.len() {
                return Err(Error::Data(format!(
                    "the chat template renders the conversation up to message {} as other than the start of the whole conversation, so what the assistant says there cannot be found",
                    k + 1
                )));
            }
            turns.push(opened.len()..closed.len());
        }
        Ok((whole, turns))
    }
}

/// A message as `apply_chat_template` gives it to a template: a key whose value is null is
/// dropped (APIs write `"tool_calls": null`, Parquet fills absent keys), and reasoning given
/// as `reasoning_content`, `thinking` or `reasoning` is given under the first two names as
/// well, so a template reads it under either.
fn as_templates_read(message: &serde_json::Value) -> serde_json::Value {
    let serde_json::Value::Object(fields) = message else { return message.clone() };
    let mut fields: serde_json::Map<String, serde_json::Value> =
        fields.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"].iter().find_map(|key| fields.get(*key)).cloned();
    if let Some(reasoning) = reasoning {
        fields.entry("thinking").or_insert_with(|| reasoning.clone());
        fields.entry("reasoning_content").or_insert(reasoning);
    }
    serde_json::Value::Object(fields)
}

/// `strftime_now(format)` as `transformers` gives templates (Llama 3's dates its system
/// turn with it): the local time now, through the C library's `strftime`, which Python's
/// `datetime.strftime` calls too, so every format code reads as it does there.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let bad =
        |why: &str| minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now({format:?}): {why}"));
    let c_format = std::ffi::CString::new(format.as_bytes()).map_err(|_| bad("a NUL in the format"))?;
    // SAFETY: `time` and `localtime_r` write only into the values given; `strftime` writes
    // at most `out.len()` bytes into `out` and reads the NUL-ended format.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut local: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut local).is_null() {
            return Err(bad("the local time is unknown"));
        }
        let mut out = vec![0u8; 64 + 16 * format.len()];
        let written = libc::strftime(out.as_mut_ptr().cast(), out.len(), c_format.as_ptr(), &local);
        if written == 0 && !format.is_empty() {
            return Err(bad("the formatted time does not fit"));
        }
        out.truncate(written);
        String::from_utf8(out).map_err(|_| bad("the formatted time is not UTF-8"))
    }
}

/// `tojson` as `transformers` defines it for templates: Python's `json.dumps` without ASCII
/// escapes, `", "` and `": "` between items, or `indent` spaces per level.
fn to_json(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            serde::Serialize::serialize(&value, &mut serde_json::Serializer::with_formatter(&mut out, formatter))
        }
        None => {
            serde::Serialize::serialize(&value, &mut serde_json::Serializer::with_formatter(&mut out, PythonSpacing))
        }
    };
    written.map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    String::from_utf8(out).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

/// JSON on one line with Python's default separators.
struct PythonSpacing;

impl serde_json::ser::Formatter for PythonSpacing {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// A template error in one line, with the template's own message and line where it has them.
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.detail().map_or_else(|| e.kind().to_string(), str::to_owned);
    if let Some(line) = e.line() {
        text.push_str(&format!(" (template line {line})"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn msg(role: &str, content: &str) -> serde_json::Value {
        json!({"role": role, "content": content})
    }

    /// Llama 3.2's way of dating its system turn finds `strftime_now` and gets today's date
    /// in the C library's words, as `date` prints it, not its fallback.
    #[test]
    fn a_template_dates_itself_with_strftime_now() {
        let source = r#"{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y, %A") %}{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}Today Date: {{ date_string }}"#;
        let template = ChatTemplate::new(source.into(), Default::default(), "test").unwrap();
        let today = || {
            // In the C locale, as this process (and Python) formats.
            let out = std::process::Command::new("date").arg("+%d %b %Y, %A").env("LC_ALL", "C").output().unwrap();
            String::from_utf8(out.stdout).unwrap().trim().to_string()
        };
        let before = today();
        let text = template.render(&[msg("user", "q")], false).unwrap();
        // Read again should the day turn while rendering.
        assert!(text == format!("Today Date: {before}") || text == format!("Today Date: {}", today()), "{text}");
        // Cached renderings are keyed by the day as well.
        let day = strftime_now("%Y-%m-%d".into()).unwrap();
        assert_eq!(template.identity(), format!("{source}\u{0}{day}"));
        let plain = ChatTemplate::new(CHATML.into(), Default::default(), "test").unwrap();
        assert_eq!(plain.identity(), CHATML);
        let bad = ChatTemplate::new(r#"{{ strftime_now("a\u0000b") }}"#.into(), Default::default(), "test").unwrap();
        assert!(bad.render(&[], false).unwrap_err().to_string().contains("a NUL in the format"));
    }

    /// A run's arguments reach every rendering beneath a record's own variables, and key
    /// the cache.
    #[test]
    fn a_run_s_arguments_reach_every_rendering_beneath_a_record_s_own() {
        let source = "{% if enable_thinking %}[think]{% endif %}{{ style }}{{ messages[0].content }}";
        let plain = ChatTemplate::new(source.into(), Default::default(), "test").unwrap();
        let arguments = json!({"enable_thinking": true, "style": "A:"}).as_object().unwrap().clone();
        let given = ChatTemplate::new(source.into(), Default::default(), "test").unwrap().with_arguments(arguments);
        let q = [msg("user", "q")];
        assert_eq!(plain.render(&q, false).unwrap(), "q");
        assert_eq!(given.render(&q, false).unwrap(), "[think]A:q");
        let own = json!({"style": "B:"}).as_object().unwrap().clone();
        assert_eq!(given.render_with(&q, false, &own).unwrap(), "[think]B:q");
        assert_ne!(plain.identity(), given.identity());
    }

    /// `special_tokens_map.json` gives the special tokens `tokenizer_config.json` leaves out,
    /// not those it names.
    #[test]
    fn an_older_save_s_special_tokens_map_fills_in_the_configuration() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"bos_token": "<s>"}"#).unwrap();
        let map = r#"{"bos_token": "<other>", "eos_token": {"content": "</s>", "lstrip": false}}"#;
        std::fs::write(dir.path().join("special_tokens_map.json"), map).unwrap();
        let config = tokenizer_config(dir.path()).unwrap();
        assert_eq!(special_token(&config, "bos_token").as_deref(), Some("<s>"));
        assert_eq!(special_token(&config, "eos_token").as_deref(), Some("</s>"));
    }

    #[test]
    fn assistant_turns_are_found_in_the_rendering() {
        let t = ChatTemplate::new(CHATML.into(), Default::default(), "test").unwrap();
        let conv = [
            msg("system", "Be brief."),
            msg("user", "Hi"),
            msg("assistant", " Hello. "),
            msg("user", "Bye"),
            msg("assistant", "Farewell."),
        ];
        let (text, turns) = t.render_with_turns(&conv, 0, &Default::default()).unwrap();
        let said: Vec<&str> = turns.iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(said, ["Hello.<|im_end|>\n", "Farewell.<|im_end|>\n"]);
        // Turns before `first_learned` are prompt.
        assert_eq!(t.render_with_turns(&conv, 3, &Default::default()).unwrap().1.len(), 1);
    }

    #[test]
    fn python_methods_and_raised_exceptions_work_as_under_transformers() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with the user') }}{% endif %}{% for m in messages %}{{ m.content.strip().upper() }}{% endfor %}";
        let t = ChatTemplate::new(src.into(), Default::default(), "test").unwrap();
        assert_eq!(t.render(&[msg("user", " hi ")], false).unwrap(), "HI");
        let err = t.render(&[msg("assistant", "x")], false).unwrap_err().to_string();
        assert!(err.contains("Conversations must start with the user"), "{err}");
    }

    /// A template is given every named special token of its tokenizer configuration, a
    /// model's own among them; one the tokenizer lacks is undefined, and an argument of the
    /// same name replaces a token.
    #[test]
    fn templates_read_every_named_special_token() {
        let config = json!({"bos_token": "<s>", "pad_token": {"content": "<pad>", "lstrip": false},
                            "add_bos_token": true, "image_token": "<img>",
                            "extra_special_tokens": {"boi_token": "<boi>"}, "unk_token": null});
        let named = named_tokens(&config);
        let names: Vec<&str> = named.keys().map(String::as_str).collect();
        assert_eq!(names, ["boi_token", "bos_token", "image_token", "pad_token"]);
        let source = "{{ bos_token }}{{ pad_token }}{{ image_token }}{{ boi_token }}|{{ unk_token is defined }}";
        let t = ChatTemplate::new(source.into(), named, "t").unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "<s><pad><img><boi>|False");
        assert_eq!(t.special_token("pad_token"), Some("<pad>"));
        let given = t.with_arguments([("bos_token".to_string(), json!("[B]"))].into_iter().collect());
        assert_eq!(given.render(&[], false).unwrap(), "[B]<pad><img><boi>|False");
    }

    #[test]
    fn tojson_writes_as_python_does() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}".into(),
            Default::default(),
            "t",
        )
        .unwrap();
        let out = t.render(&[json!({"role": "user", "content": "<é>", "n": [1, 2]})], false).unwrap();
        assert_eq!(out, "{\"role\": \"user\", \"content\": \"<é>\", \"n\": [1, 2]}|{\n  \"role\": \"user\",\n  \"content\": \"<é>\",\n  \"n\": [\n    1,\n    2\n  ]\n}");
    }

    #[test]
    fn a_template_that_rewrites_earlier_turns_is_refused() {
        // Drops every turn but the last from the rendering: no prefix holds.
        let src = "{{ messages[-1].content }}";
        let t = ChatTemplate::new(src.into(), Default::default(), "test").unwrap();
        let err = t
            .render_with_turns(&[msg("user", "a"), msg("assistant", "b")], 0, &Default::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be found"), "{err}");
    }
}
