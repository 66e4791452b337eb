//! Files already read and found to lack something (a CPython interpreter,
//! tokio's park functions), so that they are not read again.
//!
//! In: a file's path. Out: whether a file with its identity (device,
//! inode, size, mtime) was noted as lacking it. A process without an
//! interpreter is asked again while it may still load one (a launcher, a
//! `dlopen`), and the daemon asks every new process: reading a large
//! executable's symbol table each time (Node's takes ~0.2 s here) held the
//! drain long enough to overflow the ring buffer. A file replaced in place
//! has a new identity and is read again. Each set is bounded: past
//! [`MAX_FILES`] it starts over.

use std::{
    collections::HashSet,
    os::unix::fs::MetadataExt,
    path::Path,
    sync::{Mutex, MutexGuard},
};

/// Files one set remembers before it starts over.
pub const MAX_FILES: usize = 4096;

/// Identity of a file on disk: a file replaced or rewritten in place gets
/// a new one. The one key for "already read this file" caches (these sets,
/// the unwinder's parsed unwind tables).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

impl FileId {
    pub fn of(m: &std::fs::Metadata) -> FileId {
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        }
    }
}

/// The files found to lack one thing.
pub struct Lacking(Mutex<Option<HashSet<FileId>>>);

/// ELF files without `_PyRuntime`.
pub static NO_INTERPRETER: Lacking = Lacking::new();
/// ELF files without tokio's park functions.
pub static NO_TOKIO_PARKS: Lacking = Lacking::new();

impl Lacking {
    pub const fn new() -> Self {
        Lacking(Mutex::new(None))
    }

    fn set(&self) -> MutexGuard<'_, Option<HashSet<FileId>>> {
        // A panic elsewhere while held leaves a set that is still valid.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `path` was noted as lacking it (and is the same file still).
    pub fn contains(&self, path: &Path) -> bool {
        file_id(path).is_some_and(|id| self.set().as_ref().is_some_and(|s| s.contains(&id)))
    }

    /// Note that `path` lacks it.
    pub fn insert(&self, path: &Path) {
        let Some(id) = file_id(path) else { return };
        let mut g = self.set();
        let s = g.get_or_insert_with(HashSet::new);
        if s.len() >= MAX_FILES {
            s.clear();
        }
        s.insert(id);
    }
}

impl Default for Lacking {
    fn default() -> Self {
        Self::new()
    }
}

fn file_id(path: &Path) -> Option<FileId> {
    Some(FileId::of(&std::fs::metadata(path).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_known_until_it_changes() {
        let dir = crate::os::scratch_dir("lacking");
        let f = dir.join("bin");
        std::fs::write(&f, b"one").unwrap();
        let set = Lacking::new();
        assert!(!set.contains(&f));
        set.insert(&f);
        assert!(set.contains(&f));
        // Replaced (a new inode, another size): read again.
        std::fs::remove_file(&f).unwrap();
        std::fs::write(&f, b"other").unwrap();
        assert!(!set.contains(&f));
        assert!(!set.contains(&dir.join("missing")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
