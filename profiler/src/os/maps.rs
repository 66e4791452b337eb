//! A process's mappings, as `/proc/PID/maps` shows them: the one parser of
//! that file, and the one place its `map_files` entries are named.
//!
//! In: a pid, or maps text (live, or a line kept in a recording). Out:
//! [`Mapping`]s, one per line that parses, in the file's order (the kernel
//! sorts them by address); the `/proc/PID/map_files` path of a range; the
//! path that opens the file a mapping maps.
//!
//! Constraints: the text is the target's to shape (a file name is any
//! bytes but `\n`), so a line that does not parse is skipped, never a
//! panic; the file is read through [`limits::read_proc`]'s cap. The path is
//! kept as the line ends, spaces inside it included and `" (deleted)"`
//! after a file removed since it was mapped ([`Mapping::path_undeleted`]
//! strips it). A path not starting with `/` is a special mapping
//! (`[heap]`, `[vdso]`, ...) or an anonymous one (empty).

use std::{
    fs::Metadata,
    io,
    path::{Path, PathBuf},
};

use super::limits;

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// `rwxp` as printed (`-` where a right is missing; `s` for shared).
    pub perms: [u8; 4],
    /// Offset in the file of `start`.
    pub offset: u64,
    /// Device (major, minor) and inode of the mapped file (0s when none).
    pub dev: (u32, u32),
    pub inode: u64,
    /// As maps shows it: a file's path (maybe ending in `" (deleted)"`),
    /// a special mapping's name, or empty.
    pub path: String,
}

impl Mapping {
    pub fn is_exec(&self) -> bool {
        self.perms[2] == b'x'
    }

    /// A file mapping (the path is absolute), not an anonymous or special one.
    pub fn is_file(&self) -> bool {
        self.path.starts_with('/')
    }

    /// The path without the `" (deleted)"` maps adds once the file is gone:
    /// the name it was mapped under.
    pub fn path_undeleted(&self) -> &str {
        self.path.strip_suffix(" (deleted)").unwrap_or(&self.path)
    }

    /// Its entry in `/proc/PID/map_files` ([`map_file`]).
    pub fn map_file(&self, pid: u32) -> PathBuf {
        map_file(pid, self.start, self.end)
    }

    /// Whether `meta` is the file this maps (device and inode as maps shows
    /// them): a file at the same path in another root, or put there since,
    /// is another file.
    pub fn is_file_of(&self, meta: &Metadata) -> bool {
        same_file(meta, self.dev, self.inode)
    }
}

/// Whether `meta` is the file of device `dev` (major, minor) and `inode`.
pub fn same_file(meta: &Metadata, dev: (u32, u32), inode: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    let d = meta.dev();
    meta.ino() == inode && (libc::major(d), libc::minor(d)) == dev
}

/// `/proc/PID/maps`.
pub fn path(pid: u32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/maps"))
}

/// The text of `/proc/PID/maps`, bounded ([`limits::read_proc`]); for a
/// caller that keeps the text itself (a recording).
pub fn read_text(pid: u32) -> io::Result<String> {
    limits::read_proc(&path(pid).to_string_lossy())
}

/// The mappings of `pid`. A zombie's are empty.
pub fn read(pid: u32) -> io::Result<Vec<Mapping>> {
    read_text(pid).map(|t| parse(&t))
}

/// Every line of maps text that parses.
pub fn parse(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_line).collect()
}

/// One maps line: `START-END PERMS OFFSET MAJOR:MINOR INODE [PATH]`,
/// numbers in hex but the inode. `None`: not such a line, or an empty range.
pub fn parse_line(line: &str) -> Option<Mapping> {
    let mut rest = line;
    let mut field = || {
        let t = rest.trim_start();
        let end = t.find(|c: char| c.is_ascii_whitespace()).unwrap_or(t.len());
        let (f, r) = t.split_at(end);
        rest = r;
        f
    };
    let (range, perms, offset, dev, inode) = (field(), field(), field(), field(), field());
    let (start, end) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    let hex = |s: &str| u64::from_str_radix(s, 16).ok();
    let hex32 = |s: &str| u32::from_str_radix(s, 16).ok();
    let (start, end) = (hex(start)?, hex(end)?);
    if start >= end {
        return None;
    }
    let mut p = [b'-'; 4];
    for (d, s) in p.iter_mut().zip(perms.bytes()) {
        *d = s;
    }
    Some(Mapping {
        start,
        end,
        perms: p,
        offset: hex(offset)?,
        dev: (hex32(major)?, hex32(minor)?),
        inode: inode.parse().ok()?,
        path: rest.trim().to_string(),
    })
}

/// The `/proc/PID/map_files` entry of the range `start..end`. Its name is
/// the range in hex *unpadded*, where maps pads addresses to 8 digits: a
/// range below 0x10000000 (a non-PIE executable at 0x400000: Node, a
/// `cc -static` binary) is named otherwise than maps prints it.
pub fn map_file(pid: u32, start: u64, end: u64) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/map_files/{start:x}-{end:x}"))
}

/// Whether `pid`'s `map_files` directory cannot be read at all (another
/// user's process, without CAP_SYS_PTRACE; or CAP_SYS_ADMIN for
/// `map_files`).
pub fn map_files_hidden(pid: u32) -> bool {
    let dir = format!("/proc/{pid}/map_files");
    std::fs::read_link(&dir).is_err() && std::fs::read_dir(&dir).is_err()
}

/// A path that opens the file `m` maps, checked against the mapping's
/// device and inode, in this order: `/proc/PID/root/<path>` (the target's
/// own view: a container's files); the mapping itself in
/// `/proc/PID/map_files` (root only; also a file replaced or deleted
/// since); the path as the host sees it (a target that exited, seen from
/// its own namespace). `None`: none of them is the mapped file.
pub fn mapped_file(pid: u32, m: &Mapping) -> Option<PathBuf> {
    let is_mapped = |p: &Path| std::fs::metadata(p).is_ok_and(|meta| m.is_file_of(&meta));
    let via_root = PathBuf::from(format!("/proc/{pid}/root{}", m.path));
    if is_mapped(&via_root) {
        return Some(via_root);
    }
    let map_file = m.map_file(pid);
    if std::fs::metadata(&map_file).is_ok() {
        log::debug!(
            "pid {pid}: {} is not the mapped file: opening {}",
            via_root.display(),
            map_file.display()
        );
        return Some(map_file);
    }
    let host = PathBuf::from(&m.path);
    is_mapped(&host).then_some(host)
}

/// Load bias = runtime address - link-time address, from the mapping that
/// covers the file offset of the lowest PT_LOAD segment. 0 for non-PIE
/// executables.
pub fn load_bias(maps: &[&Mapping], segments: &[(u64, u64)]) -> Option<u64> {
    const PAGE: u64 = 4096;
    let &(vaddr, offset) = segments.iter().min_by_key(|(vaddr, _)| *vaddr)?;
    let m = maps.iter().find(|m| m.offset == offset & !(PAGE - 1))?;
    Some(m.start.wrapping_sub(vaddr & !(PAGE - 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse() {
        let text = "\
00400000-00420000 r--p 00000000 08:01 123   /usr/bin/python3.11
7f0000000000-7f0000001000 rw-p 00000000 00:00 0 
7f0000002000-7f0000003000 r-xp 00010000 08:01 77  /opt/my lib/libpython3.12.so.1.0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0   [stack]
";
        let maps: Vec<_> = parse(text).into_iter().filter(Mapping::is_file).collect();
        assert_eq!(maps.len(), 2);
        assert_eq!(
            maps[0],
            Mapping {
                start: 0x400000,
                end: 0x420000,
                perms: *b"r--p",
                offset: 0,
                dev: (8, 1),
                inode: 123,
                path: "/usr/bin/python3.11".into()
            }
        );
        assert_eq!(maps[1].path, "/opt/my lib/libpython3.12.so.1.0");
        assert_eq!(maps[1].offset, 0x10000);
    }

    /// Every kind of line the kernel prints, and what is not one.
    #[test]
    fn special_anonymous_deleted_and_garbage_lines() {
        let text = "\
55d0c0a00000-55d0c0a27000 r--p 00000000 08:01 1234 /usr/bin/python3.12
55d0c0a27000-55d0c0d00000 r-xp 00027000 08:01 1234 /usr/bin/python3.12
7f0000000000-7f0000001000 rwxp 00000000 00:00 0 
7f1000000000-7f1000002000 r-xp 00000000 00:00 0                          [vdso]
7f2000000000-7f2000100000 r-xp 00001000 fe:10a 99 /tmp/with  space/lib.so (deleted)
7f3000000000-7f3000000000 r-xp 00000000 00:00 0 
garbage line
";
        let maps = parse(text);
        assert_eq!(maps.len(), 5);
        assert!(!maps[0].is_exec() && maps[1].is_exec());
        assert_eq!(maps[1].offset, 0x27000);
        assert_eq!((maps[1].inode, maps[1].dev), (1234, (8, 1)));
        assert!(maps[2].is_exec() && !maps[2].is_file() && maps[2].path.is_empty());
        assert_eq!(maps[3].path, "[vdso]");
        assert!(!maps[3].is_file());
        let deleted = &maps[4];
        assert!(deleted.is_file());
        assert_eq!(deleted.path, "/tmp/with  space/lib.so (deleted)");
        assert_eq!(deleted.path_undeleted(), "/tmp/with  space/lib.so");
        assert_eq!(deleted.dev, (0xfe, 0x10a));
        assert_eq!(maps[1].path_undeleted(), "/usr/bin/python3.12");
    }

    #[test]
    fn map_files_names_ranges_unpadded() {
        let m = |line| parse_line(line).unwrap().map_file(7);
        assert_eq!(
            m("00400000-00b6f000 r-xp 00000000 08:01 5 /usr/bin/node"),
            Path::new("/proc/7/map_files/400000-b6f000")
        );
        assert_eq!(
            m("7f758ff64000-7f75900ba000 r-xp 00000000 08:01 5 /lib/libc.so.6"),
            Path::new("/proc/7/map_files/7f758ff64000-7f75900ba000")
        );
        assert_eq!(parse_line("garbage r-xp 00000000 08:01 5 /x"), None);
    }

    /// A low address, which maps pads with zeros, is its value, and its
    /// `map_files` name has no padding.
    #[test]
    fn a_padded_low_address_is_its_value() {
        let m = parse_line("00001000-0000f000 r-xp 00000000 00:00 0").unwrap();
        assert_eq!((m.start, m.end), (0x1000, 0xf000));
        assert_eq!(m.map_file(7), Path::new("/proc/7/map_files/1000-f000"));
    }

    /// This process's maps are read, and the `map_files` entry of its
    /// executable's code opens.
    #[test]
    fn own_maps_read_and_map_files_open() {
        let me = std::process::id();
        let own = read(me).unwrap();
        let exe = own.iter().find(|m| m.is_exec() && m.is_file()).unwrap();
        assert!(std::fs::metadata(exe.map_file(me)).is_ok());
        assert!(!map_files_hidden(me));
    }

    #[test]
    fn mapped_files_open_as_mapped() {
        // This test binary: its path through /proc/self/root is the mapped file.
        let pid = std::process::id();
        let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let maps = parse(&text);
        let m = maps.iter().find(|m| Path::new(&m.path) == exe).unwrap();
        assert_eq!(
            mapped_file(pid, m),
            Some(PathBuf::from(format!("/proc/{pid}/root{}", m.path)))
        );
        // A mapping whose path now names another file: the mapping itself.
        let other = Mapping {
            inode: m.inode + 1,
            ..m.clone()
        };
        let p = mapped_file(pid, &other).unwrap();
        assert!(p.starts_with(format!("/proc/{pid}/map_files/")), "{p:?}");
        // ... and nothing once the mapping is gone too.
        let gone = Mapping {
            start: 0x1000,
            end: 0x2000,
            ..other
        };
        assert_eq!(mapped_file(pid, &gone), None);
    }

    #[test]
    fn load_bias_of_pie_and_non_pie() {
        let m = |start, offset| Mapping {
            start,
            end: start + 0x1000,
            perms: *b"r-xp",
            offset,
            dev: (0, 0),
            inode: 0,
            path: String::new(),
        };
        let (a, b) = (m(0x7f00_0000_0000, 0), m(0x7f00_0000_5000, 0x5000));
        assert_eq!(
            load_bias(&[&a, &b], &[(0x5000, 0x5000), (0, 0)]),
            Some(0x7f00_0000_0000)
        );
        let exe = m(0x400000, 0);
        assert_eq!(load_bias(&[&exe], &[(0x400000, 0)]), Some(0));
    }
}
