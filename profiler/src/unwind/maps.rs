//! A process's executable mappings, parsed from `/proc/PID/maps`.

use super::*;

/// What an executable mapping holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum MapKind {
    /// A file; `path` as shown in maps (may end in " (deleted)").
    File {
        path: String,
        dev: String,
        inode: u64,
    },
    Vdso,
    /// Anonymous executable memory (JIT code) or another special mapping.
    Anon,
}

/// One executable mapping from `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ExecMapping {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) offset: u64,
    pub(super) kind: MapKind,
    /// Whether a framehop module was added for it (keyed by `start`).
    pub(super) has_module: bool,
    /// Its file's CFI, for frames framehop cannot unwind.
    pub(super) cfi: Option<ModuleCfi>,
}

impl ExecMapping {
    pub(super) fn same_as(&self, other: &ExecMapping) -> bool {
        self.start == other.start
            && self.end == other.end
            && self.offset == other.offset
            && self.kind == other.kind
    }
}

/// The mapping in `maps` (sorted by start) identical to `m`.
pub(super) fn find_same<'a>(maps: &'a [ExecMapping], m: &ExecMapping) -> Option<&'a ExecMapping> {
    let i = maps.binary_search_by_key(&m.start, |o| o.start).ok()?;
    Some(&maps[i]).filter(|o| o.same_as(m))
}

/// Parse the executable mappings out of the text of `/proc/PID/maps`.
pub(super) fn parse_maps(text: &str) -> Vec<ExecMapping> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut rest = line;
        let mut field = || {
            let t = rest.trim_start();
            let end = t.find(' ').unwrap_or(t.len());
            let (f, r) = t.split_at(end);
            rest = r;
            f
        };
        let (range, perms, offset, dev, inode) = (field(), field(), field(), field(), field());
        let path = rest.trim();
        if perms.as_bytes().get(2) != Some(&b'x') {
            continue;
        }
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(offset), Ok(inode)) = (
            u64::from_str_radix(s, 16),
            u64::from_str_radix(e, 16),
            u64::from_str_radix(offset, 16),
            inode.parse::<u64>(),
        ) else {
            continue;
        };
        if start >= end {
            continue;
        }
        let kind = if path == "[vdso]" {
            MapKind::Vdso
        } else if path.starts_with('/') && inode != 0 {
            MapKind::File {
                path: path.to_string(),
                dev: dev.to_string(),
                inode,
            }
        } else {
            MapKind::Anon
        };
        out.push(ExecMapping {
            start,
            end,
            offset,
            kind,
            has_module: false,
            cfi: None,
        });
    }
    out.sort_by_key(|m| m.start);
    out
}
