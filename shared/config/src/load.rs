use std::path::Path;

use serde::de::DeserializeOwned;

/// Why a configuration could not be loaded. Every variant names what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {message}")]
    Read { path: String, message: String },
    #[error("config override {0:?} is not of the form key.path=value")]
    BadOverride(String),
    #[error("config: {0}")]
    Merge(String),
    #[error("config key `{path}`: {message}")]
    Invalid { path: String, message: String },
}

impl ConfigError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Read { .. } => "read",
            Self::BadOverride(..) => "bad_override",
            Self::Merge(..) => "merge",
            Self::Invalid { .. } => "invalid",
        }
    }
}

/// Loads and merges file, environment and overrides into a JSON value (no typing yet).
pub fn load_value(file: Option<&Path>, overrides: &[String]) -> Result<serde_json::Value, ConfigError> {
    let mut builder = config::Config::builder();
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.display().to_string(), message: e.to_string() })?;
        // Parse once ourselves so YAML syntax errors carry the file name and line.
        let unreadable = |message: String| ConfigError::Read { path: path.display().to_string(), message };
        check_nesting(&text).map_err(unreadable)?;
        serde_yaml::from_str::<serde_yaml::Value>(&text).map_err(|e| unreadable(e.to_string()))?;
        builder = builder.add_source(config::File::from_str(&text, config::FileFormat::Yaml));
    }
    builder = builder
        .add_source(config::Environment::with_prefix("JETRL").prefix_separator("__").separator("__").try_parsing(true));
    for item in overrides {
        let (key, raw) = item.split_once('=').ok_or_else(|| ConfigError::BadOverride(item.clone()))?;
        let key = key.trim();
        if key.is_empty() || key.split('.').any(|p| p.is_empty()) {
            return Err(ConfigError::BadOverride(item.clone()));
        }
        let yaml = check_nesting(raw).ok().and_then(|()| serde_yaml::from_str::<serde_yaml::Value>(raw).ok());
        let value: serde_json::Value = match yaml {
            Some(v) => serde_json::to_value(v).unwrap_or_else(|_| serde_json::Value::String(raw.to_string())),
            None => serde_json::Value::String(raw.to_string()),
        };
        let mut nested = value;
        for part in key.rsplit('.') {
            let mut map = serde_json::Map::new();
            map.insert(part.to_string(), nested);
            nested = serde_json::Value::Object(map);
        }
        // JSON is YAML: the override becomes one more (highest-priority) source.
        builder = builder.add_source(config::File::from_str(&nested.to_string(), config::FileFormat::Yaml));
    }
    let merged = builder.build().map_err(|e| ConfigError::Merge(e.to_string()))?;
    merged.try_deserialize::<serde_json::Value>().map_err(|e| ConfigError::Merge(e.to_string()))
}

/// The keys of the YAML file's top-level `section` as `section.key=value` overrides: how a file holding one identity's settings, such as the `nats.yaml` deploy/nats/gen.sh writes
/// for each service, is handed to that service on its command line. The secrets stay in the files they name.
pub fn section_overrides(path: &Path, section: &str) -> Result<Vec<String>, ConfigError> {
    let unreadable = |message: String| ConfigError::Read { path: path.display().to_string(), message };
    let text = std::fs::read_to_string(path).map_err(|e| unreadable(e.to_string()))?;
    check_nesting(&text).map_err(unreadable)?;
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| unreadable(e.to_string()))?;
    let keys = doc.get(section).and_then(serde_yaml::Value::as_mapping).ok_or_else(|| ConfigError::Invalid {
        path: section.into(),
        message: format!("{} has no `{section}:` section", path.display()),
    })?;
    keys.iter()
        .map(|(key, value)| {
            let key = key.as_str().ok_or_else(|| ConfigError::Invalid {
                path: section.into(),
                message: format!("{}: a key that is not a string", path.display()),
            })?;
            // YAML, as an override's value is read: a string is quoted only where it would read as another
            // value (`'123'`, `'a: b'`)
            let value = serde_yaml::to_string(value).map_err(|e| unreadable(e.to_string()))?;
            Ok(format!("{section}.{key}={}", value.trim_end()))
        })
        .collect()
}

/// Streams `text` through yaml-rust2's parser (the one `config` uses), building nothing: it refuses flow
/// collections nested deeper than 255 levels at once and does not expand aliases. serde_yaml's parser (libyaml)
/// takes time quadratic in that nesting before its own recursion limit refuses it (`[[[…` 100,000 deep took
/// 80 s), so it runs second, and refuses the alias bombs that yaml-rust2's loader would expand.
pub(crate) fn check_nesting(text: &str) -> Result<(), String> {
    let mut parser = yaml_rust2::parser::Parser::new_from_str(text);
    loop {
        match parser.next_token() {
            Ok((yaml_rust2::Event::StreamEnd, _)) => return Ok(()),
            Ok(_) => {}
            Err(err) => return Err(err.to_string()),
        }
    }
}

/// Loads a typed configuration. Unknown keys (with `#[serde(deny_unknown_fields)]`) and type errors come
/// back as [`ConfigError::Invalid`] with the key's full path.
pub fn load<T: DeserializeOwned>(file: Option<&Path>, overrides: &[String]) -> Result<T, ConfigError> {
    let value = load_value(file, overrides)?;
    from_value(value)
}

/// Types a merged value, naming the path of the first offending key.
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner().to_string();
        ConfigError::Invalid { path: if path == "." { "<root>".into() } else { path }, message: inner }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A generated identity file becomes overrides that load back to the same settings, strings that would read
    /// as something else included.
    #[test]
    fn a_section_becomes_overrides_that_load_back_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("nats.yaml");
        let text = "# an identity\nnats:\n  url: tls://a:4222,tls://b:4222\n  user: '123'\n  password_file: '/runs/a: b/password'\n  inbox_prefix: _INBOX_job-trainer\n  replicas: 3\n";
        std::fs::write(&file, text).unwrap();
        let overrides = section_overrides(&file, "nats").unwrap();
        assert_eq!(overrides[0], "nats.url=tls://a:4222,tls://b:4222");
        assert_eq!(overrides[3], "nats.inbox_prefix=_INBOX_job-trainer");
        let loaded = load_value(None, &overrides).unwrap();
        let expected = load_value(Some(&file), &[]).unwrap();
        assert_eq!(loaded["nats"], expected["nats"]);
        assert_eq!(loaded["nats"]["user"], "123");
        assert_eq!(loaded["nats"]["password_file"], "/runs/a: b/password");

        std::fs::write(&file, "run: {name: x}\n").unwrap();
        let err = section_overrides(&file, "nats").unwrap_err().to_string();
        assert!(err.contains("no `nats:` section"), "{err}");
    }
}
