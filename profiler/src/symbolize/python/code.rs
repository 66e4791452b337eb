//! Code object + instruction -> qualified name, file name and line.
//!
//! In: [`PyFrame`] records (from BPF or [`walk_stack`](super::Interpreter::walk_stack)).
//! Out: [`PyFrameInfo`]. Reads the code object and its strings from the
//! target's memory, decodes the line table once per code object and caches
//! the result by address. A freed code object's address can be reused by a
//! new one, so every hit re-reads the code object's header (one `pread`) and
//! compares type, first line and the filename/name/qualname/linetable
//! pointers before trusting the cache.

use std::collections::HashMap;
use std::sync::Arc;

use profiler_common::python::{PY_FRAME_MODEL_FRAME_OBJECT, PyFrame};

use super::PythonError;
use super::linetable::{self, LineRange};
use super::offsets::{self, Layout};
use crate::os::memory::{ProcessMemory, ReadMemory, le_u32, le_u64};

/// A resolved Python frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyFrameInfo {
    /// `co_qualname` (3.11+), e.g. `Worker.run`; `co_name` on 3.10.
    pub qualname: String,
    pub filename: String,
    /// Line being executed; 0 if unknown (no line for that instruction).
    pub line: u32,
    /// `co_firstlineno`.
    pub first_line: u32,
}

/// Caps on what a torn read can make us allocate.
const MAX_STRING_CHARS: u64 = 16 * 1024;
const MAX_LINETABLE_BYTES: u64 = 4 << 20;
/// Distinct code objects kept; past this the cache starts over (a long
/// recording of a process that keeps compiling code).
const MAX_CACHED_CODES: usize = 64 * 1024;
/// Bytes the cache holds (names, file names, decoded line ranges); past
/// this it starts over (counted): a target whose code objects carry huge
/// names or tables costs at most this much per process.
const MAX_CACHED_BYTES: usize = 64 << 20;

/// Fields of the code object compared on every cache hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CodeKey {
    ob_type: u64,
    filename: u64,
    name: u64,
    qualname: u64,
    linetable: u64,
    first_line: u32,
}

struct Cached {
    key: CodeKey,
    qualname: String,
    filename: String,
    ranges: Vec<LineRange>,
}

/// Resolves frames of one process; keep one per process for the cache.
pub struct CodeResolver {
    mem: Arc<ProcessMemory>,
    layout: Layout,
    code_type: Option<u64>,
    cache: HashMap<u64, Cached>,
    /// What `cache` holds, in bytes (see [`Cached::bytes`]).
    cache_bytes: usize,
    header_len: usize,
}

impl Cached {
    fn bytes(&self) -> usize {
        self.qualname.len()
            + self.filename.len()
            + self.ranges.len() * std::mem::size_of::<LineRange>()
    }
}

impl CodeResolver {
    pub(crate) fn new(mem: Arc<ProcessMemory>, layout: Layout, code_type: Option<u64>) -> Self {
        let header_len = [
            layout.code_filename,
            layout.code_name,
            layout.code_qualname.unwrap_or(0),
            layout.code_linetable,
            layout.code_firstlineno,
        ]
        .into_iter()
        .max()
        .unwrap_or(0) as usize
            + 8;
        Self {
            mem,
            layout,
            code_type,
            cache: HashMap::new(),
            cache_bytes: 0,
            header_len,
        }
    }

    /// Resolves one frame record.
    pub fn resolve_frame(&mut self, frame: &PyFrame) -> Result<PyFrameInfo, PythonError> {
        self.resolve(frame.code, frame.instr)
    }

    /// Resolves a code object address and the frame's instruction value (see
    /// [`PyFrame::instr`] for its meaning per version).
    pub fn resolve(&mut self, code: u64, instr: u64) -> Result<PyFrameInfo, PythonError> {
        let key = self.read_key(code)?;
        if self.cache.get(&code).is_none_or(|c| c.key != key) {
            let fresh = self.load(code, key)?;
            if self.cache_bytes + fresh.bytes() > MAX_CACHED_BYTES {
                crate::os::limits::hit(crate::os::limits::Limit::PythonLineTableCapped);
            }
            if self.cache.len() >= MAX_CACHED_CODES
                || self.cache_bytes + fresh.bytes() > MAX_CACHED_BYTES
            {
                self.cache.clear();
                self.cache_bytes = 0;
            }
            self.cache_bytes += fresh.bytes();
            if let Some(old) = self.cache.insert(code, fresh) {
                self.cache_bytes -= old.bytes();
            }
        }
        let c = &self.cache[&code];
        let line = match self.byte_offset(code, instr) {
            Some(addr) => linetable::line_near(&c.ranges, addr).unwrap_or(0),
            None => key.first_line, // not started yet: CPython reports co_firstlineno
        };
        Ok(PyFrameInfo {
            qualname: c.qualname.clone(),
            filename: c.filename.clone(),
            line,
            first_line: key.first_line,
        })
    }

    /// Number of cached code objects (for stats and tests).
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// Byte offset of the instruction in the bytecode, `None` before the first.
    fn byte_offset(&self, code: u64, instr: u64) -> Option<u32> {
        let off = if self.layout.bpf.frame_model == PY_FRAME_MODEL_FRAME_OBJECT {
            (instr as i64).checked_mul(2)? // f_lasti counts 2-byte code units
        } else {
            instr.wrapping_sub(code + u64::from(self.layout.bpf.code_adaptive)) as i64
        };
        u32::try_from(off).ok()
    }

    fn read_key(&self, code: u64) -> Result<CodeKey, PythonError> {
        let l = &self.layout;
        let h = self.mem.read_bytes(code, self.header_len)?;
        let key = CodeKey {
            ob_type: le_u64(&h, offsets::OB_TYPE as usize),
            filename: le_u64(&h, l.code_filename as usize),
            name: le_u64(&h, l.code_name as usize),
            qualname: l.code_qualname.map_or(0, |o| le_u64(&h, o as usize)),
            linetable: le_u64(&h, l.code_linetable as usize),
            first_line: le_u32(&h, l.code_firstlineno as usize),
        };
        if self.code_type.is_some_and(|t| t != key.ob_type) {
            return Err(self.bad("code object (ob_type is not PyCode_Type)", code));
        }
        Ok(key)
    }

    fn load(&self, code: u64, key: CodeKey) -> Result<Cached, PythonError> {
        let name_ptr = if self.layout.code_qualname.is_some() {
            key.qualname
        } else {
            key.name
        };
        let qualname = self.read_str(name_ptr)?;
        let filename = self.read_str(key.filename)?;
        let table = self.read_bytes_object(key.linetable)?;
        let ranges = linetable::decode(self.layout.linetable_format, &table, key.first_line);
        log::trace!("code {code:#x}: {qualname} {filename}:{}", key.first_line);
        Ok(Cached {
            key,
            qualname,
            filename,
            ranges,
        })
    }

    /// A compact `str` object (what code objects hold) -> String.
    fn read_str(&self, addr: u64) -> Result<String, PythonError> {
        read_unicode(&*self.mem, &self.layout, addr)
    }

    fn read_bytes_object(&self, addr: u64) -> Result<Vec<u8>, PythonError> {
        let len = self.mem.read_u64(addr + offsets::VAR_OB_SIZE)?;
        if len > MAX_LINETABLE_BYTES {
            crate::os::limits::hit(crate::os::limits::Limit::PythonLineTableCapped);
            return Err(self.bad("bytes object (co_linetable)", addr));
        }
        Ok(self
            .mem
            .read_bytes(addr + offsets::BYTES_OB_SVAL, len as usize)?)
    }

    fn bad(&self, what: &'static str, addr: u64) -> PythonError {
        PythonError::BadData {
            pid: self.mem.pid(),
            what,
            addr,
        }
    }
}
/// A compact `str` object (what code objects and task names hold) ->
/// String, at most [`MAX_STRING_CHARS`] characters.
pub(crate) fn read_unicode(
    mem: &dyn ReadMemory,
    l: &Layout,
    addr: u64,
) -> Result<String, PythonError> {
    let h = mem.read_bytes(addr, l.unicode_compact_data as usize)?;
    let len = le_u64(&h, offsets::UNICODE_LENGTH as usize);
    let state = le_u32(&h, offsets::UNICODE_STATE as usize);
    let (kind, compact, ascii) = (
        (state >> 2) & 7,
        (state >> 5) & 1 == 1,
        (state >> 6) & 1 == 1,
    );
    if !compact || !matches!(kind, 1 | 2 | 4) || len > MAX_STRING_CHARS || (ascii && kind != 1) {
        return Err(PythonError::BadData {
            pid: mem.pid(),
            what: "compact str object",
            addr,
        });
    }
    let data = addr
        + u64::from(if ascii {
            l.unicode_ascii_data
        } else {
            l.unicode_compact_data
        });
    let raw = mem.read_bytes(data, (len * u64::from(kind)) as usize)?;
    let s = match kind {
        1 => raw.iter().map(|&b| char::from(b)).collect(), // ASCII or Latin-1
        2 => raw
            .chunks_exact(2)
            .map(|c| {
                char::from_u32(u32::from(u16::from_le_bytes([c[0], c[1]]))).unwrap_or('\u{fffd}')
            })
            .collect(),
        _ => raw
            .chunks_exact(4)
            .map(|c| {
                char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]])).unwrap_or('\u{fffd}')
            })
            .collect(),
    };
    Ok(s)
}
