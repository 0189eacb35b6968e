//! GGUF reader: header, metadata, tensor table, alignment.
//!
//! The file is memory-mapped; tensors are borrowed slices of the map. Every
//! read is bounds-checked, so a truncated or corrupt file gives an error
//! naming what was being read, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::EngineError;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => self.as_u64().map(|v| v as f32),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// GGML tensor element types this engine can read (one home: the kernels).
pub use pdmesh_kernels::formats::TensorType;

/// One entry of the tensor table. `dims[0]` is the innermost (row) length,
/// as in GGML.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: TensorType,
    /// Absolute offset of the data in the file.
    pub offset: u64,
    pub size: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An open GGUF file.
pub struct Gguf {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    map: Arc<Mmap>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf").field("path", &self.path).field("tensors", &self.tensors.len()).finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(format!("file ends while reading {what} at byte {}", self.pos)),
        }
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.u64(what)?;
        if len > self.buf.len() as u64 {
            return Err(format!("{what}: string length {len} exceeds the file size"));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what}: string is not valid UTF-8"))
    }
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.take(1, key)?[0]),
            1 => Value::I8(self.take(1, key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.take(2, key)?.try_into().expect("2"))),
            3 => Value::I16(i16::from_le_bytes(self.take(2, key)?.try_into().expect("2"))),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(self.u32(key)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(key)?)),
            7 => Value::Bool(self.take(1, key)?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 => {
                if depth > 2 {
                    return Err(format!("{key}: arrays nested too deeply"));
                }
                let elem_ty = self.u32(key)?;
                let n = self.u64(key)?;
                // Each element takes at least one byte: a length past the
                // file's end is corrupt, not a reason to allocate.
                if n > (self.buf.len() - self.pos) as u64 {
                    return Err(format!("{key}: array length {n} exceeds the file size"));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(self.u64(key)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(key)?)),
            other => return Err(format!("{key}: unknown metadata value type {other}")),
        })
    }
}

impl Gguf {
    /// Open and validate a GGUF file.
    pub fn open(path: &Path) -> Result<Gguf, EngineError> {
        let bad = |why: String| EngineError::BadModel { path: path.to_path_buf(), why };
        let file = File::open(path).map_err(|e| EngineError::ModelIo { path: path.to_path_buf(), source: e })?;
        // SAFETY: the map is read-only; the model file is not modified while served.
        let map =
            unsafe { Mmap::map(&file) }.map_err(|e| EngineError::ModelIo { path: path.to_path_buf(), source: e })?;
        if map.len() < 4 || &map[..4] != MAGIC {
            return Err(bad("not a GGUF file (wrong magic bytes)".into()));
        }
        let mut c = Cursor { buf: &map, pos: 4 };
        let version = c.u32("version").map_err(bad)?;
        if !(2..=3).contains(&version) {
            return Err(bad(format!("unsupported GGUF version {version} (expected 2 or 3)")));
        }
        let n_tensors = c.u64("tensor count").map_err(bad)?;
        let n_kv = c.u64("metadata count").map_err(bad)?;
        if n_tensors > map.len() as u64 || n_kv > map.len() as u64 {
            return Err(bad("header counts exceed the file size".into()));
        }
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key").map_err(bad)?;
            let ty = c.u32(&key).map_err(bad)?;
            let v = c.value(ty, &key, 0).map_err(bad)?;
            metadata.insert(key, v);
        }
        let alignment = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(bad(format!("invalid general.alignment {alignment}")));
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string("tensor name").map_err(bad)?;
            let n_dims = c.u32(&name).map_err(bad)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(bad(format!("tensor {name}: {n_dims} dimensions")));
            }
            let mut dims = Vec::new();
            for _ in 0..n_dims {
                dims.push(c.u64(&name).map_err(bad)?);
            }
            let ty_id = c.u32(&name).map_err(bad)?;
            let rel = c.u64(&name).map_err(bad)?;
            infos.push((name, dims, ty_id, rel));
        }
        let data_start = (c.pos as u64).next_multiple_of(alignment);
        let mut tensors = HashMap::new();
        for (name, dims, ty_id, rel) in infos {
            let ty = TensorType::from_ggml_id(ty_id).ok_or_else(|| {
                EngineError::Unsupported(format!(
                    "{}: tensor {name} has type {} (GGML type id {ty_id}), which pdmesh cannot read",
                    path.display(),
                    TensorType::ggml_name(ty_id)
                ))
            })?;
            let elements = dims.iter().try_fold(1u64, |a, d| a.checked_mul(*d));
            let (per_block, block_bytes) = ty.block();
            let size = elements
                .filter(|e| e % per_block == 0)
                .and_then(|e| (e / per_block).checked_mul(block_bytes))
                .ok_or_else(|| bad(format!("tensor {name}: shape {dims:?} does not fit type {ty}")))?;
            if rel % alignment != 0 {
                return Err(bad(format!("tensor {name}: offset {rel} is not aligned to {alignment}")));
            }
            let offset = data_start + rel;
            if offset.checked_add(size).is_none_or(|end| end > map.len() as u64) {
                return Err(bad(format!(
                    "file is truncated: tensor {name} needs bytes {offset}..{} but the file has {}",
                    offset + size,
                    map.len()
                )));
            }
            tensors.insert(name.clone(), TensorInfo { name, dims, ty, offset, size });
        }
        Ok(Gguf { path: path.to_path_buf(), version, metadata, tensors, map: Arc::new(map) })
    }

    /// The shared memory map (weights borrow from it without copying).
    pub fn map(&self) -> Arc<Mmap> {
        self.map.clone()
    }

    /// The raw bytes of a tensor.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.offset as usize..(info.offset + info.size) as usize]
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, EngineError> {
        self.tensors
            .get(name)
            .ok_or_else(|| EngineError::BadModel { path: self.path.clone(), why: format!("tensor {name} is missing") })
    }

    pub fn get(&self, key: &str) -> Result<&Value, EngineError> {
        self.metadata.get(key).ok_or_else(|| EngineError::BadModel {
            path: self.path.clone(),
            why: format!("metadata key {key} is missing"),
        })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, EngineError> {
        self.get(key)?.as_u64().ok_or_else(|| self.wrong_type(key, "an integer"))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, EngineError> {
        self.get(key)?.as_f32().ok_or_else(|| self.wrong_type(key, "a number"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, EngineError> {
        self.get(key)?.as_str().ok_or_else(|| self.wrong_type(key, "a string"))
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, EngineError> {
        let arr = self.get(key)?.as_array().ok_or_else(|| self.wrong_type(key, "an array"))?;
        arr.iter().map(|v| v.as_str().ok_or_else(|| self.wrong_type(key, "an array of strings"))).collect()
    }

    fn wrong_type(&self, key: &str, want: &str) -> EngineError {
        EngineError::BadModel { path: self.path.clone(), why: format!("metadata key {key} is not {want}") }
    }
}
