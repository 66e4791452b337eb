//! User-space stack unwinding from captured registers and stack bytes.
//!
//! # What comes in
//!
//! For each CPU-clock sample or `sched_switch` of a profiled thread the eBPF
//! side copies the thread's user registers (`rip`, `rsp`, `rbp`) and a
//! fixed-size window of its user stack starting at `rsp` (fewer bytes when the
//! stack top is nearer). [`Unwinder::unwind`] takes the process id (the
//! *tgid*, not the thread id), those registers as [`UserRegs`] and the bytes
//! at `[regs.sp, regs.sp + stack.len())`.
//!
//! # What goes out
//!
//! A list of code addresses, innermost first: the first is `regs.ip`, every
//! following one is a **return address** (the instruction after a `call`), so
//! a symbolizer should look up `addr - 1` for all but the first to land inside
//! the calling instruction. Plus an [`UnwindOutcome`] saying whether the walk
//! reached the outermost frame, ran off the copied window, or gave up.
//!
//! # How
//!
//! Unwinding is done by [`framehop`] from the DWARF CFI of each module
//! (`.eh_frame` indexed by `.eh_frame_hdr`, or `.debug_frame` when there is no
//! `.eh_frame`), so binaries built without frame pointers (CPython `-O3`,
//! Rust release, Node's C++ side) unwind correctly. Where a module has no
//! unwind info, or the address is in no module (JIT code), framehop falls back
//! to the frame-pointer rule (`rbp` chain); a zero `rbp`, a zero return address
//! or a CFI row with an undefined return address ends the walk cleanly.
//!
//! Modules come from `/proc/PID/maps` (executable mappings). Each ELF is opened
//! through `/proc/PID/map_files/START-END` (works for deleted files and other
//! mount namespaces), falling back to `/proc/PID/root/PATH`, then `PATH`, and
//! parsed with `object`; only the unwind sections are read from the file
//! (not the whole file). The `[vdso]` is parsed once from this process's own
//! copy (same kernel, same image).
//!
//! # Caching and cost
//!
//! * Parsed unwind sections are cached per file identity (device, inode, size,
//!   mtime), so N processes of one binary parse it once. Unused entries are
//!   dropped by [`Unwinder::forget`] only when the cache exceeds
//!   [`FILE_CACHE_BUDGET`] bytes, so a binary spawned over and over is parsed
//!   once too.
//! * Per process: a framehop unwinder holding that process's modules and a
//!   sorted snapshot of its executable mappings. When an unwound address falls
//!   in no executable mapping (e.g. after `dlopen`), the maps are re-read and
//!   the stack unwound again; re-reads are rate-limited (100 ms, backing off to
//!   5 s while they find nothing new).
//! * One framehop rule cache (509 slots, keyed by address) shared by all
//!   processes, so repeated samples at the same addresses skip CFI parsing.
//! * When the process has exited, its last maps snapshot is kept, so buffered
//!   stacks of a process that just exited still unwind; call
//!   [`Unwinder::forget`] once they are drained.
//!
//! # Constraints
//!
//! * x86_64 only (64-bit processes; the vDSO of a 32-bit process differs).
//! * At most [`MAX_FRAMES`] addresses per stack.
//! * Never panics on garbage input (random bytes, zero `sp`/`ip`, unknown
//!   pids or modules); a bad walk ends with [`UnwindOutcome::Failed`].
//! * Not thread-safe by design (`&mut self`); use one per recording.
//! * Separate debug-info files (`.gnu_debuglink`) and compressed
//!   `.debug_frame` are not consulted; `.eh_frame` is always present in
//!   practice on Linux.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{Error as FhError, ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder as _};
use object::{Object, ObjectSection, ObjectSegment, ReadRef};

/// Most addresses returned for one stack (the first, `ip`, included).
pub const MAX_FRAMES: usize = 128;

/// Bytes of parsed unwind sections kept for files no live process maps.
pub const FILE_CACHE_BUDGET: usize = 256 << 20;

/// A read this far above the end of the copied window still counts as "ran off
/// the window" ([`UnwindOutcome::Truncated`]) rather than a bad frame: no single
/// frame is larger than a default stack.
const TRUNCATION_SLACK: u64 = 8 << 20;

/// First interval between two re-reads of a process's maps on an address miss.
const REFRESH_MIN: Duration = Duration::from_millis(100);
/// Longest interval, reached by doubling while re-reads find nothing new.
const REFRESH_MAX: Duration = Duration::from_secs(5);

/// Section bytes shared between the file cache and every process mapping them.
type Data = Arc<[u8]>;

/// User registers captured with the stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UserRegs {
    /// `rip`: the interrupted instruction.
    pub ip: u64,
    /// `rsp`: the address of the first byte of the copied stack.
    pub sp: u64,
    /// `rbp`: only needed where frame-pointer unwinding is used.
    pub bp: u64,
}

/// How an unwind ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnwindOutcome {
    /// Reached the outermost frame (`_start`, a thread's `clone` entry, a zero
    /// frame pointer or return address).
    Complete,
    /// Ran off the copied stack window (the stack goes on above it), or hit
    /// [`MAX_FRAMES`]. The addresses returned are right but not the whole stack.
    Truncated,
    /// Could not go on: a frame without usable unwind info whose frame pointer
    /// is garbage, a return address outside any executable mapping, a read
    /// below `sp`, or a zero `ip`. The addresses before the failure are kept.
    Failed,
}

/// Identity of an ELF file on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FileKey {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: i64,
    mtime_nsec: i64,
}

/// A `PT_LOAD` program header, enough to map a file offset to an SVMA.
#[derive(Clone, Copy, Debug)]
struct LoadSegment {
    offset: u64,
    vaddr: u64,
    filesz: u64,
    exec: bool,
}

/// The parts of an ELF file framehop needs, parsed once per file.
struct ElfUnwindInfo {
    loads: Vec<LoadSegment>,
    /// Lowest `PT_LOAD` vaddr, page-aligned down; the module's base SVMA.
    base_svma: u64,
    text_svma: Option<Range<u64>>,
    got_svma: Option<Range<u64>>,
    eh_frame: Option<(Range<u64>, Data)>,
    eh_frame_hdr: Option<(Range<u64>, Data)>,
    debug_frame: Option<Data>,
}

impl ElfUnwindInfo {
    fn parse<'d, R: ReadRef<'d>>(data: R) -> Option<Self> {
        let file = object::File::parse(data).ok()?;
        if file.format() != object::BinaryFormat::Elf
            || file.architecture() != object::Architecture::X86_64
        {
            return None;
        }
        let loads: Vec<LoadSegment> = file
            .segments()
            .filter_map(|s| {
                let (offset, filesz) = s.file_range();
                let exec = match s.flags() {
                    object::SegmentFlags::Elf { p_flags } => p_flags & object::elf::PF_X != 0,
                    _ => false,
                };
                Some(LoadSegment {
                    offset,
                    vaddr: s.address(),
                    filesz,
                    exec,
                })
                .filter(|_| filesz > 0)
            })
            .collect();
        if loads.is_empty() {
            return None;
        }
        let base_svma = loads.iter().map(|l| l.vaddr).min().unwrap_or(0) & !0xfff;
        let range_of = |name: &str| {
            let s = file.section_by_name(name)?;
            Some(s.address()..s.address().checked_add(s.size())?)
        };
        let data_of = |name: &str| -> Option<Data> {
            let s = file.section_by_name(name)?;
            // Compressed sections would need inflating; skip them.
            let c = s.compressed_file_range().ok()?;
            if c.format != object::CompressionFormat::None {
                return None;
            }
            let d = s.data().ok()?;
            (!d.is_empty()).then(|| Arc::from(d))
        };
        let with_range =
            |name: &str| -> Option<(Range<u64>, Data)> { Some((range_of(name)?, data_of(name)?)) };
        let mut eh_frame = with_range(".eh_frame");
        let mut debug_frame = data_of(".debug_frame");
        // framehop uses one CFI section per module and ignores .debug_frame when
        // there is an .eh_frame. Both exist when some objects were built without
        // unwind tables but with -g (then .eh_frame covers little more than the
        // C runtime's start files): use the larger, which covers more code.
        match (&eh_frame, &debug_frame) {
            (Some(e), Some(d)) if d.len() > e.1.len() => eh_frame = None,
            (Some(_), Some(_)) => debug_frame = None,
            _ => {}
        }
        let eh_frame_hdr = if eh_frame.is_some() {
            with_range(".eh_frame_hdr")
        } else {
            None
        };
        Some(ElfUnwindInfo {
            loads,
            base_svma,
            text_svma: range_of(".text"),
            got_svma: range_of(".got"),
            eh_frame,
            eh_frame_hdr,
            debug_frame,
        })
    }

    /// Whether a process's module still holds this file's section data.
    fn in_use(&self) -> bool {
        let held = |d: &Data| Arc::strong_count(d) > 1;
        self.eh_frame.as_ref().is_some_and(|e| held(&e.1))
            || self.eh_frame_hdr.as_ref().is_some_and(|e| held(&e.1))
            || self.debug_frame.as_ref().is_some_and(held)
    }

    fn bytes(&self) -> usize {
        self.eh_frame.as_ref().map_or(0, |e| e.1.len())
            + self.eh_frame_hdr.as_ref().map_or(0, |e| e.1.len())
            + self.debug_frame.as_ref().map_or(0, |d| d.len())
    }

    /// Load bias (AVMA - SVMA) of a mapping of this file at `start` from file
    /// offset `file_offset`.
    fn bias(&self, start: u64, file_offset: u64) -> Option<u64> {
        // Adjacent segments can share a page, so several may contain the
        // offset: the mapping is executable, prefer the executable segment.
        let contains = |l: &&LoadSegment| {
            file_offset >= l.offset & !0xfff && file_offset < l.offset.saturating_add(l.filesz)
        };
        let seg = (self.loads.iter().filter(contains).find(|l| l.exec))
            .or_else(|| {
                self.loads
                    .iter()
                    .filter(contains)
                    .find(|l| l.offset & !0xfff == file_offset)
            })
            .or_else(|| self.loads.iter().find(contains))
            .or_else(|| self.loads.iter().find(|l| l.exec))?;
        // SVMA of the mapping's first byte.
        let svma = seg.vaddr.wrapping_add(file_offset).wrapping_sub(seg.offset);
        Some(start.wrapping_sub(svma))
    }

    fn module(&self, name: &str, avma: Range<u64>, file_offset: u64) -> Option<Module<Data>> {
        let bias = self.bias(avma.start, file_offset)?;
        let base_avma = bias.checked_add(self.base_svma)?;
        if base_avma > avma.start {
            return None;
        }
        let info = ExplicitModuleSectionInfo {
            base_svma: self.base_svma,
            text_svma: self.text_svma.clone(),
            got_svma: self.got_svma.clone(),
            eh_frame_svma: self.eh_frame.as_ref().map(|e| e.0.clone()),
            eh_frame: self.eh_frame.as_ref().map(|e| e.1.clone()),
            eh_frame_hdr_svma: self.eh_frame_hdr.as_ref().map(|e| e.0.clone()),
            eh_frame_hdr: self.eh_frame_hdr.as_ref().map(|e| e.1.clone()),
            debug_frame: self.debug_frame.clone(),
            ..Default::default()
        };
        Some(Module::new(name.to_string(), avma, base_avma, info))
    }
}

/// What an executable mapping holds.
#[derive(Clone, Debug, PartialEq, Eq)]
enum MapKind {
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
struct ExecMapping {
    start: u64,
    end: u64,
    offset: u64,
    kind: MapKind,
    /// Whether a framehop module was added for it (keyed by `start`).
    has_module: bool,
}

impl ExecMapping {
    fn same_as(&self, other: &ExecMapping) -> bool {
        self.start == other.start
            && self.end == other.end
            && self.offset == other.offset
            && self.kind == other.kind
    }
}

/// The mapping in `maps` (sorted by start) identical to `m`.
fn find_same<'a>(maps: &'a [ExecMapping], m: &ExecMapping) -> Option<&'a ExecMapping> {
    let i = maps.binary_search_by_key(&m.start, |o| o.start).ok()?;
    Some(&maps[i]).filter(|o| o.same_as(m))
}

/// Parse the executable mappings out of the text of `/proc/PID/maps`.
fn parse_maps(text: &str) -> Vec<ExecMapping> {
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
        });
    }
    out.sort_by_key(|m| m.start);
    out
}

/// Per-process state.
struct Proc {
    fh: UnwinderX86_64<Data>,
    /// Sorted by start, non-overlapping.
    maps: Vec<ExecMapping>,
    last_refresh: Instant,
    refresh_interval: Duration,
    /// False once `/proc/PID/maps` could not be read (exited): keep the snapshot.
    alive: bool,
}

impl Proc {
    fn is_exec(&self, addr: u64) -> bool {
        let i = self.maps.partition_point(|m| m.start <= addr);
        i > 0 && addr < self.maps[i - 1].end
    }
}

/// Unwinds captured user stacks; one per recording. Caches per process and per
/// module (see the module docs).
pub struct Unwinder {
    cache: CacheX86_64,
    procs: HashMap<u32, Proc>,
    /// `None`: not an x86_64 ELF or unreadable: no unwind info (frame pointers).
    files: HashMap<FileKey, Option<Arc<ElfUnwindInfo>>>,
    /// This process's vDSO, parsed on first need (`Some(None)`: unavailable).
    vdso: Option<Option<Arc<ElfUnwindInfo>>>,
}

impl Default for Unwinder {
    fn default() -> Self {
        Self::new()
    }
}

impl Unwinder {
    pub fn new() -> Self {
        Unwinder {
            cache: CacheX86_64::new(),
            procs: HashMap::new(),
            files: HashMap::new(),
            vdso: None,
        }
    }

    /// Unwind one captured stack of process `pid` (the tgid). `stack` holds the
    /// bytes at `[regs.sp, regs.sp + stack.len())`: pass only the valid bytes
    /// the eBPF side copied, not the whole fixed-size buffer.
    ///
    /// Returns the addresses innermost first — the first is `regs.ip`, the rest
    /// are return addresses (symbolize `addr - 1`) — and how the walk ended.
    pub fn unwind(&mut self, pid: u32, regs: &UserRegs, stack: &[u8]) -> (Vec<u64>, UnwindOutcome) {
        if regs.ip == 0 {
            return (Vec::new(), UnwindOutcome::Failed);
        }
        if !self.procs.contains_key(&pid) {
            let proc = self.load_proc(pid);
            self.procs.insert(pid, proc);
        }
        let (frames, outcome, missed) = self.walk(pid, regs, stack);
        if !missed || !self.may_refresh(pid) {
            return (frames, outcome);
        }
        if !self.refresh(pid) {
            return (frames, outcome);
        }
        let (frames, outcome, _) = self.walk(pid, regs, stack);
        (frames, outcome)
    }

    /// Forget a process (it exited and its buffered stacks are drained),
    /// freeing its modules. Parsed files no process uses any more are dropped
    /// only while the file cache is over [`FILE_CACHE_BUDGET`].
    pub fn forget(&mut self, pid: u32) {
        if self.procs.remove(&pid).is_none() {
            return;
        }
        let total: usize = self.files.values().flatten().map(|f| f.bytes()).sum();
        if total > FILE_CACHE_BUDGET {
            self.files
                .retain(|_, f| f.as_ref().is_none_or(|f| f.in_use()));
        }
    }

    /// Walk the stack. Returns (addresses, outcome, whether an address fell
    /// outside every known executable mapping).
    fn walk(&mut self, pid: u32, regs: &UserRegs, stack: &[u8]) -> (Vec<u64>, UnwindOutcome, bool) {
        let Some(proc) = self.procs.get(&pid) else {
            return (vec![regs.ip], UnwindOutcome::Failed, false);
        };
        let sp = regs.sp;
        // Window [sp, end); clamp so that sp + len cannot overflow.
        let len = (stack.len() as u64).min(u64::MAX - sp);
        let end = sp + len;
        let mut read_stack = |addr: u64| -> Result<u64, ()> {
            let off = addr.checked_sub(sp).ok_or(())?;
            if off.checked_add(8).is_none_or(|e| e > len) {
                return Err(());
            }
            let off = off as usize;
            let bytes: [u8; 8] = stack[off..off + 8].try_into().map_err(|_| ())?;
            Ok(u64::from_le_bytes(bytes))
        };
        let check_exec = !proc.maps.is_empty();
        let mut frames = Vec::with_capacity(32);
        let mut missed = false;
        let fh_regs = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
        let mut iter = proc
            .fh
            .iter_frames(regs.ip, fh_regs, &mut self.cache, &mut read_stack);
        let outcome = loop {
            if frames.len() >= MAX_FRAMES {
                break UnwindOutcome::Truncated;
            }
            match iter.next() {
                Ok(Some(frame)) => {
                    let addr = match frame {
                        FrameAddress::InstructionPointer(a) => a,
                        FrameAddress::ReturnAddress(a) => a.get(),
                    };
                    if check_exec && !proc.is_exec(addr) {
                        missed = true;
                        if frames.is_empty() {
                            // Keep the sampled ip even if we cannot place it.
                            frames.push(addr);
                        }
                        break UnwindOutcome::Failed;
                    }
                    frames.push(addr);
                }
                Ok(None) => break UnwindOutcome::Complete,
                Err(FhError::ReturnAddressIsNull) => break UnwindOutcome::Complete,
                Err(FhError::CouldNotReadStack(a))
                    if a >= end.saturating_sub(8)
                        && a - end.saturating_sub(8) < TRUNCATION_SLACK =>
                {
                    break UnwindOutcome::Truncated;
                }
                Err(_) => break UnwindOutcome::Failed,
            }
        };
        (frames, outcome, missed)
    }

    fn may_refresh(&self, pid: u32) -> bool {
        self.procs
            .get(&pid)
            .is_some_and(|p| p.alive && p.last_refresh.elapsed() >= p.refresh_interval)
    }

    fn load_proc(&mut self, pid: u32) -> Proc {
        let mut proc = Proc {
            fh: UnwinderX86_64::new(),
            maps: Vec::new(),
            last_refresh: Instant::now(),
            refresh_interval: REFRESH_MIN,
            alive: true,
        };
        match read_maps(pid) {
            Some(maps) => {
                self.apply_maps(pid, &mut proc, maps);
            }
            None => proc.alive = false,
        }
        proc
    }

    /// Re-read the maps of `pid`; true if anything changed.
    fn refresh(&mut self, pid: u32) -> bool {
        let Some(mut proc) = self.procs.remove(&pid) else {
            return false;
        };
        proc.last_refresh = Instant::now();
        let changed = match read_maps(pid) {
            Some(maps) => self.apply_maps(pid, &mut proc, maps),
            None => {
                proc.alive = false;
                false
            }
        };
        proc.refresh_interval = if changed {
            REFRESH_MIN
        } else {
            (proc.refresh_interval * 2).min(REFRESH_MAX)
        };
        self.procs.insert(pid, proc);
        changed
    }

    /// Bring `proc` in line with a fresh maps snapshot; true if it changed.
    fn apply_maps(&mut self, pid: u32, proc: &mut Proc, new: Vec<ExecMapping>) -> bool {
        let old = std::mem::take(&mut proc.maps);
        let mut changed = false;
        for m in &old {
            if m.has_module && find_same(&new, m).is_none() {
                proc.fh.remove_module(m.start);
            }
        }
        let mut maps = Vec::with_capacity(new.len());
        for mut m in new {
            if let Some(o) = find_same(&old, &m) {
                m.has_module = o.has_module;
            } else {
                changed = true;
                if let Some(module) = self.module_for(pid, &m) {
                    proc.fh.add_module(module);
                    m.has_module = true;
                }
            }
            maps.push(m);
        }
        changed |= maps.len() != old.len();
        proc.maps = maps;
        changed
    }

    fn module_for(&mut self, pid: u32, m: &ExecMapping) -> Option<Module<Data>> {
        match &m.kind {
            MapKind::Anon => None,
            MapKind::Vdso => {
                let info = self
                    .vdso
                    .get_or_insert_with(|| own_vdso().map(Arc::new))
                    .clone()?;
                info.module("[vdso]", m.start..m.end, 0)
            }
            MapKind::File { path, .. } => {
                let file = open_mapped_file(pid, m.start, m.end, path)?;
                let meta = file.metadata().ok()?;
                let key = FileKey {
                    dev: meta.dev(),
                    ino: meta.ino(),
                    size: meta.size(),
                    mtime: meta.mtime(),
                    mtime_nsec: meta.mtime_nsec(),
                };
                let info = self
                    .files
                    .entry(key)
                    .or_insert_with(|| {
                        let cache = object::ReadCache::new(file);
                        let parsed = ElfUnwindInfo::parse(&cache).map(Arc::new);
                        if parsed.is_none() {
                            log::debug!("unwind: no usable ELF unwind info in {path}");
                        }
                        parsed
                    })
                    .clone()?;
                info.module(path, m.start..m.end, m.offset)
            }
        }
    }
}

fn read_maps(pid: u32) -> Option<Vec<ExecMapping>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    // A zombie's maps read as empty: treat as gone, keep the old snapshot.
    let maps = parse_maps(&text);
    (!maps.is_empty()).then_some(maps)
}

/// Open the file behind a mapping, preferring `map_files` (deleted files,
/// other mount namespaces), then the process's root, then the plain path.
fn open_mapped_file(pid: u32, start: u64, end: u64, path: &str) -> Option<File> {
    if let Ok(f) = File::open(format!("/proc/{pid}/map_files/{start:x}-{end:x}")) {
        return Some(f);
    }
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    File::open(format!("/proc/{pid}/root{path}"))
        .or_else(|_| File::open(path))
        .ok()
}

/// Parse this process's vDSO image: every 64-bit process on this kernel maps
/// the same one.
fn own_vdso() -> Option<ElfUnwindInfo> {
    let text = std::fs::read_to_string("/proc/self/maps").ok()?;
    let line = text.lines().find(|l| l.trim_end().ends_with("[vdso]"))?;
    let (s, rest) = line.split_once('-')?;
    let e = rest.split(' ').next()?;
    let (start, end) = (
        u64::from_str_radix(s, 16).ok()?,
        u64::from_str_radix(e, 16).ok()?,
    );
    // Read through /proc/self/mem: a failed read is an error, not a fault.
    let mem = File::open("/proc/self/mem").ok()?;
    let mut buf = vec![0u8; end.checked_sub(start)? as usize];
    std::os::unix::fs::FileExt::read_exact_at(&mem, &mut buf, start).ok()?;
    ElfUnwindInfo::parse(&buf[..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hint::black_box;

    /// Copy up to `len` bytes of this process's memory at `addr`, stopping at
    /// the first unreadable page.
    fn read_own_memory(addr: u64, len: usize) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mem = File::open("/proc/self/mem").unwrap();
        let mut out = vec![0u8; len];
        let mut done = 0;
        while done < len {
            match mem.read_at(&mut out[done..], addr + done as u64) {
                Ok(0) | Err(_) => break,
                Ok(n) => done += n,
            }
        }
        out.truncate(done);
        out
    }

    /// Captures `rip`, `rsp`, `rbp` at the point of use, in the calling function.
    macro_rules! capture_regs {
        () => {{
            let (ip, sp, bp): (u64, u64, u64);
            unsafe {
                std::arch::asm!(
                    "lea {ip}, [rip]",
                    "mov {sp}, rsp",
                    "mov {bp}, rbp",
                    ip = out(reg) ip,
                    sp = out(reg) sp,
                    bp = out(reg) bp,
                    options(nomem, nostack, preserves_flags),
                );
            }
            UserRegs { ip, sp, bp }
        }};
    }

    #[inline(never)]
    fn unwind_test_level_three(depth: u32) -> (UserRegs, Vec<u8>) {
        let regs = capture_regs!();
        let stack = read_own_memory(regs.sp, 16 * 1024);
        black_box(depth);
        (regs, stack)
    }

    #[inline(never)]
    fn unwind_test_level_two(depth: u32) -> (UserRegs, Vec<u8>) {
        let r = unwind_test_level_three(black_box(depth + 1));
        black_box(&r);
        r
    }

    #[inline(never)]
    fn unwind_test_level_one(depth: u32) -> (UserRegs, Vec<u8>) {
        let r = unwind_test_level_two(black_box(depth + 1));
        black_box(&r);
        r
    }

    fn symbolize_pid(pid: u32, frames: &[u64]) -> Vec<String> {
        use blazesym::symbolize::source::{Process, Source};
        use blazesym::symbolize::{Input, Symbolizer};
        // Return addresses point after the call: look up the call itself.
        let lookup: Vec<u64> = frames
            .iter()
            .enumerate()
            .map(|(i, &a)| if i == 0 { a } else { a - 1 })
            .collect();
        let src = Source::Process(Process::new(pid.into()));
        let symbolizer = Symbolizer::new();
        let syms = symbolizer.symbolize(&src, Input::AbsAddr(&lookup)).unwrap();
        syms.iter()
            .map(|s| {
                s.as_sym()
                    .map(|s| s.name.to_string())
                    .unwrap_or_else(|| "?".into())
            })
            .collect()
    }

    /// Indexes in `names` of the first name containing each needle, in order.
    fn find_in_order(names: &[String], needles: &[&str]) -> Option<Vec<usize>> {
        let mut from = 0;
        let mut idx = Vec::new();
        for n in needles {
            let i = from + names[from..].iter().position(|s| s.contains(n))?;
            idx.push(i);
            from = i + 1;
        }
        Some(idx)
    }

    #[test]
    fn unwinds_own_stack_with_cfi() {
        let (regs, stack) = unwind_test_level_one(0);
        assert!(stack.len() >= 4096, "copied {} stack bytes", stack.len());
        let pid = std::process::id();
        let mut unwinder = Unwinder::new();
        let (frames, outcome) = unwinder.unwind(pid, &regs, &stack);
        assert_eq!(frames[0], regs.ip);
        let names = symbolize_pid(pid, &frames);
        let order = find_in_order(
            &names,
            &[
                "unwind_test_level_three",
                "unwind_test_level_two",
                "unwind_test_level_one",
            ],
        );
        assert_eq!(
            order,
            Some(vec![0, 1, 2]),
            "outcome {outcome:?}, frames {names:#?}"
        );
        // The test runner's caller frames come next: the walk went on past us.
        assert!(frames.len() > 5, "{names:#?}");
        assert_ne!(outcome, UnwindOutcome::Failed, "{names:#?}");

        // Same stack with a poisoned rbp: CFI alone must get through our frames,
        // so this does not depend on frame pointers.
        let poisoned = UserRegs {
            bp: 0x0bad_0bad_0bad_0bad,
            ..regs
        };
        let (frames2, _) = unwinder.unwind(pid, &poisoned, &stack);
        let names2 = symbolize_pid(pid, &frames2);
        assert_eq!(
            find_in_order(
                &names2,
                &[
                    "unwind_test_level_three",
                    "unwind_test_level_two",
                    "unwind_test_level_one"
                ]
            ),
            Some(vec![0, 1, 2]),
            "{names2:#?}"
        );

        // A short window ends as Truncated, keeping the innermost frames.
        let (short, outcome) = unwinder.unwind(pid, &regs, &stack[..256.min(stack.len())]);
        assert!(!short.is_empty());
        assert_eq!(short[..], frames[..short.len()]);
        assert_eq!(outcome, UnwindOutcome::Truncated, "{short:x?}");
    }

    /// Build the C victim with `flags`, run it, and unwind the stack it captured
    /// of itself. Skipped (with a message) when there is no C compiler.
    fn unwind_c_victim(variant: &str, flags: &[&str], expect_complete: bool) {
        use std::io::Read;
        use std::process::{Command, Stdio};
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/victims/unwind_victim.c");
        let dir =
            std::env::temp_dir().join(format!("stallprof-unwind-{}-{variant}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join(format!("unwind_victim_{variant}"));
        let built = Command::new("cc")
            .args(flags)
            .arg("-o")
            .arg(&exe)
            .arg(src)
            .status();
        match built {
            Ok(s) if s.success() => {}
            other => {
                eprintln!("skipping C victim test ({variant}): cc failed: {other:?}");
                return;
            }
        }
        let mut child = Command::new(&exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut out = child.stdout.take().unwrap();
        let mut header = [0u8; 32];
        out.read_exact(&mut header).unwrap();
        let word = |i: usize| u64::from_le_bytes(header[i * 8..i * 8 + 8].try_into().unwrap());
        let regs = UserRegs {
            ip: word(0),
            sp: word(1),
            bp: word(2),
        };
        let mut stack = vec![0u8; word(3) as usize];
        out.read_exact(&mut stack).unwrap();

        let mut unwinder = Unwinder::new();
        let (frames, outcome) = unwinder.unwind(pid, &regs, &stack);
        let names = symbolize_pid(pid, &frames);
        let want = [
            "victim_level_three",
            "victim_level_two",
            "victim_level_one",
            "main",
        ];
        let order = find_in_order(&names, &want);
        // Let the victim exit, then unwind the same stack again: the maps
        // snapshot outlives the process.
        drop(child.stdin.take());
        child.wait().unwrap();
        let (again, outcome_again) = unwinder.unwind(pid, &regs, &stack);
        let _ = std::fs::remove_file(&exe);
        let _ = std::fs::remove_dir(&dir);
        assert_eq!(
            order,
            Some(vec![0, 1, 2, 3]),
            "{variant}: {outcome:?} {names:#?}"
        );
        if expect_complete {
            assert_eq!(outcome, UnwindOutcome::Complete, "{variant}: {names:#?}");
        }
        assert_eq!(
            (again, outcome_again),
            (frames, outcome),
            "{variant}: after exit"
        );
        unwinder.forget(pid);
    }

    #[test]
    fn unwinds_c_without_frame_pointers_eh_frame() {
        unwind_c_victim("eh_frame", &["-O2", "-fomit-frame-pointer"], true);
    }

    #[test]
    fn unwinds_c_without_frame_pointers_debug_frame() {
        unwind_c_victim(
            "debug_frame",
            &[
                "-O2",
                "-fomit-frame-pointer",
                "-g",
                "-fno-asynchronous-unwind-tables",
                "-fno-unwind-tables",
            ],
            // Our code is in .debug_frame, but `_start` (crt1.o) only has
            // .eh_frame, which this module no longer uses: the last step
            // falls back to a frame-pointer guess and may end as Failed.
            false,
        );
    }

    /// Cost of one unwind of a warm stack (run with `--ignored --nocapture`,
    /// in release for realistic numbers).
    #[test]
    #[ignore]
    fn bench_unwind_own_stack() {
        let (regs, stack) = unwind_test_level_one(0);
        let pid = std::process::id();
        let mut unwinder = Unwinder::new();
        let t = Instant::now();
        let (frames, _) = unwinder.unwind(pid, &regs, &stack);
        let cold = t.elapsed();
        let n = 100_000;
        let t = Instant::now();
        for _ in 0..n {
            black_box(unwinder.unwind(pid, black_box(&regs), black_box(&stack)));
        }
        let warm = t.elapsed() / n;
        let cache = unwinder.cache.stats();
        eprintln!(
            "cold (maps + ELF parse) {cold:?}; warm {warm:?} per unwind of {} frames; {cache:?}",
            frames.len()
        );
    }

    #[test]
    fn refreshes_maps_on_unknown_address() {
        let (regs, stack) = unwind_test_level_one(0);
        let pid = std::process::id();
        let mut unwinder = Unwinder::new();
        let (full, _) = unwinder.unwind(pid, &regs, &stack);
        // Make the snapshot stale, as if the test binary were dlopen()ed after
        // we read the maps.
        let proc = unwinder.procs.get_mut(&pid).unwrap();
        let i = proc
            .maps
            .iter()
            .position(|m| m.start <= regs.ip && regs.ip < m.end)
            .unwrap();
        let gone = proc.maps.remove(i);
        proc.fh.remove_module(gone.start);
        proc.last_refresh -= REFRESH_MIN;
        let (frames, outcome) = unwinder.unwind(pid, &regs, &stack);
        assert_eq!(frames, full);
        assert_ne!(outcome, UnwindOutcome::Failed);
        let proc = &unwinder.procs[&pid];
        assert!(proc.is_exec(regs.ip));
        // Rate limit: a miss right after a refresh does not re-read the maps.
        assert!(!unwinder.may_refresh(pid));
    }

    #[test]
    fn unwinder_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<Unwinder>();
    }

    #[test]
    fn forget_releases_modules() {
        let pid = std::process::id();
        let mut unwinder = Unwinder::new();
        let (regs, stack) = unwind_test_level_one(0);
        unwinder.unwind(pid, &regs, &stack);
        let used = |u: &Unwinder| u.files.values().flatten().filter(|f| f.in_use()).count();
        assert!(used(&unwinder) >= 2, "test binary and libc at least");
        unwinder.forget(pid);
        assert!(unwinder.procs.is_empty());
        assert_eq!(used(&unwinder), 0);
    }

    /// Tiny xorshift so the test needs no extra crates.
    fn xorshift(state: &mut u64) -> u64 {
        let mut x = *state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *state = x;
        x
    }

    #[test]
    fn garbage_never_panics() {
        let pid = std::process::id();
        let mut unwinder = Unwinder::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        // Real code addresses of this process, to make garbage look plausible.
        let code = unwinds_own_stack_with_cfi as *const () as usize as u64;
        let libc_code = libc::getpid as *const () as usize as u64;
        for round in 0..3000 {
            let len = (xorshift(&mut seed) % 20_000) as usize;
            let mut stack: Vec<u8> = (0..len).map(|_| xorshift(&mut seed) as u8).collect();
            // Sprinkle plausible return addresses and stack pointers.
            let sp = match round % 4 {
                0 => 0,
                1 => xorshift(&mut seed),
                2 => u64::MAX - (xorshift(&mut seed) % 64),
                _ => 0x7ffd_0000_0000 + (xorshift(&mut seed) & 0xffff_fff8),
            };
            for chunk in stack.chunks_exact_mut(8) {
                let r = xorshift(&mut seed);
                let v = match r % 6 {
                    0 => code + (r >> 40) % 4096,
                    1 => libc_code + (r >> 40) % 4096,
                    2 => sp.wrapping_add((r >> 40) % 20_000),
                    _ => continue,
                };
                chunk.copy_from_slice(&v.to_le_bytes());
            }
            let ip = match round % 5 {
                0 => 0,
                1 => code + xorshift(&mut seed) % 256,
                2 => libc_code + xorshift(&mut seed) % 256,
                _ => xorshift(&mut seed),
            };
            let bp = match round % 3 {
                0 => 0,
                1 => sp.wrapping_add(xorshift(&mut seed) % 20_000),
                _ => xorshift(&mut seed),
            };
            let regs = UserRegs { ip, sp, bp };
            let target = if round % 7 == 0 { 0x7fff_fff0 } else { pid }; // also an unknown pid
            let (frames, _) = unwinder.unwind(target, &regs, &stack);
            assert!(frames.len() <= MAX_FRAMES);
            if ip != 0 {
                assert_eq!(frames.first(), Some(&ip));
            }
        }
        unwinder.forget(pid);
        unwinder.forget(0x7fff_fff0);
    }

    #[test]
    fn frame_cap_is_enforced() {
        // A frame-pointer chain of 1000 frames in an "unknown" process (no
        // maps): the fallback rule follows it and we stop at MAX_FRAMES.
        let sp = 0x7ffd_0000_0000u64;
        let n = 1000usize;
        let mut stack = vec![0u8; (n + 2) * 16];
        for i in 0..n {
            let at = i * 16;
            let next_bp = sp + ((i + 1) * 16) as u64;
            stack[at..at + 8].copy_from_slice(&next_bp.to_le_bytes());
            stack[at + 8..at + 16].copy_from_slice(&(0x40_0000u64 + i as u64 * 4).to_le_bytes());
        }
        let mut unwinder = Unwinder::new();
        let regs = UserRegs {
            ip: 0x40_1000,
            sp,
            bp: sp,
        };
        let (frames, outcome) = unwinder.unwind(0x7fff_fff1, &regs, &stack);
        assert_eq!(frames.len(), MAX_FRAMES);
        assert_eq!(outcome, UnwindOutcome::Truncated);
        // Terminated chain: bp = 0 in the last record ends it cleanly.
        let short = 5usize;
        stack[(short - 1) * 16..(short - 1) * 16 + 8].copy_from_slice(&0u64.to_le_bytes());
        let (frames, outcome) = unwinder.unwind(0x7fff_fff1, &regs, &stack);
        assert_eq!(frames.len(), short + 1);
        assert_eq!(outcome, UnwindOutcome::Complete);
    }

    #[test]
    fn parses_maps_lines() {
        let text = "\
55d0c0a00000-55d0c0a27000 r--p 00000000 08:01 1234 /usr/bin/python3.12
55d0c0a27000-55d0c0d00000 r-xp 00027000 08:01 1234 /usr/bin/python3.12
7f0000000000-7f0000001000 rwxp 00000000 00:00 0 
7f1000000000-7f1000002000 r-xp 00000000 00:00 0                          [vdso]
7f2000000000-7f2000100000 r-xp 00001000 08:01 99 /tmp/with space/lib.so (deleted)
garbage line
";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 4);
        assert_eq!(maps[0].start, 0x55d0c0a27000);
        assert_eq!(maps[0].offset, 0x27000);
        assert!(
            matches!(&maps[0].kind, MapKind::File { path, inode: 1234, .. } if path == "/usr/bin/python3.12")
        );
        assert_eq!(maps[1].kind, MapKind::Anon);
        assert_eq!(maps[2].kind, MapKind::Vdso);
        assert!(
            matches!(&maps[3].kind, MapKind::File { path, .. } if path == "/tmp/with space/lib.so (deleted)")
        );
    }
}
