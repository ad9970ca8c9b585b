//! One file: one reader of one format, from the stream's framing to JSON rows.
//!
//! Arrow IPC streams read into JSON rows: the `data-0000X-of-0000N.arrow` files `datasets.Dataset.save_to_disk`
//! writes (and the IPC *file* format, whose stream sits between the `ARROW1` magic and the footer).
//!
//! A small reader of its own rather than the `arrow-ipc` crate: that crate brings `arrow-array` and `arrow-select`,
//! about 80 s of compile for a dataset of a few thousand rows of nested strings (the reason the parquet reader
//! runs without Arrow too). Each row becomes the JSON object the parquet reader makes of the same row (see
//! `parquet_rows.rs`), so every format shares one row converter.
//!
//! Read: null, bool, signed and unsigned integers, float32/64, utf8 and binary (regular and large), fixed-size
//! binary, list, large list, fixed-size list, struct and map, nested to any depth. Refused with the column named:
//! dictionary-encoded columns and the other types (temporal, decimal, float16, union, view, run-end encoded).
//! Refused for the whole file: compressed bodies, big-endian data and metadata versions before V4 (Arrow 0.8).
//! Every offset and length the file holds is checked before it is used: a corrupt or truncated file is an error
//! saying where, never a panic or an allocation the file's bytes cannot back.

use std::cell::Cell;
use std::fmt;
use std::io::Read;

use serde_json::{Map, Value};

/// A column's name and type.
#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    pub name: String,
    pub data_type: DataType,
}

/// The Arrow types this reader decodes.
#[derive(Debug, Clone, PartialEq)]
pub enum DataType {
    Null,
    Bool,
    Int {
        bytes: usize,
        signed: bool,
    },
    Float {
        bytes: usize,
    },
    Utf8 {
        large: bool,
    },
    Binary {
        large: bool,
    },
    FixedSizeBinary(usize),
    List {
        large: bool,
        item: Box<Field>,
    },
    FixedSizeList {
        size: usize,
        item: Box<Field>,
    },
    Struct(Vec<Field>),
    /// `entries` is a struct of `key` and `value`
    Map(Box<Field>),
}

impl fmt::Display for DataType {
    /// pyarrow's spelling of the type (`list<item: struct<role: string, content: string>>`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let large = |large: &bool| if *large { "large_" } else { "" };
        match self {
            Self::Null => write!(f, "null"),
            Self::Bool => write!(f, "bool"),
            Self::Int { bytes, signed } => write!(f, "{}int{}", if *signed { "" } else { "u" }, bytes * 8),
            Self::Float { bytes: 4 } => write!(f, "float"),
            Self::Float { .. } => write!(f, "double"),
            Self::Utf8 { large: l } => write!(f, "{}string", large(l)),
            Self::Binary { large: l } => write!(f, "{}binary", large(l)),
            Self::FixedSizeBinary(width) => write!(f, "fixed_size_binary[{width}]"),
            Self::List { large: l, item } => write!(f, "{}list<{}: {}>", large(l), item.name, item.data_type),
            Self::FixedSizeList { size, item } => {
                write!(f, "fixed_size_list<{}: {}>[{size}]", item.name, item.data_type)
            }
            Self::Struct(fields) => {
                write!(f, "struct<")?;
                for (i, field) in fields.iter().enumerate() {
                    write!(f, "{}{}: {}", if i > 0 { ", " } else { "" }, field.name, field.data_type)?;
                }
                write!(f, ">")
            }
            Self::Map(entries) => write!(f, "map<{}>", entries.data_type),
        }
    }
}

/// How deep types may nest: far beyond any dataset, and a bound on the reader's recursion.
const MAX_DEPTH: usize = 64;

/// JSON values a record batch may produce beyond what its body bytes can encode. Every non-null value of a typed
/// column costs at least a bit of the body; `null`-typed columns and structs without fields cost nothing, so a
/// corrupt length there could otherwise ask for unbounded rows.
const FREE_VALUES_PER_BATCH: u64 = 1 << 20;

// ---------------------------------------------------------------------------------------------------------------
// flatbuffers: the message metadata, read with every offset checked

fn bytes_at<const N: usize>(buf: &[u8], at: usize) -> Result<[u8; N], String> {
    let slice = at.checked_add(N).and_then(|end| buf.get(at..end)).ok_or_else(|| {
        format!("corrupt message metadata: a {N}-byte value at offset {at} of a {}-byte flatbuffer", buf.len())
    })?;
    let mut out = [0u8; N];
    out.copy_from_slice(slice);
    Ok(out)
}

fn u16_at(buf: &[u8], at: usize) -> Result<u16, String> {
    bytes_at(buf, at).map(u16::from_le_bytes)
}

fn u32_at(buf: &[u8], at: usize) -> Result<u32, String> {
    bytes_at(buf, at).map(u32::from_le_bytes)
}

fn i64_at(buf: &[u8], at: usize) -> Result<i64, String> {
    bytes_at(buf, at).map(i64::from_le_bytes)
}

/// One flatbuffer table: its position and its vtable.
#[derive(Clone, Copy)]
struct Table<'a> {
    buf: &'a [u8],
    pos: usize,
    vtable: usize,
    vtable_len: usize,
}

impl<'a> Table<'a> {
    fn root(buf: &'a [u8]) -> Result<Self, String> {
        Self::at(buf, u32_at(buf, 0)? as usize)
    }

    fn at(buf: &'a [u8], pos: usize) -> Result<Self, String> {
        let back = i64::from(i32::from_le_bytes(bytes_at(buf, pos)?));
        let vtable = usize::try_from(pos as i64 - back)
            .map_err(|_| format!("corrupt message metadata: the table at offset {pos} has its vtable before byte 0"))?;
        let vtable_len = u16_at(buf, vtable)? as usize;
        if vtable_len < 4 || vtable.checked_add(vtable_len).is_none_or(|end| end > buf.len()) {
            return Err(format!("corrupt message metadata: vtable at offset {vtable} of {vtable_len} bytes"));
        }
        Ok(Self { buf, pos, vtable, vtable_len })
    }

    /// Where field `id` is stored, or `None` when the table leaves it at its default.
    fn field(&self, id: usize) -> Result<Option<usize>, String> {
        let entry = 4 + 2 * id;
        if entry + 2 > self.vtable_len {
            return Ok(None);
        }
        match u16_at(self.buf, self.vtable + entry)? {
            0 => Ok(None),
            offset => Ok(Some(self.pos + offset as usize)),
        }
    }

    fn scalar<const N: usize>(&self, id: usize) -> Result<Option<[u8; N]>, String> {
        self.field(id)?.map(|at| bytes_at(self.buf, at)).transpose()
    }

    fn u8(&self, id: usize, default: u8) -> Result<u8, String> {
        Ok(self.scalar::<1>(id)?.map_or(default, |b| b[0]))
    }

    fn i16(&self, id: usize, default: i16) -> Result<i16, String> {
        Ok(self.scalar(id)?.map_or(default, i16::from_le_bytes))
    }

    fn i32(&self, id: usize, default: i32) -> Result<i32, String> {
        Ok(self.scalar(id)?.map_or(default, i32::from_le_bytes))
    }

    fn i64(&self, id: usize, default: i64) -> Result<i64, String> {
        Ok(self.scalar(id)?.map_or(default, i64::from_le_bytes))
    }

    /// The position an offset field points at.
    fn target(&self, id: usize) -> Result<Option<usize>, String> {
        let Some(at) = self.field(id)? else { return Ok(None) };
        let target = at
            .checked_add(u32_at(self.buf, at)? as usize)
            .filter(|&t| t < self.buf.len())
            .ok_or_else(|| format!("corrupt message metadata: an offset at {at} points past the end"))?;
        Ok(Some(target))
    }

    fn table(&self, id: usize) -> Result<Option<Table<'a>>, String> {
        self.target(id)?.map(|pos| Table::at(self.buf, pos)).transpose()
    }

    /// A vector's first element and its length, with `elem` bytes per element all inside the buffer.
    fn vector(&self, id: usize, elem: usize) -> Result<Option<(usize, usize)>, String> {
        let Some(at) = self.target(id)? else { return Ok(None) };
        let len = u32_at(self.buf, at)? as usize;
        let start = at + 4;
        if len.checked_mul(elem).and_then(|n| n.checked_add(start)).is_none_or(|end| end > self.buf.len()) {
            return Err(format!(
                "corrupt message metadata: a vector of {len} elements at offset {at} runs past the end"
            ));
        }
        Ok(Some((start, len)))
    }

    fn string(&self, id: usize) -> Result<Option<&'a str>, String> {
        let Some((start, len)) = self.vector(id, 1)? else { return Ok(None) };
        std::str::from_utf8(&self.buf[start..start + len])
            .map(Some)
            .map_err(|_| format!("corrupt message metadata: the string at offset {start} is not UTF-8"))
    }

    fn tables(&self, id: usize) -> Result<Vec<Table<'a>>, String> {
        let Some((start, len)) = self.vector(id, 4)? else { return Ok(Vec::new()) };
        (0..len)
            .map(|i| {
                let at = start + 4 * i;
                let pos = at
                    .checked_add(u32_at(self.buf, at)? as usize)
                    .ok_or_else(|| format!("corrupt message metadata: an offset at {at} points past the end"))?;
                Table::at(self.buf, pos)
            })
            .collect()
    }

    /// A vector of structs of two `long`s (`FieldNode`, `Buffer`).
    fn long_pairs(&self, id: usize) -> Result<Vec<(i64, i64)>, String> {
        let Some((start, len)) = self.vector(id, 16)? else { return Ok(Vec::new()) };
        (0..len).map(|i| Ok((i64_at(self.buf, start + 16 * i)?, i64_at(self.buf, start + 16 * i + 8)?))).collect()
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Schema.fbs and Message.fbs

/// `MessageHeader` union members.
const HEADER_SCHEMA: u8 = 1;
const HEADER_DICTIONARY_BATCH: u8 = 2;
const HEADER_RECORD_BATCH: u8 = 3;
/// `MetadataVersion::V4` (Arrow 0.8 and later; V5 from Arrow 1.0).
const METADATA_V4: i16 = 3;

/// The names of the `Type` union's members, for the refusal of the ones not read.
const TYPE_NAMES: [&str; 27] = [
    "NONE",
    "Null",
    "Int",
    "FloatingPoint",
    "Binary",
    "Utf8",
    "Bool",
    "Decimal",
    "Date",
    "Time",
    "Timestamp",
    "Interval",
    "List",
    "Struct",
    "Union",
    "FixedSizeBinary",
    "FixedSizeList",
    "Map",
    "Duration",
    "LargeBinary",
    "LargeUtf8",
    "LargeList",
    "RunEndEncoded",
    "BinaryView",
    "Utf8View",
    "ListView",
    "LargeListView",
];

/// A `Field` table; `path` is the dotted name of its parent, for errors.
fn parse_field(table: &Table<'_>, path: &str, depth: usize) -> Result<Field, String> {
    let name = table.string(0)?.unwrap_or_default().to_string();
    let path = if path.is_empty() { name.clone() } else { format!("{path}.{name}") };
    if depth > MAX_DEPTH {
        return Err(format!("column `{path}` nests types more than {MAX_DEPTH} deep"));
    }
    if table.field(4)?.is_some() {
        return Err(format!(
            "column `{path}` is dictionary-encoded, which jetrl does not read (decode it: `Dataset.cast` to plain values)"
        ));
    }
    let type_id = table.u8(2, 0)?;
    let type_table = table.table(3)?;
    let children = table.tables(5)?;
    let child = |i: usize| -> Result<Box<Field>, String> {
        let child = children.get(i).ok_or_else(|| format!("column `{path}`: its type needs a child field"))?;
        Ok(Box::new(parse_field(child, &path, depth + 1)?))
    };
    let param =
        |id: usize, default: i32| -> Result<i32, String> { type_table.map_or(Ok(default), |t| t.i32(id, default)) };
    let data_type = match type_id {
        1 => DataType::Null,
        2 => {
            let bits = param(0, 0)?;
            let signed = type_table.map_or(Ok(0), |t| t.u8(1, 0))? != 0;
            match bits {
                8 | 16 | 32 | 64 => DataType::Int { bytes: bits as usize / 8, signed },
                _ => return Err(format!("column `{path}`: an integer of {bits} bits")),
            }
        }
        3 => match type_table.map_or(Ok(0), |t| t.i16(0, 0))? {
            1 => DataType::Float { bytes: 4 },
            2 => DataType::Float { bytes: 8 },
            0 => return Err(format!("column `{path}` is float16, which jetrl does not read (cast it to float32)")),
            other => return Err(format!("column `{path}`: unknown float precision {other}")),
        },
        4 => DataType::Binary { large: false },
        5 => DataType::Utf8 { large: false },
        6 => DataType::Bool,
        12 => DataType::List { large: false, item: child(0)? },
        13 => DataType::Struct(
            children.iter().map(|c| parse_field(c, &path, depth + 1)).collect::<Result<Vec<_>, String>>()?,
        ),
        15 => match param(0, 0)? {
            width if width >= 0 => DataType::FixedSizeBinary(width as usize),
            width => return Err(format!("column `{path}`: fixed-size binary of width {width}")),
        },
        16 => match param(0, 0)? {
            size if size >= 0 => DataType::FixedSizeList { size: size as usize, item: child(0)? },
            size => return Err(format!("column `{path}`: fixed-size list of size {size}")),
        },
        17 => {
            let entries = child(0)?;
            match &entries.data_type {
                DataType::Struct(kv) if kv.len() == 2 => DataType::Map(entries),
                other => return Err(format!("column `{path}`: map entries of type {other}, not a key-value struct")),
            }
        }
        19 => DataType::Binary { large: true },
        20 => DataType::Utf8 { large: true },
        21 => DataType::List { large: true, item: child(0)? },
        other => {
            let name = TYPE_NAMES.get(other as usize).copied().unwrap_or("unknown");
            return Err(format!(
                "column `{path}` has Arrow type {name} (type id {other}), which jetrl does not read: columns may be \
                 null, bool, integers, float32/64, strings, binary, lists, structs and maps"
            ));
        }
    };
    Ok(Field { name, data_type })
}

fn parse_schema(schema: &Table<'_>) -> Result<Vec<Field>, String> {
    if schema.i16(0, 0)? != 0 {
        return Err("the data is big-endian; jetrl reads little-endian Arrow only".into());
    }
    schema.tables(1)?.iter().map(|f| parse_field(f, "", 0)).collect()
}

// ---------------------------------------------------------------------------------------------------------------
// record batches

type Span = std::ops::Range<usize>;

/// One decoded column of a record batch: spans of the batch's body, checked to lie inside it.
#[derive(Debug)]
struct Column {
    len: usize,
    /// the validity bitmap; `None` when every value is valid
    validity: Option<Span>,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Null,
    Bool(Span),
    Int { values: Span, bytes: usize, signed: bool },
    Float { values: Span, bytes: usize },
    Bytes { offsets: Span, large: bool, data: Span, utf8: bool },
    FixedBytes { values: Span, width: usize },
    List { offsets: Span, large: bool, item: Box<Column> },
    FixedList { size: usize, item: Box<Column> },
    Struct(Vec<(String, Column)>),
    Map { offsets: Span, entries: Box<Column> },
}

/// Walks a record batch's field nodes and buffers in schema order (depth first).
struct Decoder<'a> {
    nodes: std::slice::Iter<'a, (i64, i64)>,
    buffers: std::slice::Iter<'a, (i64, i64)>,
    body_len: usize,
}

impl Decoder<'_> {
    fn node(&mut self, path: &str) -> Result<(usize, usize), String> {
        let &(len, nulls) = self.nodes.next().ok_or_else(|| format!("column `{path}`: no field node for it"))?;
        let len = usize::try_from(len).map_err(|_| format!("column `{path}`: length {len}"))?;
        let nulls = usize::try_from(nulls).map_err(|_| format!("column `{path}`: null count {nulls}"))?;
        Ok((len, nulls))
    }

    /// The next buffer, which must hold at least `min` bytes.
    fn buffer(&mut self, path: &str, what: &str, min: Option<usize>) -> Result<Span, String> {
        let &(offset, len) =
            self.buffers.next().ok_or_else(|| format!("column `{path}`: its {what} buffer is missing"))?;
        let span = usize::try_from(offset)
            .ok()
            .zip(usize::try_from(len).ok())
            .and_then(|(o, l)| Some(o..o.checked_add(l)?))
            .filter(|s| s.end <= self.body_len)
            .ok_or_else(|| {
                format!(
                    "column `{path}`: its {what} buffer (offset {offset}, {len} bytes) lies outside the {}-byte body",
                    self.body_len
                )
            })?;
        match min {
            Some(min) if span.len() < min => {
                Err(format!("column `{path}`: its {what} buffer has {} bytes, {min} needed", span.len()))
            }
            _ => Ok(span),
        }
    }

    /// The validity bitmap: empty means no nulls.
    fn validity(&mut self, path: &str, len: usize, nulls: usize) -> Result<Option<Span>, String> {
        let span = self.buffer(path, "validity", None)?;
        if span.is_empty() {
            if nulls > 0 {
                return Err(format!("column `{path}`: {nulls} nulls but no validity bitmap"));
            }
            return Ok(None);
        }
        if span.len() < len.div_ceil(8) {
            return Err(format!("column `{path}`: a validity bitmap of {} bytes for {len} values", span.len()));
        }
        Ok(Some(span))
    }

    fn offsets(&mut self, path: &str, len: usize, large: bool) -> Result<Span, String> {
        let width = if large { 8 } else { 4 };
        let min =
            if len == 0 { 0 } else { len.checked_add(1).and_then(|n| n.checked_mul(width)).unwrap_or(usize::MAX) };
        self.buffer(path, "offsets", Some(min))
    }

    fn column(&mut self, field: &Field, parent: &str) -> Result<Column, String> {
        let path = if parent.is_empty() { field.name.clone() } else { format!("{parent}.{}", field.name) };
        let (len, nulls) = self.node(&path)?;
        let fixed = |width: usize| len.saturating_mul(width);
        if field.data_type == DataType::Null {
            return Ok(Column { len, validity: None, kind: Kind::Null });
        }
        let validity = self.validity(&path, len, nulls)?;
        let kind = match &field.data_type {
            DataType::Null => Kind::Null,
            DataType::Bool => Kind::Bool(self.buffer(&path, "values", Some(len.div_ceil(8)))?),
            &DataType::Int { bytes, signed } => {
                Kind::Int { values: self.buffer(&path, "values", Some(fixed(bytes)))?, bytes, signed }
            }
            &DataType::Float { bytes } => {
                Kind::Float { values: self.buffer(&path, "values", Some(fixed(bytes)))?, bytes }
            }
            &DataType::Utf8 { large } | &DataType::Binary { large } => Kind::Bytes {
                offsets: self.offsets(&path, len, large)?,
                large,
                data: self.buffer(&path, "data", None)?,
                utf8: matches!(field.data_type, DataType::Utf8 { .. }),
            },
            &DataType::FixedSizeBinary(width) => {
                Kind::FixedBytes { values: self.buffer(&path, "values", Some(fixed(width)))?, width }
            }
            DataType::List { large, item } => Kind::List {
                offsets: self.offsets(&path, len, *large)?,
                large: *large,
                item: Box::new(self.column(item, &path)?),
            },
            DataType::FixedSizeList { size, item } => {
                Kind::FixedList { size: *size, item: Box::new(self.column(item, &path)?) }
            }
            DataType::Struct(fields) => Kind::Struct(
                fields.iter().map(|f| Ok((f.name.clone(), self.column(f, &path)?))).collect::<Result<_, String>>()?,
            ),
            DataType::Map(entries) => {
                Kind::Map { offsets: self.offsets(&path, len, false)?, entries: Box::new(self.column(entries, &path)?) }
            }
        };
        Ok(Column { len, validity, kind })
    }
}

/// One record batch: its body and its columns, read row by row with [`RecordBatch::row`].
pub struct RecordBatch {
    body: Vec<u8>,
    rows: usize,
    columns: Vec<(String, Column)>,
    values_left: Cell<u64>,
}

impl RecordBatch {
    pub fn num_rows(&self) -> usize {
        self.rows
    }

    /// Row `i` as a JSON object of the top-level columns.
    pub fn row(&self, i: usize) -> Result<Value, String> {
        if i >= self.rows {
            return Err(format!("row {i} of a batch of {} rows", self.rows));
        }
        self.spend()?;
        let mut out = Map::new();
        for (name, column) in &self.columns {
            let value = self.value(column, i).map_err(|e| format!("column `{name}`: {e}"))?;
            out.insert(name.clone(), value);
        }
        Ok(Value::Object(out))
    }

    fn spend(&self) -> Result<(), String> {
        let left = self.values_left.get();
        if left == 0 {
            return Err(format!(
                "the record batch holds more values than its {}-byte body can encode (a corrupt length)",
                self.body.len()
            ));
        }
        self.values_left.set(left - 1);
        Ok(())
    }

    fn bytes(&self, span: &Span, at: usize, n: usize) -> Result<&[u8], String> {
        at.checked_mul(n)
            .and_then(|start| Some(span.start.checked_add(start)?..span.start.checked_add(start.checked_add(n)?)?))
            .filter(|r| r.end <= span.end)
            .and_then(|r| self.body.get(r))
            .ok_or_else(|| format!("value {at} lies outside its buffer"))
    }

    fn bit(&self, span: &Span, i: usize) -> Result<bool, String> {
        Ok(self.bytes(span, i / 8, 1)?[0] & (1 << (i % 8)) != 0)
    }

    /// Offsets `i` and `i + 1` of an offsets buffer, checked to be increasing and within `limit`.
    fn range(&self, offsets: &Span, large: bool, i: usize, limit: usize) -> Result<Span, String> {
        let at = |k: usize| -> Result<i64, String> {
            if large {
                Ok(i64::from_le_bytes(self.bytes(offsets, k, 8)?.try_into().map_err(|_| "offset width")?))
            } else {
                Ok(i64::from(i32::from_le_bytes(self.bytes(offsets, k, 4)?.try_into().map_err(|_| "offset width")?)))
            }
        };
        let (start, end) = (at(i)?, at(i + 1)?);
        match (usize::try_from(start), usize::try_from(end)) {
            (Ok(s), Ok(e)) if s <= e && e <= limit => Ok(s..e),
            _ => Err(format!("value {i} spans offsets {start}..{end}, outside 0..{limit}")),
        }
    }

    fn value(&self, column: &Column, i: usize) -> Result<Value, String> {
        self.spend()?;
        if i >= column.len {
            return Err(format!("value {i} of a column of {} values", column.len));
        }
        if let Some(validity) = &column.validity {
            if !self.bit(validity, i)? {
                return Ok(Value::Null);
            }
        }
        Ok(match &column.kind {
            Kind::Null => Value::Null,
            Kind::Bool(values) => Value::Bool(self.bit(values, i)?),
            &Kind::Int { ref values, bytes, signed } => {
                let raw = self.bytes(values, i, bytes)?;
                let mut word = [0u8; 8];
                word[..bytes].copy_from_slice(raw);
                if signed {
                    // sign-extend from the value's width
                    let shift = 64 - 8 * bytes as u32;
                    Value::from((i64::from_le_bytes(word) << shift) >> shift)
                } else {
                    Value::from(u64::from_le_bytes(word))
                }
            }
            &Kind::Float { ref values, bytes } => {
                let raw = self.bytes(values, i, bytes)?;
                let v = if bytes == 4 {
                    f64::from(f32::from_le_bytes(raw.try_into().map_err(|_| "float width")?))
                } else {
                    f64::from_le_bytes(raw.try_into().map_err(|_| "float width")?)
                };
                serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
            }
            Kind::Bytes { offsets, large, data, utf8 } => {
                let range = self.range(offsets, *large, i, data.len())?;
                let raw = &self.body[data.start + range.start..data.start + range.end];
                match std::str::from_utf8(raw) {
                    Ok(s) => Value::String(s.to_string()),
                    Err(_) if *utf8 => return Err(format!("value {i} is not UTF-8")),
                    // the parquet reader's spelling of bytes that are not text
                    Err(_) => Value::String(format!("{raw:?}")),
                }
            }
            &Kind::FixedBytes { ref values, width } => {
                let raw = self.bytes(values, i, width)?;
                match std::str::from_utf8(raw) {
                    Ok(s) => Value::String(s.to_string()),
                    Err(_) => Value::String(format!("{raw:?}")),
                }
            }
            Kind::List { offsets, large, item } => {
                let range = self.range(offsets, *large, i, item.len)?;
                Value::Array(range.map(|k| self.value(item, k)).collect::<Result<_, _>>()?)
            }
            &Kind::FixedList { size, ref item } => {
                let start = i.checked_mul(size).filter(|s| s.checked_add(size).is_some_and(|e| e <= item.len));
                let start =
                    start.ok_or_else(|| format!("value {i} of size {size} lies outside its {} items", item.len))?;
                Value::Array((start..start + size).map(|k| self.value(item, k)).collect::<Result<_, _>>()?)
            }
            Kind::Struct(fields) => {
                let mut out = Map::new();
                for (name, field) in fields {
                    out.insert(name.clone(), self.value(field, i).map_err(|e| format!("field `{name}`: {e}"))?);
                }
                Value::Object(out)
            }
            Kind::Map { offsets, entries } => {
                let range = self.range(offsets, false, i, entries.len)?;
                let Kind::Struct(kv) = &entries.kind else { return Err("map entries are not a struct".into()) };
                let (Some((_, keys)), Some((_, values))) = (kv.first(), kv.get(1)) else {
                    return Err("map entries lack a key or a value".into());
                };
                let pairs: Vec<(Value, Value)> =
                    range.map(|k| Ok((self.value(keys, k)?, self.value(values, k)?))).collect::<Result<_, String>>()?;
                // as the parquet reader: an object when every key is a string, else [key, value] pairs
                if pairs.iter().all(|(k, _)| k.is_string()) {
                    Value::Object(pairs.into_iter().filter_map(|(k, v)| Some((k.as_str()?.to_string(), v))).collect())
                } else {
                    Value::Array(pairs.into_iter().map(|(k, v)| Value::Array(vec![k, v])).collect())
                }
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------------------------
// the stream

/// Reads an Arrow IPC stream (or file) message by message: the schema first, then record batches.
pub struct StreamReader<R> {
    input: R,
    /// bytes consumed so far, for errors that say where
    position: u64,
    schema: Vec<Field>,
    batches: usize,
    finished: bool,
}

/// One encapsulated message: metadata (a flatbuffer `Message`), body, and the byte it starts at.
type Message = (Vec<u8>, Vec<u8>, u64);

/// The IPC file format's leading magic, with its padding.
const FILE_MAGIC: &[u8; 8] = b"ARROW1\0\0";

impl<R: Read> StreamReader<R> {
    /// Reads up to the schema.
    pub fn new(input: R) -> Result<Self, String> {
        let mut reader = Self { input, position: 0, schema: Vec::new(), batches: 0, finished: false };
        let mut head = [0u8; 8];
        let got = reader.fill(&mut head)?;
        if got == 0 {
            return Err("the file is empty".into());
        }
        if got < 8 {
            return Err(format!("the file ends after {got} bytes (truncated?)"));
        }
        let first = if &head == FILE_MAGIC { None } else { Some(head) };
        let Some((meta, _body, at)) = reader.message(first)? else {
            return Err("the stream ends before its schema".into());
        };
        let message = Table::root(&meta).map_err(|e| format!("message at byte {at}: {e}"))?;
        let (header_type, header) = message_header(&message).map_err(|e| format!("message at byte {at}: {e}"))?;
        if header_type != HEADER_SCHEMA {
            return Err(format!("the first message (at byte {at}) is not a schema but a {}", header_name(header_type)));
        }
        reader.schema = parse_schema(&header).map_err(|e| format!("schema at byte {at}: {e}"))?;
        Ok(reader)
    }

    pub fn schema(&self) -> &[Field] {
        &self.schema
    }

    /// The next record batch, or `None` after the end-of-stream marker.
    pub fn next_batch(&mut self) -> Result<Option<RecordBatch>, String> {
        if self.finished {
            return Ok(None);
        }
        let Some((meta, body, at)) = self.message(None)? else {
            self.finished = true;
            return Ok(None);
        };
        let context = |e: String| format!("message at byte {at}: {e}");
        let message = Table::root(&meta).map_err(context)?;
        let (header_type, header) = message_header(&message).map_err(context)?;
        if header_type != HEADER_RECORD_BATCH {
            return Err(context(format!("a {} where a record batch was expected", header_name(header_type))));
        }
        let batch = self.record_batch(&header, body).map_err(context)?;
        self.batches += 1;
        Ok(Some(batch))
    }

    fn record_batch(&self, header: &Table<'_>, body: Vec<u8>) -> Result<RecordBatch, String> {
        let rows = header.i64(0, 0)?;
        let rows = usize::try_from(rows).map_err(|_| format!("a record batch of {rows} rows"))?;
        if header.field(3)?.is_some() {
            return Err("the record batch is compressed (lz4/zstd), which jetrl does not read: save the data \
                        uncompressed (`datasets` does by default)"
                .into());
        }
        let nodes = header.long_pairs(1)?;
        let buffers = header.long_pairs(2)?;
        let mut decoder = Decoder { nodes: nodes.iter(), buffers: buffers.iter(), body_len: body.len() };
        let mut columns = Vec::with_capacity(self.schema.len());
        for field in &self.schema {
            let column = decoder.column(field, "")?;
            if column.len != rows {
                return Err(format!("column `{}` has {} values in a batch of {rows} rows", field.name, column.len));
            }
            columns.push((field.name.clone(), column));
        }
        let values_left = (body.len() as u64).saturating_mul(16).saturating_add(FREE_VALUES_PER_BATCH);
        Ok(RecordBatch { body, rows, columns, values_left: Cell::new(values_left) })
    }

    /// Reads into `buf` until it is full or the input ends; returns how many bytes were read.
    fn fill(&mut self, buf: &mut [u8]) -> Result<usize, String> {
        let mut got = 0;
        while got < buf.len() {
            match self.input.read(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("reading at byte {}: {e}", self.position + got as u64)),
            }
        }
        self.position += got as u64;
        Ok(got)
    }

    /// Exactly `len` bytes, or an error naming `what` when the input ends first. Memory grows with the bytes
    /// actually read, not with the length the file claims.
    fn exact(&mut self, len: u64, what: &str, at: u64) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        (&mut self.input)
            .take(len)
            .read_to_end(&mut out)
            .map_err(|e| format!("reading {what} of the message at byte {at}: {e}"))?;
        self.position += out.len() as u64;
        if (out.len() as u64) < len {
            return Err(format!(
                "the file ends inside the {what} of the message at byte {at}: {} of {len} bytes (truncated?)",
                out.len()
            ));
        }
        Ok(out)
    }

    /// The next message's metadata, body and position; `None` at the end-of-stream marker. `head` holds the first
    /// 8 bytes when the caller has already read them.
    fn message(&mut self, head: Option<[u8; 8]>) -> Result<Option<Message>, String> {
        let at = match head {
            Some(_) => self.position - 8,
            None => self.position,
        };
        let mut word = [0u8; 4];
        let mut pending = head.map(|h| h[4..8].try_into().unwrap_or([0; 4]));
        match head {
            Some(h) => word.copy_from_slice(&h[..4]),
            None => match self.fill(&mut word)? {
                4 => {}
                0 => {
                    return Err(format!(
                        "the stream ends at byte {at} without its end-of-stream marker, after {} record batches \
                         (truncated?)",
                        self.batches
                    ))
                }
                n => return Err(format!("the file ends {n} bytes into the message at byte {at} (truncated?)")),
            },
        }
        let mut len = i32::from_le_bytes(word);
        if len == -1 {
            // the continuation marker of metadata version V4 and later; the length follows
            match pending.take() {
                Some(next) => word = next,
                None => {
                    if self.fill(&mut word)? < 4 {
                        return Err(format!("the file ends inside the message at byte {at} (truncated?)"));
                    }
                }
            }
            len = i32::from_le_bytes(word);
        }
        if len == 0 {
            return Ok(None);
        }
        let len = u64::try_from(len).map_err(|_| format!("message at byte {at}: metadata length {len}"))?;
        let mut meta = Vec::new();
        if let Some(next) = pending {
            // a message without the continuation marker (Arrow 0.8 to 0.14): the metadata began in `head`
            meta.extend_from_slice(&next[..len.min(4) as usize]);
        }
        let rest = len - meta.len() as u64;
        meta.extend(self.exact(rest, "metadata", at)?);
        let message = Table::root(&meta).map_err(|e| format!("message at byte {at}: {e}"))?;
        let version = message.i16(0, 0).map_err(|e| format!("message at byte {at}: {e}"))?;
        if version < METADATA_V4 {
            return Err(format!(
                "message at byte {at}: metadata version number {version}; jetrl reads {METADATA_V4} (V4, Arrow 0.8) \
                 and later"
            ));
        }
        let body_len = message.i64(3, 0).map_err(|e| format!("message at byte {at}: {e}"))?;
        let body_len = u64::try_from(body_len).map_err(|_| format!("message at byte {at}: body length {body_len}"))?;
        let body = self.exact(body_len, "body", at)?;
        Ok(Some((meta, body, at)))
    }
}

fn message_header<'a>(message: &Table<'a>) -> Result<(u8, Table<'a>), String> {
    let header_type = message.u8(1, 0)?;
    let header = message.table(2)?.ok_or("the message has no header")?;
    if header_type == HEADER_DICTIONARY_BATCH {
        return Err("a dictionary batch: dictionary-encoded columns are not read".into());
    }
    Ok((header_type, header))
}

fn header_name(header_type: u8) -> &'static str {
    match header_type {
        HEADER_SCHEMA => "schema",
        HEADER_DICTIONARY_BATCH => "dictionary batch",
        HEADER_RECORD_BATCH => "record batch",
        4 => "tensor",
        5 => "sparse tensor",
        _ => "message of unknown type",
    }
}

/// Every row of an IPC stream held in memory, with the schema: for tests and tools (the dataset loader reads
/// files row by row).
pub fn read_all(bytes: &[u8]) -> Result<(Vec<Field>, Vec<Value>), String> {
    let mut reader = StreamReader::new(bytes)?;
    let mut rows = Vec::new();
    while let Some(batch) = reader.next_batch()? {
        for i in 0..batch.num_rows() {
            rows.push(batch.row(i).map_err(|e| format!("batch {} row {i}: {e}", reader.batches))?);
        }
    }
    Ok((reader.schema, rows))
}
