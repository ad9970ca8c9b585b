//! One file: the template environment transformers sets up in one place (filters, globals, rendering).
//!
//! HF chat templates rendered with minijinja, set up like transformers' jinja2 environment so the rendered
//! text (and therefore the token ids) match `apply_chat_template`: `trim_blocks` and `lstrip_blocks`, Python
//! string/dict methods (`.strip()`, `.startswith()`, `.items()`, via minijinja-contrib pycompat), loop controls,
//! `raise_exception`, `strftime_now`, and a `tojson` that behaves like Python's `json.dumps` (no HTML escaping,
//! `", "` / `": "` separators, keys in insertion order).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::error::{Result, TokenizerError};

const TEMPLATE_NAME: &str = "chat";

/// Instructions one render may execute. A template comes with a checkpoint, so it is outside input: one that
/// loops for ever (`range` is capped at 100,000 items, but loops nest) stops here with an error. Real chat
/// templates spend 30-45 instructions per message (measured: Qwen2.5's, a Llama-3-style one), so this renders
/// about 6,000 messages (the tokenizer's fuzz suite checks 4,000 with tools).
///
/// What fuel does not bound is the cost of one instruction: `'x' * 100000000` builds 100 MB at once
/// (minijinja's cap for repetition) and `~` doubles a string at once, so a hostile template can still spend
/// seconds and gigabytes within its fuel. Rendering the templates of untrusted checkpoints with a hard bound on
/// memory and time needs a process of its own.
pub const RENDER_FUEL: u64 = 250_000;
/// Bytes one render may write (a prompt of a million tokens is a few MB).
pub const MAX_RENDERED_BYTES: usize = 16 << 20;
/// Stack of the thread a render runs on. A template can nest a value one level per instruction, and minijinja
/// prints and drops values recursively (up to ~520 bytes of stack per level): [`RENDER_FUEL`] levels fit twice
/// over. Only the pages a render touches are ever committed.
const RENDER_STACK_BYTES: usize = 256 << 20;
/// Nesting `tojson` follows at most (its recursion uses the same stack).
const MAX_TOJSON_DEPTH: usize = 512;

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported here rather than on the first request.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TokenizerError::ChatTemplate(format!("does not compile: {}", describe(&e))))?;
        Ok(ChatTemplate { env, source: source.to_string() })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders with the given variables (`messages`, `tools`, `add_generation_prompt`, special tokens, ...),
    /// within [`RENDER_FUEL`] instructions and [`MAX_RENDERED_BYTES`] of output, on a thread of its own whose
    /// stack holds whatever the fuel lets a template build: a deeply nested value would otherwise overflow the
    /// caller's stack, which aborts the whole process.
    pub fn render(&self, variables: BTreeMap<String, Value>) -> Result<String> {
        std::thread::scope(|scope| {
            let render = std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(RENDER_STACK_BYTES)
                .spawn_scoped(scope, || self.render_here(variables))
                .map_err(|e| TokenizerError::ChatTemplate(format!("cannot start a render thread: {e}")))?;
            render.join().map_err(|_| TokenizerError::ChatTemplate("rendering panicked".into()))?
        })
    }

    fn render_here(&self, variables: BTreeMap<String, Value>) -> Result<String> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| TokenizerError::ChatTemplate(describe(&e)))?;
        let mut output = BoundedOutput { text: Vec::new(), limit: MAX_RENDERED_BYTES, overflowed: false };
        match template.render_captured_to(Value::from(variables), &mut output) {
            Ok(_) => String::from_utf8(output.text)
                .map_err(|e| TokenizerError::ChatTemplate(format!("rendered text is not UTF-8: {e}"))),
            Err(_) if output.overflowed => {
                Err(TokenizerError::ChatTemplate(format!("the rendered text exceeds {MAX_RENDERED_BYTES} bytes")))
            }
            Err(e) => Err(TokenizerError::ChatTemplate(describe(&e))),
        }
    }
}

/// Collects rendered text up to a limit; a write past it fails, which stops the render.
struct BoundedOutput {
    text: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("rendered text too long"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The error with its detail and location, which `Display` alone may leave out.
fn describe(err: &Error) -> String {
    let mut text = err.to_string();
    if let Some(line) = err.line() {
        let _ = write!(text, " (line {line})");
    }
    text
}

/// `raise_exception(message)`: templates call it to reject a conversation (e.g. bad role order).
fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("template raised: {message}")))
}

/// `strftime_now(format)` (Llama 3 templates print today's date), UTC.
fn strftime_now(format: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(secs, &format)
}

/// A small `strftime` over a Unix timestamp (UTC): the directives chat templates use.
fn strftime(unix_secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('-') => match chars.next() {
                Some('d') => write!(out, "{day}"),
                Some('m') => write!(out, "{month}"),
                Some(other) => write!(out, "%-{other}"),
                None => write!(out, "%-"),
            },
            Some('B') => write!(out, "{}", MONTHS[(month - 1) as usize]),
            Some('b') => write!(out, "{}", &MONTHS[(month - 1) as usize][..3]),
            Some('A') => write!(out, "{}", DAYS[weekday]),
            Some('a') => write!(out, "{}", &DAYS[weekday][..3]),
            Some('j') => write!(out, "{day_of_year:03}"),
            Some('H') => write!(out, "{hour:02}"),
            Some('I') => write!(out, "{:02}", (hour + 11) % 12 + 1),
            Some('p') => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, as
/// transformers installs it; accepts the same keyword arguments.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => Some(" ".repeat(v.as_usize().unwrap_or(0))),
    };
    let (item_sep, key_sep) = match separators.filter(|s| !s.is_none()) {
        Some(seps) => {
            let a = seps.get_item_by_index(0)?;
            let b = seps.get_item_by_index(1)?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson separators must be two strings")),
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let dumper = JsonDumper {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    dumper.dump(&value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonDumper {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonDumper {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn dump(&self, value: &Value, level: usize, out: &mut String) -> std::result::Result<(), Error> {
        if level > MAX_TOJSON_DEPTH {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: the value is nested deeper than {MAX_TOJSON_DEPTH} levels"),
            ));
        }
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => {
                let _ = write!(out, "{value}");
            }
            ValueKind::Number => {
                let f = f64::try_from(value.clone())?;
                out.push_str(&python_float_repr(f));
            }
            ValueKind::String => self.string(value.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort();
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    match key.as_str() {
                        Some(s) => self.string(s, out),
                        None => self.string(&key.to_string(), out),
                    }
                    out.push_str(&self.key_sep);
                    self.dump(&value.get_item(key)?, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.dump(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            _ => self.string(&value.to_string(), out),
        }
        Ok(())
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && (c as u32) > 0x7e => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)`: shortest round-trip digits, `.0` on integral values, exponent form outside
/// `1e-4 <= |x| < 1e16`.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        let formatted = format!("{f:e}");
        let (mantissa, exponent) = formatted.split_once('e').unwrap_or((formatted.as_str(), "0"));
        let exponent: i32 = exponent.parse().unwrap_or(0);
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        s + ".0"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, vars: serde_json::Value) -> Result<String> {
        let vars: BTreeMap<String, Value> = match vars {
            serde_json::Value::Object(map) => map.into_iter().map(|(k, v)| (k, Value::from_serialize(&v))).collect(),
            _ => BTreeMap::new(),
        };
        ChatTemplate::new(source)?.render(vars)
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let out = render(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ s | tojson }}",
            serde_json::json!({"x": {"a": [1, 2.5, true, null], "b": "<é>"}, "s": "q\"\n"}),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"a\": [1, 2.5, true, null], \"b\": \"<é>\"}|{\n  \"a\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"b\": \"<é>\"\n}|\"q\\\"\\n\""
        );
    }

    #[test]
    fn python_string_methods_and_loop_controls_work() {
        let out = render(
            "{% for m in messages %}{% if loop.index0 > 1 %}{% break %}{% endif %}{{ m.content.strip().upper() }}{% if m.content.startswith(' a') %}!{% endif %}{% endfor %}",
            serde_json::json!({"messages": [{"content": " ab "}, {"content": "cd"}, {"content": "ef"}]}),
        )
        .unwrap();
        assert_eq!(out, "AB!CD");
    }

    #[test]
    fn raise_exception_surfaces_the_templates_message() {
        let err = render("{{ raise_exception('roles must alternate') }}", serde_json::json!({})).unwrap_err();
        assert!(matches!(err, TokenizerError::ChatTemplate(_)));
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-07-23 13:05:09 UTC
        assert_eq!(strftime(1_721_739_909, "%d %b %Y %H:%M:%S %A %j"), "23 Jul 2024 13:05:09 Tuesday 205");
        assert_eq!(strftime(0, "%Y-%m-%d"), "1970-01-01");
    }

    #[test]
    fn python_float_repr_matches_python() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e20), "1e+20");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
    }
}
