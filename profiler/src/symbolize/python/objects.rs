//! Python objects read from another process (CPython 3.10-3.15, x86-64):
//! dicts by `str` key and whole, an instance's own attributes and its
//! `__slots__`, a type's name, a `str`'s text, tuples, `int`s. One owner
//! for what the ASGI/aiohttp route, the OpenTelemetry span and the event
//! loop's queue readers read.
//!
//! In: object addresses. Out: the values, or a [`PythonError`] saying which
//! object did not look like what it should. Every object's type is checked
//! through its `tp_flags` before it is read as that type; dict scans are
//! capped at [`MAX_DICT_ENTRIES`].

use std::sync::Arc;

use super::PythonError;
use super::dict::{self, DICT_MA_KEYS, DICT_MA_VALUES};
use super::offsets::{Layout, OB_TYPE, VAR_OB_SIZE};
use crate::os::memory::{ProcessMemory, ReadMemory, le_u64};

/// Entries of a dict (or a type's shared keys) scanned for one key.
pub const MAX_DICT_ENTRIES: u64 = 1024;
/// `PyTypeObject` fields (the same offsets 3.10-3.15: `ctypes` on each
/// build here, gdb on pyenv's 3.10-3.13).
pub(super) const TYPE_TP_NAME: u64 = 24;
pub(super) const TYPE_TP_BASICSIZE: u64 = 32;
pub(super) const TYPE_TP_FLAGS: u64 = 168;
pub(super) const TYPE_TP_WEAKLISTOFFSET: u64 = 208;
pub(super) const TYPE_TP_BASE: u64 = 256;
pub(super) const TYPE_TP_DICT: u64 = 264;
pub(super) const TYPE_TP_DICTOFFSET: u64 = 288;
/// `PyMemberDescrObject.d_member` (after `PyDescr_COMMON`: the object
/// head, `d_type`, `d_name`, `d_qualname`) and `PyMemberDef.offset`
/// (3.10-3.15: `ctypes`, a `__slots__` attribute's descriptor read back).
const DESCR_D_MEMBER: u64 = 40;
const MEMBER_DEF_OFFSET: u64 = 16;
/// `PySetObject.used` (then `mask`, `table`) and a `setentry`'s size.
const SET_USED: u64 = 24;
const SET_ENTRY: u64 = 16;
/// 30-bit digits of an `int` read at most: 128 bits and a spare.
pub const MAX_INT_DIGITS: u64 = 5;
/// `PyLongObject`'s size word (`ob_size`; 3.12+ `lv_tag`) and digits.
const LONG_SIZE: u64 = 16;
const LONG_DIGITS: u64 = 24;
pub(super) const TPFLAGS_INLINE_VALUES: u64 = 1 << 2; // 3.13+
pub(super) const TPFLAGS_MANAGED_DICT: u64 = 1 << 4; // 3.11+
pub(super) const TPFLAGS_LONG_SUBCLASS: u64 = 1 << 24;
pub(super) const TPFLAGS_TUPLE_SUBCLASS: u64 = 1 << 26;
pub(super) const TPFLAGS_UNICODE_SUBCLASS: u64 = 1 << 28;
pub(super) const TPFLAGS_DICT_SUBCLASS: u64 = 1 << 29;
/// `PyFunctionObject.func_code` (3.10-3.15: `ctypes`, the word equal to
/// `id(f.__code__)`).
pub(super) const FUNC_CODE: u64 = 48;
/// `PyCellObject.ob_ref`.
pub(super) const CELL_OB_REF: u64 = 16;
/// A managed dict (3.11+) sits three words before the object; 3.11 keeps
/// the values pointer in the fourth.
pub(super) const MANAGED_DICT: u64 = 24;
pub(super) const MANAGED_VALUES_311: u64 = 32;

/// What differs between minor versions in the objects read here.
///
/// Provenance: `ctypes` on pyenv 3.10.13-3.13.0, Debian 3.11.2 and
/// Debian testing's 3.13.15, 3.14.8, 3.15.0 — `ht_cached_keys` is the word
/// after `ht_qualname` (found as the word equal to `id(T.__qualname__)`,
/// its second occurrence after `ht_name`); gdb `print
/// &((PyHeapTypeObject*)0)->ht_cached_keys` agrees on 3.10-3.13. The
/// object pre-header and inline values as `Include/internal/pycore_object.h`
/// and `pycore_dict.h` of each version lay them out, checked with `ctypes`
/// on an instance (its attribute's `id` at the expected word); a tuple's
/// first item: the word equal to `id(t[0])`.
#[derive(Clone, Copy, Debug)]
pub(super) struct ObjectModel {
    /// `PyHeapTypeObject.ht_cached_keys`: the shared keys of instances'
    /// split dicts / values.
    pub ht_cached_keys: u64,
    /// Where the values array starts in a `PyDictValues` (3.13+: after
    /// `capacity, size, embedded, valid`).
    pub values_start: u64,
    /// `PyTupleObject.ob_item` (3.14 added the cached `ob_hash` before it).
    pub tuple_ob_item: u64,
}

pub(super) fn object_model(minor: u8) -> Option<ObjectModel> {
    let (ht_cached_keys, values_start, tuple_ob_item) = match minor {
        10 | 11 => (872, 0, 24),
        12 => (880, 0, 24),
        13 => (880, 8, 24),
        14 => (880, 8, 32),
        15 => (888, 8, 32),
        _ => return None,
    };
    Some(ObjectModel {
        ht_cached_keys,
        values_start,
        tuple_ob_item,
    })
}

/// Reads objects of one process.
pub(super) struct Objects {
    pub mem: Arc<ProcessMemory>,
    pub layout: Layout,
    pub minor: u8,
    /// None for a version without a known object model (said by the
    /// readers that need it).
    pub model: Option<ObjectModel>,
}

impl Objects {
    pub(super) fn new(mem: Arc<ProcessMemory>, layout: Layout) -> Self {
        let minor = layout.bpf.major_minor().1;
        Objects {
            mem,
            layout,
            minor,
            model: object_model(minor),
        }
    }

    pub(super) fn model(&self) -> Result<ObjectModel, PythonError> {
        self.model.ok_or(PythonError::BadData {
            pid: self.mem.pid(),
            what: "object layout (no object model for this CPython version)",
            addr: 0,
        })
    }

    /// A dict's keys object and, for a split table, its values array.
    fn dict_table(&self, dict: u64) -> Result<(u64, Option<u64>), PythonError> {
        let model = self.model()?;
        let h = self.mem.read_bytes(dict + DICT_MA_KEYS, 16)?;
        let (keys, values) = (
            le_u64(&h, 0),
            le_u64(&h, (DICT_MA_VALUES - DICT_MA_KEYS) as usize),
        );
        if keys == 0 {
            return Err(self.bad("dict without keys", dict));
        }
        Ok((keys, (values != 0).then_some(values + model.values_start)))
    }

    /// The value of `str` key `want` in a dict (combined or split table).
    pub(super) fn dict_get(&self, dict: u64, want: &str) -> Result<Option<u64>, PythonError> {
        let (keys, values) = self.dict_table(dict)?;
        self.keys_get(keys, values.map(|v| (v, u64::MAX)), want)
    }

    /// Looks `want` up in a keys object: each entry's value, or with
    /// `split = (values array, capacity)` the value at the entry's index.
    pub(super) fn keys_get(
        &self,
        keys: u64,
        split: Option<(u64, u64)>,
        want: &str,
    ) -> Result<Option<u64>, PythonError> {
        let entries = dict::keys_entries(&self.mem, self.minor, keys, MAX_DICT_ENTRIES)?;
        for (i, &(key, value)) in entries.iter().enumerate() {
            // A key that cannot be read is not the one wanted.
            if key == 0 || !self.ascii_eq(key, want).unwrap_or(false) {
                continue;
            }
            let value = match split {
                None => value,
                Some((_, capacity)) if i as u64 >= capacity => return Ok(None),
                Some((values, _)) => self.mem.read_u64(values + 8 * i as u64)?,
            };
            return Ok((value != 0).then_some(value));
        }
        Ok(None)
    }

    /// `obj.name` from the instance's own attributes (its `__dict__`,
    /// managed dict or inline values); None when it has no such attribute.
    pub(super) fn attr(&self, obj: u64, name: &str) -> Result<Option<u64>, PythonError> {
        let model = self.model()?;
        let ty = self.mem.read_u64(obj + OB_TYPE)?;
        let flags = self.mem.read_u64(ty + TYPE_TP_FLAGS)?;
        let shared = || self.mem.read_u64(ty + model.ht_cached_keys);
        let dict = if self.minor >= 13 && flags & TPFLAGS_INLINE_VALUES != 0 {
            let basic = self.mem.read_u64(ty + TYPE_TP_BASICSIZE)?;
            if !(16..1 << 16).contains(&basic) {
                return Err(self.bad("type (tp_basicsize)", ty));
            }
            let values = obj + basic;
            let head = self.mem.read_bytes(values, 4)?; // capacity, size, embedded, valid
            if head[3] != 0 {
                let keys = shared()?;
                return self.keys_get(
                    keys,
                    Some((values + model.values_start, u64::from(head[0]))),
                    name,
                );
            }
            self.mem.read_u64(obj - MANAGED_DICT)?
        } else if self.minor >= 11 && flags & TPFLAGS_MANAGED_DICT != 0 {
            if self.minor == 11 {
                let values = self.mem.read_u64(obj - MANAGED_VALUES_311)?;
                if values != 0 {
                    return self.keys_get(shared()?, Some((values, u64::MAX)), name);
                }
                self.mem.read_u64(obj - MANAGED_DICT)?
            } else {
                let dorv = self.mem.read_u64(obj - MANAGED_DICT)?;
                if self.minor == 12 && dorv & 1 != 0 {
                    // `PyDictOrValues`: values pointer minus one.
                    return self.keys_get(shared()?, Some((dorv + 1, u64::MAX)), name);
                }
                dorv
            }
        } else {
            let off = self.mem.read_u64(ty + TYPE_TP_DICTOFFSET)? as i64;
            if off <= 0 || off >= 1 << 16 {
                return Err(self.bad("instance without a __dict__ at a fixed offset", obj));
            }
            self.mem.read_u64(obj + off as u64)?
        };
        if dict == 0 {
            return Ok(None);
        }
        if !self.has_flag(dict, TPFLAGS_DICT_SUBCLASS)? {
            return Err(self.bad("instance __dict__ (not a dict)", dict));
        }
        self.dict_get(dict, name)
    }

    pub(super) fn has_flag(&self, obj: u64, flag: u64) -> Result<bool, PythonError> {
        let ty = self.mem.read_u64(obj + OB_TYPE)?;
        if ty == 0 {
            return Ok(false);
        }
        Ok(self.mem.read_u64(ty + TYPE_TP_FLAGS)? & flag != 0)
    }

    /// The object's type is named `name` (`tp_name`, a C string).
    pub(super) fn type_name_is(&self, obj: u64, name: &[u8]) -> Result<bool, PythonError> {
        Ok(self.type_name(obj, name.len() + 1)? == name)
    }

    /// A `str` object's text, cut to `cap` characters (with `…`); None when
    /// `obj` is not a `str`.
    pub(super) fn str_value(&self, obj: u64, cap: u64) -> Result<Option<String>, PythonError> {
        if !self.has_flag(obj, TPFLAGS_UNICODE_SUBCLASS)? {
            return Ok(None);
        }
        let mut s = super::code::read_unicode(&*self.mem, &self.layout, obj)?;
        let cap = cap as usize;
        if s.chars().count() > cap {
            s = s.chars().take(cap).collect::<String>() + "…";
        }
        Ok(Some(s))
    }

    /// A non-negative `int` that fits 64 bits (a pointer, a `pthread_t`);
    /// None for another object or a larger or negative int.
    pub(super) fn small_int(&self, obj: u64) -> Result<Option<u64>, PythonError> {
        if !self.has_flag(obj, TPFLAGS_LONG_SUBCLASS)? {
            return Ok(None);
        }
        Ok(self.int_u128(obj).ok().and_then(|v| u64::try_from(v).ok()))
    }

    /// A non-negative `int` of up to 128 bits.
    pub(super) fn int_u128(&self, obj: u64) -> Result<u128, PythonError> {
        if !self.has_flag(obj, TPFLAGS_LONG_SUBCLASS)? {
            return Err(self.bad("int (not an int)", obj));
        }
        let tag = self.mem.read_u64(obj + LONG_SIZE)?;
        let (digits, negative) = if self.minor >= 12 {
            (tag >> 3, tag & 3 == 2) // lv_tag: ndigits << 3 | sign
        } else {
            let size = tag as i64;
            (size.unsigned_abs(), size < 0)
        };
        if negative {
            return Err(self.bad("int (negative)", obj));
        }
        if digits > MAX_INT_DIGITS {
            return Err(self.bad("int (over 128 bits)", obj));
        }
        let raw = self
            .mem
            .read_bytes(obj + LONG_DIGITS, (4 * digits) as usize)?;
        let mut v: u128 = 0;
        for (i, d) in raw.chunks_exact(4).enumerate() {
            let d = u128::from(u32::from_le_bytes(d.try_into().unwrap()) & 0x3fff_ffff);
            let shift = 30 * i as u32;
            if d != 0 && shift + (128 - d.leading_zeros()) > 128 {
                return Err(self.bad("int (over 128 bits)", obj));
            }
            v |= d << shift;
        }
        Ok(v)
    }

    /// The `(key, value)` entries of a dict (combined or split table), up
    /// to [`MAX_DICT_ENTRIES`]; deleted entries skipped.
    pub(super) fn dict_items(&self, dict: u64) -> Result<Vec<(u64, u64)>, PythonError> {
        let (keys, values) = self.dict_table(dict)?;
        let entries = dict::keys_entries(&self.mem, self.minor, keys, MAX_DICT_ENTRIES)?;
        let mut out = Vec::with_capacity(entries.len());
        for (i, (key, value)) in entries.into_iter().enumerate() {
            let value = match values {
                Some(v) => self.mem.read_u64(v + 8 * i as u64)?,
                None => value,
            };
            if key != 0 && value != 0 {
                out.push((key, value));
            }
        }
        Ok(out)
    }

    /// Item `i` of a tuple (or tuple subclass); None past its end.
    pub(super) fn tuple_item(&self, tuple: u64, i: u64) -> Result<Option<u64>, PythonError> {
        let model = self.model()?;
        if !self.has_flag(tuple, TPFLAGS_TUPLE_SUBCLASS)? {
            return Err(self.bad("tuple (not a tuple)", tuple));
        }
        let n = self.mem.read_u64(tuple + VAR_OB_SIZE)?;
        if i >= n {
            return Ok(None);
        }
        let item = self.mem.read_u64(tuple + model.tuple_ob_item + 8 * i)?;
        Ok((item != 0).then_some(item))
    }

    /// `obj.name` for a `__slots__` attribute: the member descriptor in
    /// its type's (or a base's, up to 8 up) `tp_dict` says where in the
    /// object it is. None when unset or no such slot.
    pub(super) fn slot(&self, obj: u64, name: &str) -> Result<Option<u64>, PythonError> {
        let mut ty = self.mem.read_u64(obj + OB_TYPE)?;
        for _ in 0..8 {
            if ty == 0 {
                break;
            }
            let dict = self.mem.read_u64(ty + TYPE_TP_DICT)?;
            if dict != 0
                && let Some(desc) = self.dict_get(dict, name)?
            {
                if !self.type_name_is(desc, b"member_descriptor")? {
                    return Ok(None);
                }
                let member = self.mem.read_u64(desc + DESCR_D_MEMBER)?;
                let off = self.mem.read_u64(member + MEMBER_DEF_OFFSET)?;
                if !(16..1 << 16).contains(&off) {
                    return Err(self.bad("member descriptor (offset)", desc));
                }
                let v = self.mem.read_u64(obj + off)?;
                return Ok((v != 0).then_some(v));
            }
            ty = self.mem.read_u64(ty + TYPE_TP_BASE)?;
        }
        Ok(None)
    }

    /// The C string a type calls itself (`tp_name`), up to `cap` bytes.
    pub(super) fn type_name(&self, obj: u64, cap: usize) -> Result<Vec<u8>, PythonError> {
        let ty = self.mem.read_u64(obj + OB_TYPE)?;
        self.type_name_of(ty, cap)
    }

    /// The `tp_name` of type `ty`, up to `cap` bytes.
    pub(super) fn type_name_of(&self, ty: u64, cap: usize) -> Result<Vec<u8>, PythonError> {
        match self.mem.read_u64(ty + TYPE_TP_NAME)? {
            0 => Ok(Vec::new()),
            tp_name => self.c_str(tp_name, cap),
        }
    }

    /// A C string of at most `cap` bytes ([`ReadMemory::read_c_str`]).
    pub(super) fn c_str(&self, addr: u64, cap: usize) -> Result<Vec<u8>, PythonError> {
        Ok(self.mem.read_c_str(addr, cap)?)
    }

    /// The items of a `set` (exact type), at most `cap`; `truncated` set
    /// when it held more. `PySetObject` (3.10-3.15): `fill`, `used`,
    /// `mask`, `table` after the object head; a table of `mask + 1`
    /// entries of `key`, `hash`, an empty one's key NULL, a deleted one's
    /// the dummy (another type: callers check their items' types).
    pub(super) fn set_items(
        &self,
        set: u64,
        cap: usize,
        truncated: &mut bool,
    ) -> Result<Vec<u64>, PythonError> {
        if self.type_name(set, 8)? != b"set" {
            return Err(self.bad("set (not a set)", set));
        }
        let h = self.mem.read_bytes(set + SET_USED, 24)?;
        let (used, mask, table) = (le_u64(&h, 0), le_u64(&h, 8), le_u64(&h, 16));
        if used == 0 {
            return Ok(Vec::new());
        }
        let slots = mask.saturating_add(1);
        if !slots.is_power_of_two() || used > slots || table == 0 {
            return Err(self.bad("set (its table)", set));
        }
        // Past `cap` items the table is not read whole: a bigger one is cut.
        let read = slots.min(2 * cap as u64);
        if read < slots || used > cap as u64 {
            *truncated = true;
            crate::os::limits::hit(crate::os::limits::Limit::PythonListTooLong);
        }
        let raw = self.mem.read_bytes(table, (SET_ENTRY * read) as usize)?;
        Ok(raw
            .chunks_exact(SET_ENTRY as usize)
            .map(|e| le_u64(e, 0))
            .filter(|&k| k != 0)
            .take(cap)
            .collect())
    }

    /// `obj` is a compact ASCII `str` equal to `want`.
    pub(super) fn ascii_eq(&self, obj: u64, want: &str) -> Result<bool, PythonError> {
        dict::ascii_eq(&self.mem, &self.layout, obj, want)
    }

    pub(super) fn bad(&self, what: &'static str, addr: u64) -> PythonError {
        PythonError::BadData {
            pid: self.mem.pid(),
            what,
            addr,
        }
    }
}
