//! CPython dicts and `str` keys read from another process (3.10-3.15,
//! x86-64), for the asyncio task and ASGI route readers.
//!
//! In: a keys object's address (`PyDictObject.ma_keys`) or a `str`'s. Out:
//! the keys object's entries, `(key, value)` in table order, and whether a
//! `str` is a given ASCII text. Keys are compared by their characters, one
//! read a key: the target's string hashes are salted. Each caller caps the
//! entries read (its own `MAX_DICT_ENTRIES`); a longer table is counted
//! (`PythonListTooLong`) and read up to the cap.

use super::PythonError;
use super::offsets::{Layout, UNICODE_LENGTH, UNICODE_STATE};
use crate::os::memory::{ProcessMemory, ReadMemory, le_u64};

/// `PyDictObject.ma_keys`, `.ma_values` (3.10-3.15).
pub(super) const DICT_MA_KEYS: u64 = 32;
pub(super) const DICT_MA_VALUES: u64 = 40;

/// The first `cap` entries of keys object `keys` of CPython 3.`minor`, as
/// `(key, value)` in table order, deleted ones included (key 0): an
/// entry's index is its slot in a split table's values, whose entries'
/// own values are 0.
pub(super) fn keys_entries(
    mem: &ProcessMemory,
    minor: u8,
    keys: u64,
    cap: u64,
) -> Result<Vec<(u64, u64)>, PythonError> {
    let bad = |what| PythonError::BadData {
        pid: mem.pid(),
        what,
        addr: keys,
    };
    let (entries_at, n, entry_size, kv) = if minor == 10 {
        // dk_refcnt, dk_size, dk_lookup, dk_usable, dk_nentries, dk_indices
        let k = mem.read_bytes(keys, 40)?;
        let (size, n) = (le_u64(&k, 8), le_u64(&k, 32));
        if size > 1 << 24 || n > size {
            return Err(bad("dict keys (dk_size)"));
        }
        let width = match size {
            0..=0xff => 1,
            0x100..=0xffff => 2,
            0x1_0000..=0xffff_ffff => 4,
            _ => 8,
        };
        (keys + 40 + size * width, n, 24u64, 8usize)
    } else {
        // dk_refcnt, dk_log2_size, dk_log2_index_bytes, dk_kind, ...,
        // dk_usable, dk_nentries, dk_indices
        let k = mem.read_bytes(keys, 32)?;
        let (log2_index_bytes, kind, n) = (k[9], k[10], le_u64(&k, 24));
        if log2_index_bytes > 30 {
            return Err(bad("dict keys (dk_log2_index_bytes)"));
        }
        // general keys: hash, key, value; str keys: key, value
        let (size, kv) = if kind == 0 { (24, 8) } else { (16, 0) };
        (keys + 32 + (1u64 << log2_index_bytes), n, size, kv)
    };
    if n > cap {
        crate::os::limits::hit(crate::os::limits::Limit::PythonListTooLong);
    }
    let n = n.min(cap);
    let raw = mem.read_bytes(entries_at, (n * entry_size) as usize)?;
    Ok(raw
        .chunks_exact(entry_size as usize)
        .map(|e| (le_u64(e, kv), le_u64(e, kv + 8)))
        .collect())
}

/// `obj` is a compact ASCII `str` equal to `want` (one read: the header
/// and `want`'s length of data).
pub(super) fn ascii_eq(
    mem: &ProcessMemory,
    layout: &Layout,
    obj: u64,
    want: &str,
) -> Result<bool, PythonError> {
    let data = u64::from(layout.unicode_ascii_data);
    let b = mem.read_bytes(obj, (data + want.len() as u64) as usize)?;
    let len = le_u64(&b, UNICODE_LENGTH as usize);
    let state = u32::from_le_bytes(b[UNICODE_STATE as usize..][..4].try_into().unwrap());
    let compact_ascii = (state >> 5) & 3 == 3;
    Ok(compact_ascii && len == want.len() as u64 && &b[data as usize..] == want.as_bytes())
}
