//! Bytecode offset -> source line, from a code object's `co_linetable` bytes.
//!
//! In: the raw table, `co_firstlineno` and the format. Out: address ranges
//! (byte offsets into the bytecode, half-open) with their line, the same
//! ranges `code.co_lines()` reports. Pure; the input comes from another
//! process and may be torn, so decoding never panics and stops at the end of
//! the buffer.
//!
//! Formats (pinned to the CPython sources they were written from):
//! - 3.10: pairs `(offset delta: u8, line delta: i8)`; line delta -128 means
//!   "no line". <https://github.com/python/cpython/blob/v3.10.13/Objects/lnotab_notes.txt>
//! - 3.11-3.15: the location table, one entry per run of code units.
//!   <https://github.com/python/cpython/blob/v3.12.1/Objects/locations.md>

/// `co_linetable` encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineTableFormat {
    /// 3.10 (PEP 626 pairs).
    Pep626,
    /// 3.11+ location table.
    Locations,
}

/// Bytecode bytes `[start, end)` map to `line` (`None`: no line, e.g. the
/// artificial instructions at a function's start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LineRange {
    pub start: u32,
    pub end: u32,
    pub line: Option<u32>,
}

/// Decodes a whole table into non-empty ranges in address order.
pub fn decode(format: LineTableFormat, table: &[u8], first_line: u32) -> Vec<LineRange> {
    match format {
        LineTableFormat::Pep626 => decode_pep626(table, first_line),
        LineTableFormat::Locations => decode_locations(table, first_line),
    }
}

/// The line of the instruction at byte offset `addr`, given decoded ranges.
pub fn line_at(ranges: &[LineRange], addr: u32) -> Option<u32> {
    let i = ranges.partition_point(|r| r.end <= addr);
    ranges
        .get(i)
        .filter(|r| r.start <= addr)
        .and_then(|r| r.line)
}

/// The line to show for `addr`: its own, or — for instructions with no
/// location of their own (implicit returns, artificial instructions; CPython
/// reports `None` for them) — the line of the nearest instruction before it.
pub fn line_near(ranges: &[LineRange], addr: u32) -> Option<u32> {
    line_at(ranges, addr).or_else(|| {
        let i = ranges.partition_point(|r| r.start <= addr);
        ranges[..i].iter().rev().find_map(|r| r.line)
    })
}

fn to_line(line: i64) -> Option<u32> {
    u32::try_from(line).ok()
}

fn decode_pep626(table: &[u8], first_line: u32) -> Vec<LineRange> {
    let mut out = Vec::with_capacity(table.len() / 2);
    let mut line = i64::from(first_line);
    let mut start = 0u32;
    for pair in table.chunks_exact(2) {
        let end = start.saturating_add(u32::from(pair[0]));
        let ldelta = pair[1] as i8;
        let this_line = if ldelta == -128 {
            None
        } else {
            line += i64::from(ldelta);
            to_line(line)
        };
        // Zero-length pairs only carry a line delta (for jumps > 127 lines).
        if end > start {
            out.push(LineRange {
                start,
                end,
                line: this_line,
            });
        }
        start = end;
    }
    out
}

/// Entry header byte: bit 7 set, bits 3..=6 the code, bits 0..=2 the number
/// of code units minus one.
const CODE_NO_LOCATION: u8 = 15;
const CODE_LONG: u8 = 14;
const CODE_NO_COLUMNS: u8 = 13;
const CODE_ONE_LINE0: u8 = 10;
const CODE_ONE_LINE2: u8 = 12;

fn decode_locations(table: &[u8], first_line: u32) -> Vec<LineRange> {
    let mut out = Vec::with_capacity(table.len() / 2);
    let mut line = i64::from(first_line);
    let mut start = 0u32;
    let mut pos = 0;
    while pos < table.len() {
        let header = table[pos];
        if header & 0x80 == 0 {
            // Not an entry start: torn read or misaligned; stop rather than guess.
            break;
        }
        let code = (header >> 3) & 15;
        let units = u32::from(header & 7) + 1;
        let mut body = Cursor {
            buf: table,
            pos: pos + 1,
        };
        let this_line = match code {
            CODE_NO_LOCATION => None,
            CODE_LONG | CODE_NO_COLUMNS => {
                // A hostile table's deltas can sum past i64: wrap, as a
                // release build did, rather than panic in a debug one.
                line = line.wrapping_add(body.svarint());
                to_line(line)
            }
            CODE_ONE_LINE0..=CODE_ONE_LINE2 => {
                line = line.wrapping_add(i64::from(code - CODE_ONE_LINE0));
                to_line(line)
            }
            _ => to_line(line), // short forms: same line, column info only
        };
        let end = start.saturating_add(units * 2);
        // Same-line neighbours are merged, as co_lines() does (3.12+).
        match out.last_mut() {
            Some(LineRange {
                end: prev_end,
                line: prev,
                ..
            }) if *prev == this_line && *prev_end == start => *prev_end = end,
            _ => out.push(LineRange {
                start,
                end,
                line: this_line,
            }),
        }
        start = end;
        // Skip the entry's payload: everything up to the next header byte.
        pos += 1;
        while pos < table.len() && table[pos] & 0x80 == 0 {
            pos += 1;
        }
    }
    out
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    /// 6-bit little-endian groups, bit 6 set on all but the last.
    fn varint(&mut self) -> u64 {
        let mut val = 0u64;
        let mut shift = 0;
        while let Some(&b) = self.buf.get(self.pos) {
            self.pos += 1;
            if shift < 64 {
                val |= u64::from(b & 63) << shift;
            }
            shift += 6;
            if b & 64 == 0 {
                break;
            }
        }
        val
    }

    /// Zig-zag-like: low bit is the sign.
    fn svarint(&mut self) -> i64 {
        let v = self.varint();
        let mag = (v >> 1) as i64;
        if v & 1 == 1 { -mag } else { mag }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod near_tests {
    use super::*;

    #[test]
    fn no_location_takes_the_line_before() {
        let r = |start, end, line| LineRange { start, end, line };
        let ranges = [r(0, 4, Some(10)), r(4, 8, None), r(8, 12, Some(12))];
        assert_eq!(line_at(&ranges, 5), None);
        assert_eq!(line_near(&ranges, 5), Some(10));
        assert_eq!(line_near(&ranges, 9), Some(12));
        assert_eq!(line_near(&[r(0, 4, None)], 2), None);
    }
}
