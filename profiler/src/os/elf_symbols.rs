//! A few named symbols out of a large ELF file, fast and in bounded memory.
//!
//! `object`'s symbol iterator over a [`object::ReadCache`] reads each name
//! with a read of its own: Node's 185 000 symbols took ~0.55 s that way
//! (a warm page cache), all of it syscalls. Here the string table is read
//! in chunks of [`CHUNK`] and only the strings holding one of the caller's
//! needles are kept; then the symbol table is read in chunks, and a symbol
//! whose name lies in a kept string is handed to the caller's test
//! (~10 ms for Node). Memory: at most two chunks, plus the kept strings.
//!
//! The file is input a target may shape: every offset and size comes from
//! its headers and is checked against the section it claims to lie in;
//! each string is searched once; only the first table of each kind is read,
//! and only through a real string table; a string longer than 4 KiB is no
//! name looked for; over 16 MiB of kept strings or 65 536 matching symbols,
//! a string with no end within 2 MiB, or a table that cannot be read, is
//! an error.
use std::{
    collections::{BTreeMap, HashSet},
    fs::File,
    os::unix::fs::FileExt,
};

use object::{
    Endian, Endianness,
    elf::{self, FileHeader64, SectionHeader64},
    read::elf::{FileHeader, ProgramHeader, SectionHeader},
};

/// What is read at once from a string or symbol table.
const CHUNK: usize = 1 << 20;
/// An ELF64 symbol's size in the file.
const SYM_SIZE: usize = 24;
/// A string longer than this is not a name looked for (`object` read at
/// most 4 KiB of a name).
const MAX_NAME: usize = 4096;
/// The bytes of kept strings, and the symbols found, past which a file is
/// refused (real files: a few hundred names, tens of KiB).
const MAX_KEPT: usize = 16 << 20;
const MAX_FOUND: usize = 1 << 16;

/// A defined symbol the caller asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Symbol {
    pub name: String,
    pub value: u64,
    pub size: u64,
    /// Its section's index (defined: neither undefined nor reserved).
    pub shndx: u16,
    /// From `.dynsym` (else `.symtab`).
    pub dynamic: bool,
    /// Its type (`STT_FUNC`, `STT_OBJECT`, or `STT_NOTYPE` with a size).
    pub kind: u8,
}

/// An ELF64 file's headers, read once, and the file to read from.
pub struct ElfSymbols<'f> {
    file: &'f File,
    endian: Endianness,
    sections: Vec<SectionHeader64<Endianness>>,
    /// (p_vaddr, p_offset) of its `PT_LOAD` segments.
    loads: Vec<(u64, u64)>,
    /// It names a program interpreter (`PT_INTERP`): a dynamic executable.
    interp: bool,
    /// `e_machine`.
    machine: u16,
}

impl<'f> ElfSymbols<'f> {
    /// Reads the file header, the section headers and the program headers.
    pub fn open(file: &'f File) -> Result<ElfSymbols<'f>, String> {
        let cache = object::ReadCache::new(file);
        let header = FileHeader64::<Endianness>::parse(&cache)
            .map_err(|e| format!("not a 64-bit ELF file: {e}"))?;
        let endian = header.endian().map_err(|e| e.to_string())?;
        let sections = header
            .section_headers(endian, &cache)
            .map_err(|e| format!("its section headers: {e}"))?
            .to_vec();
        let segments = header
            .program_headers(endian, &cache)
            .map_err(|e| format!("its program headers: {e}"))?;
        let loads = segments
            .iter()
            .filter(|p| p.p_type(endian) == elf::PT_LOAD)
            .map(|p| (p.p_vaddr(endian), p.p_offset(endian)))
            .collect();
        let interp = segments.iter().any(|p| p.p_type(endian) == elf::PT_INTERP);
        Ok(ElfSymbols {
            file,
            endian,
            sections,
            loads,
            interp,
            machine: header.e_machine(endian),
        })
    }

    /// Its `e_machine` (`EM_X86_64`, ...).
    pub fn machine(&self) -> u16 {
        self.machine
    }

    /// Does it name a program interpreter (`PT_INTERP`)? A dynamic
    /// executable: the kernel maps that loader, which maps the C library.
    pub fn asks_for_loader(&self) -> bool {
        self.interp
    }

    /// (p_vaddr, p_offset) of its `PT_LOAD` segments.
    pub fn load_segments(&self) -> &[(u64, u64)] {
        &self.loads
    }

    /// The size of its symbol and string tables together (for the caller's
    /// cap, [`crate::os::limits::symbol_tables_too_large`]).
    pub fn tables_size(&self) -> u64 {
        self.sections
            .iter()
            .filter(|s| {
                matches!(
                    s.sh_type(self.endian),
                    elf::SHT_SYMTAB | elf::SHT_DYNSYM | elf::SHT_STRTAB
                )
            })
            .map(|s| s.sh_size(self.endian))
            .fold(0u64, u64::saturating_add)
    }

    /// The defined symbols (`.dynsym`'s first, then `.symtab`'s) whose name
    /// holds one of `needles` and passes `wanted`. Every name `wanted`
    /// takes must hold a needle: names without one are never looked at.
    pub fn find(
        &self,
        needles: &[&str],
        wanted: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<Symbol>, String> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        // The first table of each kind, as `object` reads them: a file of
        // many tables sharing one huge string table is read once.
        for kind in [elf::SHT_DYNSYM, elf::SHT_SYMTAB] {
            let Some(table) = self
                .sections
                .iter()
                .find(|s| s.sh_type(self.endian) == kind)
            else {
                continue;
            };
            let link = table.sh_link(self.endian) as usize;
            let Some(strings) = self
                .sections
                .get(link)
                .filter(|s| s.sh_type(self.endian) == elf::SHT_STRTAB)
            else {
                return Err(format!(
                    "a symbol table links to section {link}, which is not a string table"
                ));
            };
            let kept = self.strings_holding(strings, needles)?;
            if kept.is_empty() {
                continue;
            }
            let dynamic = kind == elf::SHT_DYNSYM;
            self.symbols_named(table, &kept, dynamic, wanted, &mut seen, &mut out)?;
        }
        Ok(out)
    }

    /// The 4-byte little- or big-endian `int` symbol `sym` holds (0 in a
    /// section with no file data: `.bss`, `.tbss`); None when its value
    /// lies outside its section.
    pub fn read_i32(&self, sym: &Symbol) -> Option<i32> {
        let sec = self.sections.get(sym.shndx as usize)?;
        if sec.sh_type(self.endian) == elf::SHT_NOBITS {
            return Some(0);
        }
        let mut b = [0u8; 4];
        self.file
            .read_exact_at(&mut b, self.file_offset(sym, 4)?)
            .ok()?;
        Some(match self.endian {
            Endianness::Little => i32::from_le_bytes(b),
            Endianness::Big => i32::from_be_bytes(b),
        })
    }

    /// Where in the file the first byte of symbol `sym` lies, when `len`
    /// bytes from it lie within its section's file data.
    pub fn file_offset(&self, sym: &Symbol, len: u64) -> Option<u64> {
        let sec = self.sections.get(sym.shndx as usize)?;
        if sec.sh_type(self.endian) == elf::SHT_NOBITS {
            return None;
        }
        let (addr, size) = (sec.sh_addr(self.endian), sec.sh_size(self.endian));
        let rel = sym.value.checked_sub(addr)?;
        if rel.checked_add(len)? > size {
            return None;
        }
        sec.sh_offset(self.endian).checked_add(rel)
    }

    /// The strings of string table `sec` that hold a needle: by the
    /// table offset they start at.
    fn strings_holding(
        &self,
        sec: &SectionHeader64<Endianness>,
        needles: &[&str],
    ) -> Result<BTreeMap<u64, Vec<u8>>, String> {
        let mut kept = BTreeMap::new();
        let mut kept_bytes = 0usize;
        let finders: Vec<memchr::memmem::Finder> = needles
            .iter()
            .filter(|n| !n.is_empty())
            .map(|n| memchr::memmem::Finder::new(n.as_bytes()))
            .collect();
        let (off, size) = (sec.sh_offset(self.endian), sec.sh_size(self.endian));
        let mut buf: Vec<u8> = Vec::new();
        // The table offset of buf[0], and of the next byte to read.
        let (mut base, mut next) = (0u64, 0u64);
        while next < size {
            let n = (size - next).min(CHUNK as u64) as usize;
            let have = buf.len();
            buf.resize(have + n, 0);
            let at = off
                .checked_add(next)
                .ok_or("its string table lies past any file")?;
            self.file
                .read_exact_at(&mut buf[have..], at)
                .map_err(|e| format!("reading its string table: {e}"))?;
            next += n as u64;
            // Whole strings only: up to the last NUL; the rest waits for
            // the next chunk.
            let Some(last) = buf.iter().rposition(|&b| b == 0) else {
                if buf.len() > CHUNK {
                    return Err(format!(
                        "a string of its string table is over {CHUNK} bytes"
                    ));
                }
                continue;
            };
            let whole = &buf[..last];
            for finder in &finders {
                // Each string is looked at once: after a hit the search
                // goes on past the end of the string it is in.
                let mut from = 0;
                while let Some(i) = finder.find(&whole[from..]) {
                    let at = from + i;
                    let start = memchr::memrchr(0, &whole[from..at]).map_or(from, |j| from + j + 1);
                    let end = at + memchr::memchr(0, &whole[at..]).unwrap_or(whole.len() - at);
                    from = (end + 1).min(whole.len());
                    if end - start > MAX_NAME {
                        continue;
                    }
                    if let std::collections::btree_map::Entry::Vacant(v) =
                        kept.entry(base + start as u64)
                    {
                        kept_bytes += end - start;
                        if kept_bytes > MAX_KEPT {
                            return Err(format!(
                                "over {MAX_KEPT} bytes of its string table hold the names looked for"
                            ));
                        }
                        v.insert(whole[start..end].to_vec());
                    }
                    if from >= whole.len() {
                        break;
                    }
                }
            }
            buf.drain(..=last);
            base += last as u64 + 1;
        }
        Ok(kept)
    }

    /// Symbol table `sec`'s defined symbols whose names lie in `kept` and
    /// pass `wanted`, pushed to `out` (a name already there is skipped).
    fn symbols_named(
        &self,
        sec: &SectionHeader64<Endianness>,
        kept: &BTreeMap<u64, Vec<u8>>,
        dynamic: bool,
        wanted: &dyn Fn(&str) -> bool,
        seen: &mut HashSet<String>,
        out: &mut Vec<Symbol>,
    ) -> Result<(), String> {
        let e = self.endian;
        let (off, size) = (sec.sh_offset(e), sec.sh_size(e));
        let per_chunk = (CHUNK / SYM_SIZE) as u64 * SYM_SIZE as u64;
        let mut buf = vec![0u8; per_chunk.min(size) as usize];
        let mut done = 0u64;
        while done.saturating_add(SYM_SIZE as u64) <= size {
            let n = (size - done).min(per_chunk) as usize / SYM_SIZE * SYM_SIZE;
            let at = off
                .checked_add(done)
                .ok_or("its symbol table lies past any file")?;
            self.file
                .read_exact_at(&mut buf[..n], at)
                .map_err(|e| format!("reading its symbol table: {e}"))?;
            done += n as u64;
            for raw in buf[..n].chunks_exact(SYM_SIZE) {
                let st_name = u64::from(e.read_u32_bytes(raw[0..4].try_into().unwrap()));
                // The string this name lies in (a linker may share tails:
                // a name can start inside another string).
                let Some((start, s)) = kept.range(..=st_name).next_back() else {
                    continue;
                };
                let Some(name) = s.get((st_name - start) as usize..) else {
                    continue;
                };
                let (info, shndx) = (raw[4], e.read_u16_bytes(raw[6..8].try_into().unwrap()));
                let value = e.read_u64_bytes(raw[8..16].try_into().unwrap());
                let size = e.read_u64_bytes(raw[16..24].try_into().unwrap());
                // As `object` has it, bar extended section indexes
                // (`SHN_XINDEX`: files of over 65 280 sections).
                let defined = shndx != elf::SHN_UNDEF
                    && shndx < elf::SHN_LORESERVE
                    && match info & 0xf {
                        elf::STT_OBJECT | elf::STT_FUNC => true,
                        elf::STT_NOTYPE => size != 0,
                        _ => false,
                    };
                let Ok(name) = std::str::from_utf8(name) else {
                    continue;
                };
                if defined && wanted(name) && !seen.contains(name) {
                    if out.len() >= MAX_FOUND {
                        return Err(format!(
                            "over {MAX_FOUND} symbols match the names looked for"
                        ));
                    }
                    seen.insert(name.to_string());
                    out.push(Symbol {
                        name: name.to_string(),
                        value,
                        size,
                        shndx,
                        dynamic,
                        kind: info & 0xf,
                    });
                }
            }
        }
        Ok(())
    }
}

/// The fuzz entry (`fuzzing::elf_unwind`): `data` as a file, every
/// symbol holding a common needle found and its `int` read.
pub fn fuzz(data: &[u8]) {
    use std::io::Write;
    let Ok(fd) = rustix::fs::memfd_create("stallprof-fuzz", rustix::fs::MemfdFlags::CLOEXEC) else {
        return;
    };
    let file = File::from(fd);
    if (&file).write_all(data).is_err() {
        return;
    }
    let Ok(elf) = ElfSymbols::open(&file) else {
        return;
    };
    let _ = elf.tables_size();
    if let Ok(found) = elf.find(&["_", "e", "v8dbg_"], &|_| true) {
        for s in &found {
            let _ = elf.read_i32(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use object::{Object, ObjectSymbol};

    use super::*;

    /// What `object`'s symbol iterator finds for the same names: (name,
    /// value), the first of a name, `.dynsym` before `.symtab`.
    fn as_object_finds(data: &[u8], wanted: &dyn Fn(&str) -> bool) -> Vec<(String, u64)> {
        let obj = object::File::parse(data).unwrap();
        let mut out: Vec<(String, u64)> = Vec::new();
        for s in obj.dynamic_symbols().chain(obj.symbols()) {
            let n = s.name().unwrap_or("");
            if wanted(n) && s.is_definition() && !out.iter().any(|(o, _)| o == n) {
                out.push((n.to_string(), s.address()));
            }
        }
        out.sort();
        out
    }

    fn ours(path: &str, needles: &[&str], wanted: &dyn Fn(&str) -> bool) -> Vec<(String, u64)> {
        let f = File::open(path).unwrap();
        let mut v: Vec<(String, u64)> = ElfSymbols::open(&f)
            .unwrap()
            .find(needles, wanted)
            .unwrap()
            .into_iter()
            .map(|s| (s.name, s.value))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn finds_libc_wait_functions_as_object_does() {
        let path = "/lib/x86_64-linux-gnu/libc.so.6";
        let wanted = |n: &str| n.starts_with("epoll_");
        let found = ours(path, &["epoll_"], &wanted);
        assert!(found.iter().any(|(n, _)| n == "epoll_wait"), "{found:?}");
        assert_eq!(
            found,
            as_object_finds(&std::fs::read(path).unwrap(), &wanted)
        );
    }

    /// Node's 7 MiB string table spans chunks; its V8 metadata symbols
    /// (500+) and names holding a needle mid-name come out as `object`
    /// reads them.
    #[test]
    fn finds_node_symbols_as_object_does() {
        let path = "/usr/bin/node";
        let data = std::fs::read(path).expect("/usr/bin/node (Node 20) is needed for this test");
        let v8 = |n: &str| n.starts_with("v8dbg_") || n.starts_with("_ZN2v88internal7Version6");
        let found = ours(path, &["v8dbg_", "_ZN2v88internal7Version6"], &v8);
        assert!(found.len() > 500, "{} symbols", found.len());
        assert_eq!(found, as_object_finds(&data, &v8));
        let mid = |n: &str| n.contains("uv_run");
        let found = ours(path, &["uv_run"], &mid);
        assert!(!found.is_empty());
        assert_eq!(found, as_object_finds(&data, &mid));
    }

    /// A string table a target shaped: one 1 MiB string of needles (each
    /// hit used to walk back to its string's start: quadratic), then a
    /// real name. The long string is no name; the real one is kept, once.
    #[test]
    fn a_string_of_needles_is_searched_once() {
        use object::{U32, U64};
        let mut table = b"\0".to_vec();
        table.extend(b"v8dbg_".repeat((1 << 20) / 6));
        table.extend(b"\0v8dbg_real\0");
        let e = Endianness::Little;
        let header = SectionHeader64::<Endianness> {
            sh_name: U32::new(e, 0),
            sh_type: U32::new(e, elf::SHT_STRTAB),
            sh_flags: U64::new(e, 0),
            sh_addr: U64::new(e, 0),
            sh_offset: U64::new(e, 0),
            sh_size: U64::new(e, table.len() as u64),
            sh_link: U32::new(e, 0),
            sh_info: U32::new(e, 0),
            sh_addralign: U64::new(e, 1),
            sh_entsize: U64::new(e, 0),
        };
        let path = std::env::temp_dir().join(format!("stallprof-strtab-{}", std::process::id()));
        std::fs::write(&path, &table).unwrap();
        let f = File::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let elf = ElfSymbols {
            file: &f,
            endian: e,
            sections: vec![header],
            loads: Vec::new(),
            interp: false,
            machine: elf::EM_X86_64,
        };
        let kept = elf.strings_holding(&header, &["v8dbg_"]).unwrap();
        let names: Vec<&[u8]> = kept.values().map(Vec::as_slice).collect();
        assert_eq!(names, [&b"v8dbg_real"[..]]);
    }
}
