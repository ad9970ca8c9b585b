//! verl parquet datasets, read row by row with the `parquet` crate's record API (no Arrow: the trainer only
//! needs a few thousand rows of nested strings, and Arrow would double the crate's build time).
//!
//! Each row becomes the JSON object a JSONL line would hold, so both formats share one row converter.

use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};

use crate::{DataError, OnRow};

/// Visits every row of a parquet file as a JSON object.
pub(crate) fn visit_parquet(path: &Path, on_row: &mut OnRow<'_>) -> Result<(), DataError> {
    let name = path.display().to_string();
    let read_err = |message: String| DataError::Read { path: name.clone(), message };
    let file = std::fs::File::open(path).map_err(|e| read_err(e.to_string()))?;
    let reader = SerializedFileReader::new(file).map_err(|e| read_err(e.to_string()))?;
    let rows = reader.get_row_iter(None).map_err(|e| read_err(e.to_string()))?;
    for (i, row) in rows.enumerate() {
        let record_err = |message: String| DataError::Record { path: name.clone(), row: i + 1, message };
        let row = row.map_err(|e| record_err(e.to_string()))?;
        on_row(row_to_json(&row), i).map_err(record_err)?;
    }
    Ok(())
}

fn row_to_json(row: &Row) -> serde_json::Value {
    serde_json::Value::Object(row.get_column_iter().map(|(name, field)| (name.clone(), field_to_json(field))).collect())
}

/// A parquet value as JSON: numbers, strings, lists and structs map directly; maps with string keys become
/// objects; anything else (dates, decimals, binary) becomes its display string.
fn field_to_json(field: &Field) -> serde_json::Value {
    use serde_json::Value;
    match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(v) => Value::from(*v),
        Field::Short(v) => Value::from(*v),
        Field::Int(v) => Value::from(*v),
        Field::Long(v) => Value::from(*v),
        Field::UByte(v) => Value::from(*v),
        Field::UShort(v) => Value::from(*v),
        Field::UInt(v) => Value::from(*v),
        Field::ULong(v) => Value::from(*v),
        Field::Float(v) => serde_json::Number::from_f64(f64::from(*v)).map_or(Value::Null, Value::Number),
        Field::Double(v) => serde_json::Number::from_f64(*v).map_or(Value::Null, Value::Number),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => match b.as_utf8() {
            Ok(s) => Value::String(s.to_string()),
            Err(_) => Value::String(field.to_string()),
        },
        Field::Group(row) => row_to_json(row),
        Field::ListInternal(list) => Value::Array(list.elements().iter().map(field_to_json).collect()),
        Field::MapInternal(map) => {
            let entries = map.entries();
            if entries.iter().all(|(k, _)| matches!(k, Field::Str(_))) {
                Value::Object(
                    entries
                        .iter()
                        .filter_map(|(k, v)| match k {
                            Field::Str(key) => Some((key.clone(), field_to_json(v))),
                            _ => None,
                        })
                        .collect(),
                )
            } else {
                Value::Array(
                    entries.iter().map(|(k, v)| Value::Array(vec![field_to_json(k), field_to_json(v)])).collect(),
                )
            }
        }
        other => Value::String(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChatMessage, Prompt};

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
    }

    /// The fixtures are verl gsm8k-shaped tables written by pyarrow (`tests/fixtures/make_fixtures.py`).
    #[test]
    fn verl_parquet_rows_load_with_every_common_codec() {
        for codec in ["snappy", "zstd", "gzip"] {
            let rows = crate::load_file(&fixture(&format!("gsm8k_{codec}.parquet")), "prompt").unwrap();
            assert_eq!(rows.len(), 5, "{codec}");
            let r = &rows[3];
            assert_eq!(r.data_source, "openai/gsm8k");
            assert_eq!(r.ground_truth, "6");
            assert_eq!(r.index, 103);
            assert_eq!(r.extra_info["answer"], "#### 6");
            assert_eq!(
                r.prompt,
                Prompt::Messages(vec![
                    ChatMessage { role: "system".into(), content: "answer with a number".into() },
                    ChatMessage { role: "user".into(), content: "what is 3 + 3?".into() },
                ])
            );
        }
    }

    /// verl would put the second row's image in the prompt: refused, naming the column, the key and the row.
    #[test]
    fn a_row_with_images_is_refused_naming_the_column_and_the_key() {
        let path = fixture("geo3k_images.parquet");
        let err = crate::load_file(&path, "prompt").unwrap_err().to_string();
        assert!(
            err.contains("row 2") && err.contains("column `images` (data.image_key)") && err.contains("multi-modal"),
            "{err}"
        );
        // the image column by another name (verl `data.image_key=pictures`): that column is the one read
        let columns = crate::Columns { prompt: "prompt", image: "pictures", video: "videos" };
        assert_eq!(crate::load_file(&path, columns).unwrap().len(), 2);
    }

    #[test]
    fn missing_prompt_column_names_the_key_and_the_row() {
        let err = crate::load_file(&fixture("gsm8k_snappy.parquet"), "question").unwrap_err().to_string();
        assert!(err.contains("question") && err.contains("row 1"), "{err}");
    }
}
