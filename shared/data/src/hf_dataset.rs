//! HF `datasets` on disk: the directory `Dataset.save_to_disk` writes (`state.json` listing the
//! `data-0000X-of-0000N.arrow` files in order, each an Arrow IPC stream, and `dataset_info.json`), or one such
//! `.arrow` file. A `DatasetDict` directory (`dataset_dict.json` and one directory per split) is refused with its
//! splits named: which split is the train set is the user's to say.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::arrow_ipc::{Field, StreamReader};
use crate::DataError;

/// The part of `state.json` that says where the rows are.
#[derive(Deserialize)]
struct State {
    #[serde(rename = "_data_files")]
    data_files: Vec<DataFile>,
}

#[derive(Deserialize)]
struct DataFile {
    filename: String,
}

#[derive(Deserialize)]
struct DatasetDict {
    splits: Vec<String>,
}

fn read_err(path: &Path, message: impl Into<String>) -> DataError {
    DataError::Read { path: path.display().to_string(), message: message.into() }
}

/// The data files of a `save_to_disk` directory, in order.
pub fn data_files(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let state_path = dir.join("state.json");
    if !state_path.is_file() {
        let dict_path = dir.join("dataset_dict.json");
        if dict_path.is_file() {
            let text = std::fs::read_to_string(&dict_path).map_err(|e| read_err(&dict_path, e.to_string()))?;
            let dict: DatasetDict = serde_json::from_str(&text).map_err(|e| {
                read_err(&dict_path, format!("not the dataset_dict.json of `DatasetDict.save_to_disk`: {e}"))
            })?;
            let example = dict.splits.first().map_or("train", String::as_str);
            return Err(read_err(
                dir,
                format!(
                    "a `datasets` DatasetDict with the splits [{}]: point data.train_files / data.val_files at one \
                     split's directory, e.g. {}",
                    dict.splits.join(", "),
                    dir.join(example).display()
                ),
            ));
        }
        return Err(read_err(
            dir,
            "a directory, but not one `datasets` wrote: it has neither state.json (`Dataset.save_to_disk`) nor \
             dataset_dict.json (`DatasetDict.save_to_disk`); data files may be .parquet, .jsonl or .arrow files, or \
             such a directory",
        ));
    }
    let text = std::fs::read_to_string(&state_path).map_err(|e| read_err(&state_path, e.to_string()))?;
    let state: State = serde_json::from_str(&text)
        .map_err(|e| read_err(&state_path, format!("not the state.json of `Dataset.save_to_disk`: {e}")))?;
    if state.data_files.is_empty() {
        return Err(read_err(&state_path, "`_data_files` lists no data files"));
    }
    state
        .data_files
        .iter()
        .map(|file| {
            let name = Path::new(&file.filename);
            let plain = name.components().count() == 1 && name.file_name().is_some();
            if !plain {
                return Err(read_err(
                    &state_path,
                    format!("`_data_files` names {:?}, not a file of this directory", file.filename),
                ));
            }
            Ok(dir.join(name))
        })
        .collect()
}

/// How two schemas differ, for the error of a data file whose schema is not the first file's.
fn schema_difference(here: &[Field], first: &[Field], first_path: &Path) -> Option<String> {
    let names = |s: &[Field]| s.iter().map(|f| f.name.clone()).collect::<Vec<_>>().join(", ");
    if here.len() != first.len() || here.iter().zip(first).any(|(a, b)| a.name != b.name) {
        return Some(format!("columns [{}] here, [{}] in {}", names(here), names(first), first_path.display()));
    }
    here.iter().zip(first).find(|(a, b)| a != b).map(|(a, b)| {
        format!("column `{}` is {} here, {} in {}", a.name, a.data_type, b.data_type, first_path.display())
    })
}

/// Visits the rows of one Arrow IPC file; `first` is the schema every file of the dataset must have (the first
/// file's), `row` the dataset's row number, advanced past this file's rows. Returns the file's schema.
pub(crate) fn visit_arrow_file(
    path: &Path,
    first: Option<(&Path, &[Field])>,
    row: &mut usize,
    on_row: &mut dyn FnMut(serde_json::Value, usize) -> Result<(), String>,
) -> Result<Vec<Field>, DataError> {
    let file = std::fs::File::open(path).map_err(|e| read_err(path, e.to_string()))?;
    let mut reader = StreamReader::new(std::io::BufReader::new(file)).map_err(|e| read_err(path, e))?;
    let schema = reader.schema().to_vec();
    if let Some((first_path, first_schema)) = first {
        if let Some(diff) = schema_difference(&schema, first_schema, first_path) {
            return Err(read_err(path, format!("its schema differs from the dataset's first file: {diff}")));
        }
    }
    let mut in_file = 0usize;
    while let Some(batch) = reader.next_batch().map_err(|e| read_err(path, e))? {
        for i in 0..batch.num_rows() {
            in_file += 1;
            let record_err =
                |message: String| DataError::Record { path: path.display().to_string(), row: in_file, message };
            let value = batch.row(i).map_err(record_err)?;
            on_row(value, *row).map_err(record_err)?;
            *row += 1;
        }
    }
    Ok(schema)
}

/// Visits the rows of a `save_to_disk` directory, file after file.
pub(crate) fn visit_dir(
    dir: &Path,
    on_row: &mut dyn FnMut(serde_json::Value, usize) -> Result<(), String>,
) -> Result<(), DataError> {
    let files = data_files(dir)?;
    let mut row = 0;
    let mut first: Option<(PathBuf, Vec<Field>)> = None;
    for path in &files {
        let schema =
            visit_arrow_file(path, first.as_ref().map(|(p, s)| (p.as_path(), s.as_slice())), &mut row, on_row)?;
        if first.is_none() {
            first = Some((path.clone(), schema));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{load_file, load_rows};
    use serde_json::json;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
    }

    fn repo_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// `JETRL_PYTHON`, else the project's `.venv/bin/python`, if it imports `datasets` (`./dev.sh test` installs it).
    fn python_with_datasets() -> Result<PathBuf, String> {
        let python =
            std::env::var_os("JETRL_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo_root().join(".venv/bin/python"));
        match std::process::Command::new(&python).args(["-c", "import datasets, pyarrow"]).output() {
            Ok(out) if out.status.success() => Ok(python),
            Ok(out) => Err(format!(
                "`{} -c \"import datasets, pyarrow\"` failed: {}",
                python.display(),
                String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
            )),
            Err(err) => Err(format!("cannot run {}: {err}", python.display())),
        }
    }

    fn run_python(python: &Path, args: &[&std::ffi::OsStr]) {
        let out = std::process::Command::new(python).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{} {args:?}:\n{}{}",
            python.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A copy of a fixture directory to break.
    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }

    /// `tests/fixtures/gsm8k_hf` holds the rows of `gsm8k_*.parquet` as `Dataset.save_to_disk` wrote them, in two
    /// shards (`tests/fixtures/make_fixtures.py`).
    #[test]
    fn save_to_disk_directory_loads_the_same_rows_as_parquet() {
        let dir = fixture("gsm8k_hf");
        assert_eq!(data_files(&dir).unwrap().len(), 2);
        let parquet = fixture("gsm8k_snappy.parquet");
        assert_eq!(load_rows(&dir).unwrap(), load_rows(&parquet).unwrap());
        let rows = load_file(&dir, "prompt").unwrap();
        assert_eq!(rows, load_file(&parquet, "prompt").unwrap());
        assert_eq!((rows.len(), rows[3].index, rows[3].ground_truth.as_str()), (5, 103, "6"));
        // one shard alone, given as a file
        let shard = load_rows(&dir.join("data-00001-of-00002.arrow")).unwrap();
        assert_eq!(shard, load_rows(&parquet).unwrap()[3..]);
    }

    #[test]
    fn a_dataset_dict_is_refused_naming_its_splits_and_a_split_directory() {
        let dir = fixture("hf_dict");
        let err = load_file(&dir, "prompt").unwrap_err().to_string();
        assert!(err.contains("DatasetDict") && err.contains("[train, test]"), "{err}");
        assert!(err.contains(&dir.join("train").display().to_string()), "{err}");
        // a split directory loads
        let rows = load_file(&dir.join("train"), "prompt").unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[2].ground_truth, "2");
        assert_eq!(rows[2].prompt, crate::Prompt::Text("copy 2".into()));
    }

    #[test]
    fn a_directory_datasets_did_not_write_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("train.parquet"), b"").unwrap();
        let err = load_file(dir.path(), "prompt").unwrap_err().to_string();
        assert!(err.starts_with(&format!("reading {}: ", dir.path().display())), "{err}");
        assert!(err.contains("neither state.json") && err.contains("dataset_dict.json"), "{err}");
    }

    #[test]
    fn state_json_that_is_broken_or_points_outside_the_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(&fixture("gsm8k_hf"), dir.path());
        let state = dir.path().join("state.json");
        for (text, expected) in [
            (r#"{"_data_files": [{"filename": "../secret.arrow"}]}"#, "not a file of this directory"),
            (r#"{"_data_files": [{"filename": "/etc/passwd"}]}"#, "not a file of this directory"),
            (r#"{"_data_files": []}"#, "lists no data files"),
            (r#"{"_fingerprint": "x"}"#, "missing field `_data_files`"),
            (r#"{"_data_files": [{"filename": "data-00009-of-00010.arrow"}]}"#, "data-00009-of-00010.arrow"),
        ] {
            std::fs::write(&state, text).unwrap();
            let err = load_file(dir.path(), "prompt").unwrap_err().to_string();
            assert!(err.contains(expected), "{text}: {err}");
            assert!(err.contains(&dir.path().display().to_string()), "{text}: {err}");
        }
    }

    #[test]
    fn a_truncated_data_file_is_an_error_naming_it_at_every_cut() {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(&fixture("gsm8k_hf"), dir.path());
        let shard = dir.path().join("data-00001-of-00002.arrow");
        let bytes = std::fs::read(&shard).unwrap();
        for cut in 0..bytes.len() {
            let err = crate::arrow_ipc::read_all(&bytes[..cut]).unwrap_err();
            assert!(!err.is_empty(), "cut {cut}");
        }
        for cut in [0, 7, 100, bytes.len() / 2, bytes.len() - 8, bytes.len() - 1] {
            std::fs::write(&shard, &bytes[..cut]).unwrap();
            let err = load_file(dir.path(), "prompt").unwrap_err().to_string();
            assert!(err.contains(&shard.display().to_string()), "cut {cut}: {err}");
            assert!(err.contains("truncated") || err.contains("empty"), "cut {cut}: {err}");
        }
    }

    #[test]
    fn a_data_file_with_another_schema_is_refused_naming_it_and_the_difference() {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(&fixture("gsm8k_hf"), dir.path());
        let shard = dir.path().join("data-00001-of-00002.arrow");
        std::fs::copy(fixture("hf_dict/train/data-00000-of-00001.arrow"), &shard).unwrap();
        let err = load_file(dir.path(), "prompt").unwrap_err().to_string();
        assert!(err.starts_with(&format!("reading {}: its schema differs", shard.display())), "{err}");
        assert!(err.contains("columns [data_source, prompt, reward_model] here"), "{err}");
    }

    #[test]
    fn rows_without_the_prompt_column_name_the_file_and_row() {
        let err = load_file(&fixture("gsm8k_hf"), "question").unwrap_err().to_string();
        assert!(err.contains("data-00000-of-00002.arrow row 1: missing `question`"), "{err}");
        let err = load_file(&fixture("hf_dict/train"), "messages").unwrap_err().to_string();
        assert!(err.contains("row 1: missing `messages`"), "{err}");
    }

    /// Streams pyarrow wrote (`pa.ipc.new_stream` with a schema and no batches) with a `timestamp[s]` column `when`
    /// and a dictionary-encoded column `tag`.
    const TIMESTAMP_STREAM: &[u8] = &[
        0xff, 0xff, 0xff, 0xff, 0x70, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x0a, 0x00, 0x0c, 0x00,
        0x06, 0x00, 0x05, 0x00, 0x08, 0x00, 0x0a, 0x00, 0x00, 0x00, 0x00, 0x01, 0x04, 0x00, 0x0c, 0x00, 0x00, 0x00,
        0x08, 0x00, 0x08, 0x00, 0x00, 0x00, 0x04, 0x00, 0x08, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x01, 0x00,
        0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x10, 0x00, 0x14, 0x00, 0x08, 0x00, 0x06, 0x00, 0x07, 0x00, 0x0c, 0x00,
        0x00, 0x00, 0x10, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x0a, 0x10, 0x00, 0x00, 0x00, 0x1c, 0x00,
        0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x77, 0x68, 0x65, 0x6e,
        0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x04, 0x00, 0x04, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00,
        0x00, 0x00,
    ];
    const DICTIONARY_STREAM: &[u8] = &[
        0xff, 0xff, 0xff, 0xff, 0x90, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x0a, 0x00, 0x0c, 0x00,
        0x06, 0x00, 0x05, 0x00, 0x08, 0x00, 0x0a, 0x00, 0x00, 0x00, 0x00, 0x01, 0x04, 0x00, 0x04, 0x00, 0x00, 0x00,
        0xbc, 0xff, 0xff, 0xff, 0x04, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x10, 0x00,
        0x18, 0x00, 0x08, 0x00, 0x06, 0x00, 0x07, 0x00, 0x0c, 0x00, 0x10, 0x00, 0x14, 0x00, 0x10, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x01, 0x05, 0x14, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00, 0x1c, 0x00, 0x00, 0x00, 0x04, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x74, 0x61, 0x67, 0x00, 0x08, 0x00, 0x08, 0x00,
        0x00, 0x00, 0x04, 0x00, 0x08, 0x00, 0x00, 0x00, 0x0c, 0x00, 0x00, 0x00, 0x08, 0x00, 0x0c, 0x00, 0x08, 0x00,
        0x07, 0x00, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x20, 0x00, 0x00, 0x00, 0x04, 0x00, 0x04, 0x00,
        0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00,
    ];

    #[test]
    fn unsupported_column_types_are_refused_naming_the_column_and_the_file() {
        let err = crate::arrow_ipc::read_all(TIMESTAMP_STREAM).unwrap_err();
        assert!(err.contains("column `when` has Arrow type Timestamp"), "{err}");
        let err = crate::arrow_ipc::read_all(DICTIONARY_STREAM).unwrap_err();
        assert!(err.contains("column `tag` is dictionary-encoded"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("when.arrow");
        std::fs::write(&path, TIMESTAMP_STREAM).unwrap();
        let err = load_file(&path, "prompt").unwrap_err().to_string();
        assert!(err.starts_with(&format!("reading {}: schema at byte 0: column `when`", path.display())), "{err}");
    }

    /// The same rows of every column type jetrl reads, saved by `datasets` and written as parquet by pyarrow
    /// (`tests/hf_rows.py`), read back equal: the parquet reader is the reference.
    #[test]
    fn arrow_rows_of_every_type_equal_the_same_rows_read_from_parquet() {
        let python = match python_with_datasets() {
            Ok(python) => python,
            Err(why) => {
                assert!(std::env::var("CI").as_deref() != Ok("true"), "python with datasets is missing: {why}");
                eprintln!("SKIPPED arrow_rows_of_every_type_equal_the_same_rows_read_from_parquet: {why}");
                return;
            }
        };
        let out = tempfile::tempdir().unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf_rows.py");
        run_python(&python, &[script.as_os_str(), out.path().as_os_str()]);
        let parquet = load_rows(&out.path().join("rows.parquet")).unwrap();
        assert_eq!(parquet.len(), 14);
        for arrow in ["hf", "batches.arrow", "file_format.arrow", "legacy.arrow"] {
            let rows = load_rows(&out.path().join(arrow)).unwrap();
            for (i, (a, p)) in rows.iter().zip(&parquet).enumerate() {
                assert_eq!(a, p, "{arrow} row {i}");
            }
            assert_eq!(rows.len(), parquet.len(), "{arrow}");
        }
        // the reference itself, on values where a shared mistake would hide
        let (r0, r1) = (&parquet[0], &parquet[1]);
        assert_eq!(r0["extra_info"]["big"], json!(u64::MAX));
        assert_eq!(r0["extra_info"]["small"], json!(-128));
        assert_eq!(r0["extra_info"]["score"], json!(1.5));
        assert_eq!(r1["extra_info"]["score"], json!(null), "NaN");
        assert_eq!(r1["extra_info"]["weight"], json!(null));
        assert_eq!(r0["extra_info"]["matrix"], json!([[1, 2], [], [3]]));
        assert_eq!(r0["extra_info"]["nested"], json!({"a": 0, "b": {"c": "c0"}}));
        assert_eq!((&r0["blob"], &r1["blob"]), (&json!("text"), &json!("[255, 0, 1]")));
        assert_eq!(r1["prompt"], json!([{"role": "system", "content": "be brief"}]));
        assert_eq!(parquet[7]["reward_model"], json!(null));
        assert_eq!(parquet[3]["steps"], json!([0, 1, 2]));
        assert_eq!(r0["nothing"], json!(null));
        // a row without a prompt names its file and its row within it (rows 0-4 are the first shard)
        let err = load_file(&out.path().join("hf"), "prompt").unwrap_err().to_string();
        assert!(err.contains("data-00001-of-00003.arrow row 1: missing `prompt`"), "{err}");
    }

    /// `scripts/make_gsm8k_sample.py` writes verl's gsm8k layout as parquet and as `save_to_disk` directories with the
    /// same rows; each row's worked answer scores 1.0 with the gsm8k scorer, another number 0.
    #[test]
    fn gsm8k_sample_is_verl_layout_in_both_formats_and_its_answers_score_one() {
        let python = match python_with_datasets() {
            Ok(python) => python,
            Err(why) => {
                assert!(std::env::var("CI").as_deref() != Ok("true"), "python with datasets is missing: {why}");
                eprintln!("SKIPPED gsm8k_sample_is_verl_layout_in_both_formats_and_its_answers_score_one: {why}");
                return;
            }
        };
        let out = tempfile::tempdir().unwrap();
        let script = repo_root().join("scripts/make_gsm8k_sample.py");
        let args = ["--format", "both", "--train-size", "60", "--test-size", "12", "--out"];
        let mut argv: Vec<&std::ffi::OsStr> = vec![script.as_os_str()];
        argv.extend(args.iter().map(std::ffi::OsStr::new));
        argv.push(out.path().as_os_str());
        run_python(&python, &argv);
        let options = jetrl_config::RuleScorerConfig::default();
        for (split, size) in [("train", 60), ("test", 12)] {
            let parquet = out.path().join(format!("{split}.parquet"));
            assert_eq!(load_rows(&out.path().join(split)).unwrap(), load_rows(&parquet).unwrap(), "{split}");
            let rows = load_file(&parquet, "prompt").unwrap();
            assert_eq!(rows.len(), size);
            for (i, row) in rows.iter().enumerate() {
                assert_eq!((row.data_source.as_str(), row.index), ("openai/gsm8k", i as u64));
                assert_eq!(row.extra_info["split"], split);
                let question = row.extra_info["question"].as_str().unwrap();
                let crate::Prompt::Messages(messages) = &row.prompt else { panic!("row {i}: {:?}", row.prompt) };
                assert_eq!(messages.len(), 1);
                assert_eq!(messages[0].role, "user");
                assert_eq!(
                    messages[0].content,
                    format!("{question} Let's think step by step and output the final answer after \"####\".")
                );
                let answer = row.extra_info["answer"].as_str().unwrap();
                assert!(answer.ends_with(&format!("\n#### {}", row.ground_truth)), "row {i}: {answer}");
                let score = |response: &str| {
                    jetrl_reward::rule::default_compute_score(&row.data_source, response, &row.ground_truth, &options)
                        .unwrap()
                        .score
                };
                assert_eq!(score(answer), 1.0, "row {i}: {answer}");
                assert_eq!(score(&format!("So the answer is\n#### {}", row.ground_truth)), 1.0);
                let wrong: i64 = row.ground_truth.parse::<i64>().unwrap() + 1;
                assert_eq!(score(&format!("#### {wrong}")), 0.0);
                assert_eq!(score(&row.ground_truth), 0.0, "no `#### `: no answer");
            }
        }
        let all = load_rows(&out.path().join("train.parquet")).unwrap();
        let keys: Vec<&String> = all[0].as_object().unwrap().keys().collect();
        let mut expected = ["data_source", "prompt", "ability", "reward_model", "extra_info"];
        expected.sort();
        assert_eq!(keys, expected, "verl's columns");
        assert_eq!(all[0]["ability"], "math");
        assert_eq!(all[0]["reward_model"]["style"], "rule");
    }
}
