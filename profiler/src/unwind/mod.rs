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
//! framehop cannot evaluate CFA expressions that read memory (OpenSSL's
//! hand-written assembly, GCC's stack-realigning prologues, signal
//! trampolines) and silently falls back to the frame-pointer rule there. The
//! walk therefore goes frame by frame: frames inside an FDE with such a rule
//! (listed once per file) are unwound with gimli from the copied stack instead
//! (see "Slow path" below); all others by framehop.
//!
//! Modules come from `/proc/PID/maps` (executable mappings, [`crate::os::maps`]). Each ELF is opened
//! through `/proc/PID/map_files/START-END` (works for deleted files and other
//! mount namespaces), falling back to `/proc/PID/root/PATH`, then `PATH`, if
//! that is the mapped file (device and inode as maps shows them), and
//! parsed with `object`; only the unwind sections are read from the file
//! (not the whole file). The `[vdso]` is parsed once from this process's own
//! copy (same kernel, same image).
//!
//! # Replay
//!
//! With [`Unwinder::start_saving`], every executable mapping read and every
//! file's unwind sections parsed are also kept in an [`UnwindBundle`]; an
//! unwinder made by [`Unwinder::replaying`] takes its mappings and files
//! from such a bundle instead of `/proc`, so a saved recording unwinds
//! exactly as it did live, on another machine, after the target is gone.
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

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{Error as FhError, ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder as _};
use gimli::{
    BaseAddresses, CallFrameInstruction, CfaRule, CieOrFde, DebugFrame, EhFrame, EndianSlice,
    Evaluation, EvaluationResult, Expression, LittleEndian, Location, Reader, Register,
    RegisterRule, UnitOffset, UnwindContext, UnwindSection, Value, X86_64,
};
use object::{Object, ObjectSection, ObjectSegment, ReadRef};

use crate::os::{
    lacking::FileId,
    limits, maps,
    memory::{ProcessMemory, ReadMemory},
};
use serde::{Deserialize, Serialize};

/// Most addresses returned for one stack (the first, `ip`, included). An
/// express handler's stacks under its middleware, js-yaml's recursive parser
/// and a scavenge measure up to 150.
pub const MAX_FRAMES: usize = 256;

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

mod elf;
mod exec_maps;
mod slow;
#[cfg(test)]
mod tests;

pub use elf::UnwindBundle;
use elf::*;
use exec_maps::*;
use slow::*;

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
        self.mapping(addr).is_some()
    }

    #[inline]
    fn mapping(&self, addr: u64) -> Option<&ExecMapping> {
        let i = self.maps.partition_point(|m| m.start <= addr);
        let m = &self.maps[i.checked_sub(1)?];
        (addr < m.end).then_some(m)
    }

    /// The module and FDE offset when the frame at `addr` (a lookup address)
    /// must take the slow path.
    #[inline]
    fn slow_fde(&self, addr: u64) -> Option<(&ModuleCfi, usize)> {
        let cfi = self.mapping(addr)?.cfi.as_ref()?;
        Some((cfi, cfi.slow_fde(addr)?))
    }
}

/// Unwinds captured user stacks; one per recording. Caches per process and per
/// module (see the module docs).
pub struct Unwinder {
    cache: CacheX86_64,
    procs: HashMap<u32, Proc>,
    /// `None`: not an x86_64 ELF or unreadable: no unwind info (frame pointers).
    files: HashMap<FileId, Option<Arc<ElfUnwindInfo>>>,
    /// This process's vDSO, parsed on first need (`Some(None)`: unavailable).
    vdso: Option<Option<Arc<ElfUnwindInfo>>>,
    /// gimli's CFI evaluation state for the slow path.
    gimli_ctx: Box<UnwindContext<usize>>,
    source: Source,
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
            gimli_ctx: Box::new(UnwindContext::new()),
            source: Source::Live(None),
        }
    }

    /// An unwinder that takes mappings and files from a recording's bundle.
    pub fn replaying(bundle: UnwindBundle) -> Self {
        Unwinder {
            source: Source::Saved(Box::new(bundle)),
            ..Self::new()
        }
    }

    /// Keep every mapping and file used from now on (see [`UnwindBundle`]).
    pub fn start_saving(&mut self) {
        if let Source::Live(keep) = &mut self.source {
            keep.get_or_insert_default();
        }
    }

    /// What was kept since [`Unwinder::start_saving`].
    pub fn saved(&self) -> Option<&UnwindBundle> {
        match &self.source {
            Source::Live(keep) => keep.as_deref(),
            Source::Saved(_) => None,
        }
    }

    /// Unwind one captured stack of process `pid` (the tgid). `stack` holds the
    /// bytes at `[regs.sp, regs.sp + stack.len())`: pass only the valid bytes
    /// the eBPF side copied, not the whole fixed-size buffer.
    ///
    /// Returns the addresses innermost first — the first is `regs.ip`, the rest
    /// are return addresses (symbolize `addr - 1`) — and how the walk ended.
    pub fn unwind(&mut self, pid: u32, regs: &UserRegs, stack: &[u8]) -> (Vec<u64>, UnwindOutcome) {
        let (frames, _, outcome) = self.unwind_with_fp(pid, regs, stack);
        (frames, outcome)
    }

    /// [`unwind`](Self::unwind), plus each frame's `rbp` as the walk had it
    /// at that frame (same index). In code that keeps frame pointers (V8's
    /// JIT code and builtins) it is the frame's base, from which V8 keeps
    /// the running function at fixed offsets (`symbolize/v8`); in code that
    /// does not, it is whatever the register held.
    pub fn unwind_with_fp(
        &mut self,
        pid: u32,
        regs: &UserRegs,
        stack: &[u8],
    ) -> (Vec<u64>, Vec<u64>, UnwindOutcome) {
        if regs.ip == 0 {
            return (Vec::new(), Vec::new(), UnwindOutcome::Failed);
        }
        if !self.procs.contains_key(&pid) {
            let proc = self.load_proc(pid);
            self.procs.insert(pid, proc);
        }
        let (frames, fps, outcome, missed) = self.walk(pid, regs, stack);
        if !missed || !self.may_refresh(pid) {
            return (frames, fps, outcome);
        }
        if !self.refresh(pid) {
            return (frames, fps, outcome);
        }
        let (frames, fps, outcome, _) = self.walk(pid, regs, stack);
        (frames, fps, outcome)
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
    ///
    /// Frame by frame: framehop unwinds each frame, except frames in an FDE
    /// framehop would get wrong, which [`slow_step`] unwinds from gimli.
    #[allow(clippy::type_complexity)]
    fn walk(
        &mut self,
        pid: u32,
        regs: &UserRegs,
        stack: &[u8],
    ) -> (Vec<u64>, Vec<u64>, UnwindOutcome, bool) {
        let Some(proc) = self.procs.get(&pid) else {
            return (vec![regs.ip], vec![regs.bp], UnwindOutcome::Failed, false);
        };
        let win = Window::new(regs.sp, stack);
        let end = win.end();
        let mut read_stack = |addr: u64| win.read(addr, 8).ok_or(());
        let check_exec = !proc.maps.is_empty();
        let mut frames = Vec::with_capacity(32);
        let mut fps = Vec::with_capacity(32);
        let mut missed = false;
        let mut fh_regs = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
        let mut addr = FrameAddress::from_instruction_pointer(regs.ip);
        let outcome = loop {
            let a = addr.address();
            if check_exec && !proc.is_exec(a) {
                missed = true;
                if frames.is_empty() {
                    // Keep the sampled ip even if we cannot place it.
                    frames.push(a);
                    fps.push(fh_regs.bp());
                }
                break UnwindOutcome::Failed;
            }
            frames.push(a);
            fps.push(fh_regs.bp());
            if frames.len() >= MAX_FRAMES {
                break UnwindOutcome::Truncated;
            }
            let lookup = addr.address_for_lookup();
            let step = match proc.slow_fde(lookup) {
                Some((cfi, fde)) => {
                    let cache = &mut self.cache;
                    // Caller registers look right if their return address is
                    // code and one more step from there gets to code too.
                    let mut plausible = |caller: &UnwindRegsX86_64| {
                        let Some(ret) = FrameAddress::from_return_address(caller.ip())
                            .filter(|_| proc.is_exec(caller.ip()))
                        else {
                            return false;
                        };
                        if proc.slow_fde(ret.address_for_lookup()).is_some() {
                            return true;
                        }
                        let mut r = *caller;
                        let mut read = |a: u64| win.read(a, 8).ok_or(());
                        match proc.fh.unwind_frame(ret, &mut r, cache, &mut read) {
                            Ok(Some(next)) => proc.is_exec(next),
                            Ok(None) => true,
                            Err(FhError::CouldNotReadStack(a)) => a >= end.saturating_sub(8),
                            Err(_) => false,
                        }
                    };
                    slow_step(
                        cfi,
                        fde,
                        lookup,
                        &mut fh_regs,
                        &mut self.gimli_ctx,
                        win,
                        &mut plausible,
                    )
                }
                None => proc
                    .fh
                    .unwind_frame(addr, &mut fh_regs, &mut self.cache, &mut read_stack),
            };
            match step {
                Ok(Some(ra)) => match FrameAddress::from_return_address(ra) {
                    Some(next) => addr = next,
                    None => break UnwindOutcome::Complete,
                },
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
        (frames, fps, outcome, missed)
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
        match self.read_maps(pid) {
            Some(maps) => {
                self.apply_maps(pid, &mut proc, maps);
            }
            None => proc.alive = false,
        }
        // A recording's mappings never change: nothing to refresh.
        if matches!(self.source, Source::Saved(_)) {
            proc.alive = false;
        }
        proc
    }

    /// Re-read the maps of `pid`; true if anything changed.
    fn refresh(&mut self, pid: u32) -> bool {
        let Some(mut proc) = self.procs.remove(&pid) else {
            return false;
        };
        proc.last_refresh = Instant::now();
        let changed = match self.read_maps(pid) {
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
                m.cfi = o.cfi.clone();
            } else {
                changed = true;
                if let Some((module, cfi)) = self.module_for(pid, &m) {
                    proc.fh.add_module(module);
                    m.has_module = true;
                    m.cfi = Some(cfi);
                }
            }
            maps.push(m);
        }
        changed |= maps.len() != old.len();
        proc.maps = maps;
        changed
    }

    fn module_for(&mut self, pid: u32, m: &ExecMapping) -> Option<(Module<Data>, ModuleCfi)> {
        let with_cfi =
            |info: Arc<ElfUnwindInfo>, (module, bias)| (module, ModuleCfi { info, bias });
        match &m.kind {
            MapKind::Anon => None,
            MapKind::Vdso => {
                let info = match &mut self.source {
                    Source::Saved(b) => self
                        .vdso
                        .get_or_insert_with(|| {
                            b.files
                                .get("[vdso]")
                                .and_then(ElfUnwindInfo::restore)
                                .map(Arc::new)
                        })
                        .clone()?,
                    Source::Live(keep) => {
                        let info = self
                            .vdso
                            .get_or_insert_with(|| own_vdso().map(Arc::new))
                            .clone()?;
                        if let Some(b) = keep {
                            b.files
                                .entry("[vdso]".into())
                                .or_insert_with(|| info.save());
                        }
                        info
                    }
                };
                let module = info.module("[vdso]", m.start..m.end, 0)?;
                Some(with_cfi(info, module))
            }
            MapKind::File { path, dev, inode } if matches!(self.source, Source::Saved(_)) => {
                let Source::Saved(b) = &self.source else {
                    return None;
                };
                let info = ElfUnwindInfo::restore(b.files.get(&file_id(*dev, *inode))?)?;
                let info = Arc::new(info);
                let module = info.module(path, m.start..m.end, m.offset)?;
                Some(with_cfi(info, module))
            }
            MapKind::File { path, dev, inode } => {
                let file = open_mapped_file(pid, m, path, *dev, *inode)?;
                let meta = file.metadata().ok()?;
                if meta.size() > limits::ELF_FILE_MAX {
                    limits::hit(limits::Limit::ElfTooLarge);
                    return None;
                }
                let key = FileId::of(&meta);
                if !self.files.contains_key(&key) {
                    // Parsed unwind data of every file, live or cached, has one
                    // budget: a target mapping many large files cannot make
                    // the agent hold more.
                    let total: usize = self.files.values().flatten().map(|f| f.bytes()).sum();
                    if total as u64 >= limits::UNWIND_DATA_MAX {
                        limits::hit(limits::Limit::ElfTooLarge);
                        return None;
                    }
                }
                let info = self
                    .files
                    .entry(key)
                    .or_insert_with(|| {
                        let cache = object::ReadCache::new(file);
                        let t0 = std::time::Instant::now();
                        let parsed = ElfUnwindInfo::parse(&cache).map(Arc::new);
                        log::debug!("unwind: {path} parsed in {:?}", t0.elapsed());
                        if parsed.is_none() {
                            log::debug!("unwind: no usable ELF unwind info in {path}");
                        }
                        parsed
                    })
                    .clone()?;
                if let Source::Live(Some(b)) = &mut self.source {
                    b.files
                        .entry(file_id(*dev, *inode))
                        .or_insert_with(|| info.save());
                }
                let module = info.module(path, m.start..m.end, m.offset)?;
                Some(with_cfi(info, module))
            }
        }
    }

    /// The executable mappings of `pid`, from `/proc` or the recording.
    fn read_maps(&mut self, pid: u32) -> Option<Vec<ExecMapping>> {
        let text = match &mut self.source {
            Source::Saved(b) => b.maps_text(pid)?,
            Source::Live(keep) => {
                let text = maps::read_text(pid).ok()?;
                if let Some(b) = keep {
                    b.add_maps(pid, &text);
                }
                text
            }
        };
        // A zombie's maps read as empty: treat as gone, keep the old snapshot.
        let maps = parse_maps(&text);
        (!maps.is_empty()).then_some(maps)
    }
}

/// Fuzzing ([`crate::fuzzing`]): `data` as an ELF file's bytes, parsed as
/// a mapped file is, its CFI scanned, then frames unwound through it (by
/// framehop, or by the gimli path for the FDEs framehop cannot evaluate)
/// from each load segment with a stack made of the input's first bytes.
pub(crate) fn fuzz_elf_unwind(data: &[u8]) {
    let Some(info) = ElfUnwindInfo::parse(data) else {
        return;
    };
    let info = Arc::new(info);
    let stack = &data[..data.len().min(512)];
    let sp = 0x7fff_0000_0000u64;
    let loads: Vec<(u64, u64)> = info
        .loads
        .iter()
        .take(4)
        .map(|l| (l.offset, l.filesz))
        .collect();
    for (offset, filesz) in loads {
        let base = 0x5555_0000_0000u64 & !0xfff;
        let avma = base..base
            .saturating_add(filesz.min(1 << 30))
            .saturating_add(0x1000);
        let Some((module, bias)) = info.module("fuzz", avma.clone(), offset & !0xfff) else {
            continue;
        };
        let cfi = ModuleCfi {
            info: info.clone(),
            bias,
        };
        let mut fh = UnwinderX86_64::new();
        fh.add_module(module);
        let mut cache = CacheX86_64::new();
        let mut ctx = UnwindContext::new();
        let win = Window::new(sp, stack);
        for pc in [avma.start, avma.start + 0x10, avma.start + 0x400] {
            let mut regs = UnwindRegsX86_64::new(pc, sp, sp + 64);
            let mut addr = FrameAddress::from_instruction_pointer(pc);
            for _ in 0..8 {
                let lookup = addr.address_for_lookup();
                let step = match info.slow_fdes().find(lookup.wrapping_sub(bias)) {
                    Some(fde) => {
                        slow_step(&cfi, fde, lookup, &mut regs, &mut ctx, win, &mut |_| true)
                    }
                    None => {
                        let mut read = |a: u64| win.read(a, 8).ok_or(());
                        fh.unwind_frame(addr, &mut regs, &mut cache, &mut read)
                    }
                };
                match step
                    .ok()
                    .flatten()
                    .and_then(FrameAddress::from_return_address)
                {
                    Some(next) => addr = next,
                    None => break,
                }
            }
        }
    }
}

/// Fuzzing: the executable mappings in `/proc/PID/maps` text.
pub(crate) fn fuzz_maps(text: &str) -> usize {
    parse_maps(text).len()
}

/// Open the file behind a mapping, preferring `map_files` (deleted files,
/// other mount namespaces), then the process's root, then the plain path.
/// Only a regular file is returned (never a FIFO or device the target mapped
/// or planted), and the root is never left through a symlink
/// ([`limits::open_in_root`]).
fn open_mapped_file(
    pid: u32,
    m: &ExecMapping,
    path: &str,
    dev: (u32, u32),
    inode: u64,
) -> Option<File> {
    if let Ok(f) = File::open(maps::map_file(pid, m.start, m.end)) {
        return limits::regular(f).ok();
    }
    // By path only if it is the file mapped (device and inode as maps shows
    // them): a file at the same path in another root, or replaced since it
    // was mapped, has other unwind info.
    let is_mapped = |f: &File| {
        f.metadata()
            .is_ok_and(|meta| maps::same_file(&meta, dev, inode))
    };
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    let found = limits::open_in_root(pid, path)
        .ok()
        .filter(is_mapped)
        .or_else(|| {
            File::open(path)
                .and_then(limits::regular)
                .ok()
                .filter(is_mapped)
        });
    if found.is_none() {
        limits::hit(limits::Limit::NotTheMappedFile);
    }
    found
}

/// Parse this process's vDSO image: every 64-bit process on this kernel maps
/// the same one.
fn own_vdso() -> Option<ElfUnwindInfo> {
    let me = std::process::id();
    let vdso = maps::read(me)
        .ok()?
        .into_iter()
        .find(|m| m.path == "[vdso]")?;
    // Read through /proc/PID/mem: a failed read is an error, not a fault.
    let mem = ProcessMemory::open(me).ok()?;
    let buf = mem
        .read_bytes(vdso.start, (vdso.end - vdso.start) as usize)
        .ok()?;
    ElfUnwindInfo::parse(&buf[..])
}
