//! A process's executable mappings: the lines of `/proc/PID/maps` (parsed
//! by [`os::maps`](crate::os::maps)) that hold code, as the unwinder keeps
//! them.

use super::*;
use crate::os::maps::Mapping;

/// What an executable mapping holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum MapKind {
    /// A file; `path` as shown in maps (may end in " (deleted)").
    File {
        path: String,
        dev: (u32, u32),
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

/// The executable mappings in the text of `/proc/PID/maps`, sorted by start.
pub(super) fn parse_maps(text: &str) -> Vec<ExecMapping> {
    let mut out: Vec<ExecMapping> = crate::os::maps::parse(text)
        .into_iter()
        .filter(Mapping::is_exec)
        .map(|m| {
            let kind = if m.path == "[vdso]" {
                MapKind::Vdso
            } else if m.is_file() && m.inode != 0 {
                MapKind::File {
                    path: m.path,
                    dev: m.dev,
                    inode: m.inode,
                }
            } else {
                MapKind::Anon
            };
            ExecMapping {
                start: m.start,
                end: m.end,
                offset: m.offset,
                kind,
                has_module: false,
                cfi: None,
            }
        })
        .collect();
    out.sort_by_key(|m| m.start);
    out
}
