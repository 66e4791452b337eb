//! Finding the interpreter in a process: which mapped ELF holds `_PyRuntime`,
//! where it is loaded, and which version it is.
//!
//! In: a pid. Out: [`Found`]: runtime addresses of the few symbols we need
//! and the version. Files are opened as the target maps them
//! ([`maps::mapped_file`]): through `/proc/PID/root` (a target in another
//! mount namespace, a container, names paths inside its own root) when the
//! file there is the mapped one (device and inode as `/proc/PID/maps` shows
//! them), else through its `map_files` entry; never by the host path, which
//! may be another file. ELF parsing reads only the headers and dynamic symbol
//! table (`object::ReadCache`), not whole files.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use object::Object;
use object::read::ReadCache;

use super::PythonError;
use crate::os::{
    elf_symbols::ElfSymbols,
    lacking,
    maps::{self, Mapping, load_bias, mapped_file},
};

/// `libpython3.12.so.1.0`, `libpython3.13t.so`, `python3.11`, ... -> (3, minor).
pub fn version_from_name(path: &str) -> Option<(u8, u8)> {
    let name = path.rsplit('/').next()?;
    let rest = name
        .strip_prefix("libpython")
        .or_else(|| name.strip_prefix("python"))?;
    let (major, rest) = rest.split_once('.')?;
    let minor: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// What [`find`] learned about a process's interpreter.
#[derive(Clone, Debug)]
pub struct Found {
    /// Path of the ELF holding `_PyRuntime`, as the target sees it.
    pub path: String,
    /// Runtime address of `_PyRuntime`.
    pub runtime: u64,
    /// Runtime address of `Py_Version` (3.11+: a `const unsigned long`
    /// holding `PY_VERSION_HEX`).
    pub py_version: Option<u64>,
    /// Runtime address of `PyCode_Type`, to recognise code objects.
    pub code_type: Option<u64>,
    /// (major, minor) from the file name, for 3.10 which has no `Py_Version`.
    pub name_version: Option<(u8, u8)>,
}

/// Looks for `_PyRuntime` in the process's libpython, else in its main
/// executable (a statically linked python). `Ok(None)`: not a Python.
pub fn find(pid: u32) -> Result<Option<Found>, PythonError> {
    let maps: Vec<Mapping> = maps::read(pid)
        .map_err(|e| PythonError::open(pid, maps::path(pid), e))?
        .into_iter()
        .filter(Mapping::is_file)
        .collect();

    let mut by_path: HashMap<&str, Vec<&Mapping>> = HashMap::new();
    for m in &maps {
        by_path.entry(m.path.as_str()).or_default().push(m);
    }
    let exe_link = std::fs::read_link(format!("/proc/{pid}/exe"));
    // Another user's process without CAP_SYS_PTRACE: its exe link cannot be
    // read, its maps can. Look at what they name `python*` then, so that
    // the interpreter is found and its unreadable memory reported.
    let exe_hidden = exe_link
        .as_ref()
        .is_err_and(|e| e.kind() == io::ErrorKind::PermissionDenied);
    let exe = exe_link.as_deref().ok();
    let exe = exe
        .and_then(Path::to_str)
        .map(|s| s.trim_end_matches(" (deleted)"));

    // libpython first (shared builds), then the executable (static builds).
    let mut candidates: Vec<&str> = by_path
        .keys()
        .copied()
        .filter(|p| {
            p.rsplit('/')
                .next()
                .is_some_and(|n| n.starts_with("libpython"))
        })
        .collect();
    candidates.sort();
    candidates.extend(exe.filter(|e| by_path.contains_key(e)));
    if exe_hidden {
        let mut named: Vec<&str> = by_path
            .keys()
            .copied()
            .filter(|p| {
                p.starts_with('/')
                    && p.rsplit('/')
                        .next()
                        .is_some_and(|n| n.starts_with("python"))
            })
            .collect();
        named.sort();
        candidates.extend(named);
    }

    for path in candidates {
        let Some(file_path) = mapped_file(pid, by_path[path][0]) else {
            // Not silent: an interpreter we may not open (its root is
            // another user's process and CAP_SYS_PTRACE is missing) is a
            // refusal to report, not "no Python here".
            let root = PathBuf::from(format!("/proc/{pid}/root"));
            if std::fs::metadata(format!("{}/", root.display()))
                .is_err_and(|e| e.kind() == io::ErrorKind::PermissionDenied)
            {
                return Err(PythonError::PermissionDenied {
                    pid,
                    path: root,
                    interpreter: Some(path.to_string()),
                });
            }
            log::debug!("pid {pid}: cannot open {path} as mapped");
            continue;
        };
        if lacking::NO_INTERPRETER.contains(&file_path) {
            continue;
        }
        let Some(syms) = symbols(&file_path, &["_PyRuntime", "Py_Version", "PyCode_Type"])? else {
            continue;
        };
        let Some(&runtime) = syms.values.get("_PyRuntime") else {
            lacking::NO_INTERPRETER.insert(&file_path);
            continue;
        };
        let bias =
            load_bias(&by_path[path], &syms.load_segments).ok_or_else(|| PythonError::Elf {
                path: file_path.clone(),
                reason: "no mapping matches its first PT_LOAD segment".into(),
            })?;
        let at = |name: &str| syms.values.get(name).map(|v| v.wrapping_add(bias));
        log::debug!("pid {pid}: _PyRuntime in {path}, load bias {bias:#x}");
        return Ok(Some(Found {
            path: path.to_string(),
            runtime: runtime.wrapping_add(bias),
            py_version: at("Py_Version"),
            code_type: at("PyCode_Type"),
            name_version: version_from_name(path),
        }));
    }
    Ok(None)
}

struct Symbols {
    values: HashMap<String, u64>,
    /// (p_vaddr, p_offset) of PT_LOAD segments.
    load_segments: Vec<(u64, u64)>,
}

/// Whether the ELF file at `path` is a CPython interpreter: it defines
/// `_PyRuntime` (as [`find`] looks for it).
pub fn is_interpreter_file(path: &Path) -> bool {
    matches!(symbols(path, &["_PyRuntime"]), Ok(Some(s)) if s.values.contains_key("_PyRuntime"))
}

/// An ELF file opened for reading its symbols or sections. `Ok(None)`: missing,
/// or refused by the read limits (a FIFO, a device, a huge file: counted):
/// not an interpreter, keep looking.
fn open_elf_file(path: &Path) -> Result<Option<std::fs::File>, PythonError> {
    match crate::os::limits::open_elf(path) {
        Ok(f) => Ok(Some(f)),
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::Other) => Ok(None),
        Err(e) => Err(PythonError::Io {
            path: path.to_owned(),
            source: e,
        }),
    }
}

/// Reads the wanted symbols' link-time addresses from an ELF file, dynamic
/// symbols first, then the static table if the file still has one.
/// `Ok(None)`: not an ELF file we can parse (not an error: keep looking).
fn symbols(path: &Path, wanted: &[&str]) -> Result<Option<Symbols>, PythonError> {
    let Some(file) = open_elf_file(path)? else {
        return Ok(None);
    };
    let Ok(elf) = ElfSymbols::open(&file) else {
        return Ok(None);
    };
    if crate::os::limits::symbol_tables_too_large(elf.tables_size()) {
        return Ok(None);
    }
    let Ok(found) = elf.find(wanted, &|n| wanted.contains(&n)) else {
        return Ok(None);
    };
    Ok(Some(Symbols {
        values: found.into_iter().map(|s| (s.name, s.value)).collect(),
        load_segments: elf.load_segments().to_vec(),
    }))
}

/// The bytes of section `name` of an ELF file (at most `max`), as the
/// file holds them. `Ok(None)`: not an ELF file we can parse, or no such
/// section, or a section larger than `max` (a hostile file).
pub(crate) fn elf_section(
    path: &Path,
    name: &str,
    max: u64,
) -> Result<Option<Vec<u8>>, PythonError> {
    use object::ObjectSection;
    let Some(cache) = open_elf_file(path)?.map(ReadCache::new) else {
        return Ok(None);
    };
    let Ok(obj) = object::File::parse(&cache) else {
        return Ok(None);
    };
    let Some(section) = obj.section_by_name(name) else {
        return Ok(None);
    };
    if section.size() > max {
        return Ok(None);
    }
    Ok(section.data().ok().map(<[u8]>::to_vec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_interpreter_defines_py_runtime() {
        assert!(!is_interpreter_file(Path::new("/proc/self/exe")));
        assert!(!is_interpreter_file(Path::new(
            "/nonexistent/libpython3.11.so"
        )));
        // A CPython of the test machine, where there is one.
        for p in [
            "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0",
            "/usr/bin/python3.11",
        ] {
            if Path::new(p).exists() {
                assert!(is_interpreter_file(Path::new(p)), "{p}");
            }
        }
    }

    #[test]
    fn versions_from_file_names() {
        assert_eq!(
            version_from_name("/x/lib/libpython3.10.so.1.0"),
            Some((3, 10))
        );
        assert_eq!(version_from_name("/usr/bin/python3.11"), Some((3, 11)));
        assert_eq!(version_from_name("/x/libpython3.13t.so"), Some((3, 13)));
        assert_eq!(version_from_name("/usr/bin/python3"), None);
        assert_eq!(version_from_name("/usr/bin/node"), None);
    }
}
