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
//! Modules come from `/proc/PID/maps` (executable mappings). Each ELF is opened
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

use crate::os::{lacking::FileId, limits};
use serde::{Deserialize, Serialize};

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
    /// FDEs framehop cannot evaluate, found on first need (see [`SlowFdes`]).
    slow: OnceLock<SlowFdes>,
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
            if c.uncompressed_size > limits::ELF_SECTION_MAX {
                limits::hit(limits::Limit::ElfTooLarge);
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
            slow: OnceLock::new(),
        })
    }

    /// The CFI section framehop uses for this file (`.eh_frame`, else
    /// `.debug_frame`), with its base addresses (as framehop sets them).
    fn cfi(&self) -> Option<(CfiSection<'_>, BaseAddresses)> {
        let start = |r: &Option<Range<u64>>| r.as_ref().map_or(0, |r| r.start);
        let bases = BaseAddresses::default()
            .set_eh_frame(self.eh_frame.as_ref().map_or(0, |e| e.0.start))
            .set_eh_frame_hdr(self.eh_frame_hdr.as_ref().map_or(0, |e| e.0.start))
            .set_text(start(&self.text_svma))
            .set_got(start(&self.got_svma));
        let section = match (&self.eh_frame, &self.debug_frame) {
            (Some((_, d)), _) => {
                let mut s = EhFrame::new(d, LittleEndian);
                s.set_address_size(8);
                CfiSection::Eh(s)
            }
            (None, Some(d)) => {
                let mut s = DebugFrame::new(d, LittleEndian);
                s.set_address_size(8);
                CfiSection::Debug(s)
            }
            (None, None) => return None,
        };
        Some((section, bases))
    }

    fn slow_fdes(&self) -> &SlowFdes {
        self.slow.get_or_init(|| match self.cfi() {
            Some((CfiSection::Eh(s), bases)) => SlowFdes::scan(&s, &bases),
            Some((CfiSection::Debug(s), bases)) => SlowFdes::scan(&s, &bases),
            None => SlowFdes::default(),
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

    /// The framehop module for a mapping of this file, and its load bias.
    fn module(
        &self,
        name: &str,
        avma: Range<u64>,
        file_offset: u64,
    ) -> Option<(Module<Data>, u64)> {
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
        Some((Module::new(name.to_string(), avma, base_avma, info), bias))
    }
}

/// One file's unwind sections as a recording keeps them (see
/// [`UnwindBundle`]); section bytes as hex.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct SavedElf {
    /// (offset, vaddr, filesz, exec) of each `PT_LOAD`.
    loads: Vec<(u64, u64, u64, bool)>,
    base_svma: u64,
    text_svma: Option<(u64, u64)>,
    got_svma: Option<(u64, u64)>,
    eh_frame: Option<(u64, u64, String)>,
    eh_frame_hdr: Option<(u64, u64, String)>,
    debug_frame: Option<String>,
}

fn hex(d: &[u8]) -> String {
    let mut s = String::with_capacity(d.len() * 2);
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn unhex(s: &str) -> Option<Data> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    let v: Option<Vec<u8>> = b
        .chunks_exact(2)
        .map(|c| u8::from_str_radix(std::str::from_utf8(c).ok()?, 16).ok())
        .collect();
    v.map(Arc::from)
}

impl ElfUnwindInfo {
    fn save(&self) -> SavedElf {
        let range = |r: &Option<Range<u64>>| r.as_ref().map(|r| (r.start, r.end));
        let sect =
            |e: &Option<(Range<u64>, Data)>| e.as_ref().map(|(r, d)| (r.start, r.end, hex(d)));
        SavedElf {
            loads: self
                .loads
                .iter()
                .map(|l| (l.offset, l.vaddr, l.filesz, l.exec))
                .collect(),
            base_svma: self.base_svma,
            text_svma: range(&self.text_svma),
            got_svma: range(&self.got_svma),
            eh_frame: sect(&self.eh_frame),
            eh_frame_hdr: sect(&self.eh_frame_hdr),
            debug_frame: self.debug_frame.as_ref().map(|d| hex(d)),
        }
    }

    fn restore(s: &SavedElf) -> Option<Self> {
        let sect = |e: &Option<(u64, u64, String)>| -> Option<Option<(Range<u64>, Data)>> {
            match e {
                None => Some(None),
                Some((a, b, h)) => Some(Some((*a..*b, unhex(h)?))),
            }
        };
        Some(ElfUnwindInfo {
            loads: s
                .loads
                .iter()
                .map(|&(offset, vaddr, filesz, exec)| LoadSegment {
                    offset,
                    vaddr,
                    filesz,
                    exec,
                })
                .collect(),
            base_svma: s.base_svma,
            text_svma: s.text_svma.map(|(a, b)| a..b),
            got_svma: s.got_svma.map(|(a, b)| a..b),
            eh_frame: sect(&s.eh_frame)?,
            eh_frame_hdr: sect(&s.eh_frame_hdr)?,
            debug_frame: match &s.debug_frame {
                None => None,
                Some(h) => Some(unhex(h)?),
            },
            slow: OnceLock::new(),
        })
    }
}

/// What unwinding a recording again needs: each process's executable
/// mappings (lines of `/proc/PID/maps`, every one seen while recording)
/// and each mapped file's unwind sections, by the `dev inode` the maps name
/// (`[vdso]` for the vDSO).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct UnwindBundle {
    maps: BTreeMap<u32, BTreeMap<u64, String>>,
    files: BTreeMap<String, SavedElf>,
}

impl UnwindBundle {
    fn add_maps(&mut self, pid: u32, text: &str) {
        let lines = self.maps.entry(pid).or_default();
        for line in text.lines() {
            let start = line
                .split_once('-')
                .and_then(|(s, _)| u64::from_str_radix(s, 16).ok());
            if let Some(start) = start
                && line
                    .split_whitespace()
                    .nth(1)
                    .is_some_and(|p| p.as_bytes().get(2) == Some(&b'x'))
            {
                lines.insert(start, line.to_string());
            }
        }
    }

    fn maps_text(&self, pid: u32) -> Option<String> {
        let lines = self.maps.get(&pid)?;
        Some(lines.values().map(|l| format!("{l}\n")).collect())
    }
}

fn file_id(dev: &str, inode: u64) -> String {
    format!("{dev} {inode}")
}

/// Where modules come from.
enum Source {
    /// `/proc` and the files it names; `Some`: also kept for a recording.
    Live(Option<Box<UnwindBundle>>),
    /// A recording's bundle.
    Saved(Box<UnwindBundle>),
}

// ---- Slow path: frames framehop cannot unwind, evaluated with gimli --------
//
// framehop turns each CFI row into a cached rule (CFA = rsp/rbp + offset,
// rbp and return address at CFA + offset). Rows it cannot turn into such a
// rule it evaluates once per frame, but without memory reads and knowing only
// rsp, rbp and rip; when that fails it silently uses the frame-pointer rule,
// which in a function whose rbp is an ordinary register produces garbage (and
// caches that rule). Hand-written assembly (OpenSSL's SHA, AES, bignum code:
// `DW_CFA_def_cfa_expression (DW_OP_breg7 (rsp): 152; DW_OP_deref;
// DW_OP_plus_uconst: 8)` after realigning the stack), GCC's stack-realigning
// prologues and glibc's signal trampoline have such rows.
//
// So every FDE with a rule framehop would get wrong (CFA from an expression or
// from a register other than rsp/rbp, rbp or the return address from an
// expression) is listed per file, and frames in those FDEs are unwound here
// instead: gimli computes the row, expressions are evaluated with rsp, rbp and
// rip (other registers: give up) and memory reads served from the copied
// stack window. Other frames cost one binary search in an (almost always
// empty) list.

type Slice<'a> = EndianSlice<'a, LittleEndian>;

/// Error for a frame the slow path cannot unwind (ends the walk as Failed).
const SLOW_FAILED: FhError = FhError::DidNotAdvance;

/// Most operations evaluated in one DWARF expression.
const MAX_EXPR_STEPS: u32 = 256;

/// Most CFI entries scanned in one file for [`SlowFdes`].
const MAX_SCANNED_ENTRIES: usize = 1 << 22;

/// Bytes above `sp` searched by [`saved_sp_scan`].
const SAVED_SP_SCAN: u64 = 8192;

/// One module's CFI section, as gimli reads it.
enum CfiSection<'a> {
    Eh(EhFrame<Slice<'a>>),
    Debug(DebugFrame<Slice<'a>>),
}

/// The FDEs of one file that framehop cannot evaluate.
#[derive(Default)]
struct SlowFdes {
    /// `(start SVMA, end SVMA, FDE offset in the section)`, sorted by start.
    fdes: Vec<(u64, u64, usize)>,
}

impl SlowFdes {
    fn scan<'d, S: UnwindSection<Slice<'d>>>(section: &S, bases: &BaseAddresses) -> Self {
        let mut fdes = Vec::new();
        let mut cie_slow: HashMap<usize, bool> = HashMap::new();
        let mut last_cie: Option<gimli::CommonInformationEntry<Slice<'d>>> = None;
        let mut entries = section.entries(bases);
        for _ in 0..MAX_SCANNED_ENTRIES {
            let partial = match entries.next() {
                Ok(Some(CieOrFde::Fde(p))) => p,
                Ok(Some(CieOrFde::Cie(_))) => continue,
                Ok(None) | Err(_) => break,
            };
            let fde = partial.parse(|section: &S, bases, offset| {
                if let Some(c) = &last_cie
                    && c.offset() == <S::Offset as gimli::UnwindOffset<usize>>::into(offset)
                {
                    return Ok(c.clone());
                }
                let c = section.cie_from_offset(bases, offset)?;
                last_cie = Some(c.clone());
                Ok(c)
            });
            let Ok(fde) = fde else { continue };
            let cie = fde.cie();
            let slow = *cie_slow
                .entry(cie.offset())
                .or_insert_with(|| needs_slow_path(cie.instructions(section, bases)))
                || needs_slow_path(fde.instructions(section, bases));
            if slow && fde.len() > 0 {
                let start = fde.initial_address();
                fdes.push((start, start.saturating_add(fde.len()), fde.offset()));
            }
        }
        fdes.sort_unstable_by_key(|f| f.0);
        SlowFdes { fdes }
    }

    /// The FDE offset covering `svma`, if that FDE needs the slow path.
    #[inline]
    fn find(&self, svma: u64) -> Option<usize> {
        if self.fdes.is_empty() {
            return None;
        }
        let i = self.fdes.partition_point(|f| f.0 <= svma).checked_sub(1)?;
        let (_, end, offset) = self.fdes[i];
        (svma < end).then_some(offset)
    }
}

/// Whether CFI instructions set a rule framehop cannot evaluate.
fn needs_slow_path(mut insns: gimli::CallFrameInstructionIter<'_, Slice<'_>>) -> bool {
    let plain_cfa = |r: Register| r == X86_64::RSP || r == X86_64::RBP;
    let used = |r: Register| r == X86_64::RBP || r == X86_64::RA;
    while let Ok(Some(insn)) = insns.next() {
        match insn {
            CallFrameInstruction::DefCfaExpression { .. } => return true,
            CallFrameInstruction::DefCfa { register, .. }
            | CallFrameInstruction::DefCfaSf { register, .. }
            | CallFrameInstruction::DefCfaRegister { register }
                if !plain_cfa(register) =>
            {
                return true;
            }
            CallFrameInstruction::Expression { register, .. }
            | CallFrameInstruction::ValExpression { register, .. }
                if used(register) =>
            {
                return true;
            }
            _ => {}
        }
    }
    false
}

/// A process mapping's file (for its CFI) and load bias (AVMA - SVMA).
#[derive(Clone)]
struct ModuleCfi {
    info: Arc<ElfUnwindInfo>,
    bias: u64,
}

impl PartialEq for ModuleCfi {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.info, &other.info) && self.bias == other.bias
    }
}

impl Eq for ModuleCfi {}

impl std::fmt::Debug for ModuleCfi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModuleCfi {{ bias: {:#x} }}", self.bias)
    }
}

impl ModuleCfi {
    /// The slow-path FDE covering `addr`, if any.
    #[inline]
    fn slow_fde(&self, addr: u64) -> Option<usize> {
        self.info.slow_fdes().find(addr.wrapping_sub(self.bias))
    }
}

/// The copied stack: the bytes at `[start, start + bytes.len())`.
#[derive(Clone, Copy)]
struct Window<'a> {
    start: u64,
    bytes: &'a [u8],
}

impl<'a> Window<'a> {
    fn new(sp: u64, stack: &'a [u8]) -> Self {
        // Clamp so that start + len cannot overflow.
        let len = (stack.len() as u64).min(u64::MAX - sp) as usize;
        Window {
            start: sp,
            bytes: &stack[..len],
        }
    }

    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    /// Little-endian value of `size` (1..=8) bytes at `addr`.
    #[inline]
    fn read(&self, addr: u64, size: usize) -> Option<u64> {
        if size == 0 || size > 8 {
            return None;
        }
        let off = usize::try_from(addr.checked_sub(self.start)?).ok()?;
        let src = self.bytes.get(off..off.checked_add(size)?)?;
        let mut word = [0u8; 8];
        word[..size].copy_from_slice(src);
        Some(u64::from_le_bytes(word))
    }
}

/// Value of a register in a frame, where known.
fn reg_value(regs: &UnwindRegsX86_64, r: Register) -> Option<u64> {
    match r {
        X86_64::RSP => Some(regs.sp()),
        X86_64::RBP => Some(regs.bp()),
        X86_64::RA => Some(regs.ip()),
        _ => None,
    }
}

enum ExprError {
    /// Needed the stack at this address, outside the window.
    Read(u64),
    /// An unknown register, an unsupported operation, a malformed expression.
    Unsupported,
}

impl ExprError {
    fn into_fh(self) -> FhError {
        match self {
            ExprError::Read(a) => FhError::CouldNotReadStack(a),
            ExprError::Unsupported => SLOW_FAILED,
        }
    }
}

/// Evaluate a CFI expression (`initial`: the CFA, pushed first for register
/// rules) to the address or value it computes.
fn eval_expr(
    expr: Expression<Slice<'_>>,
    encoding: gimli::Encoding,
    regs: &UnwindRegsX86_64,
    win: Window<'_>,
    initial: Option<u64>,
) -> Result<u64, ExprError> {
    let mut eval = Evaluation::new(expr.0, encoding);
    eval.set_max_iterations(MAX_EXPR_STEPS);
    if let Some(v) = initial {
        eval.set_initial_value(v);
    }
    let generic = UnitOffset(0);
    let mut step = eval.evaluate();
    loop {
        step = match step.map_err(|_| ExprError::Unsupported)? {
            EvaluationResult::Complete => break,
            EvaluationResult::RequiresRegister {
                register,
                base_type,
            } if base_type == generic => {
                let v = reg_value(regs, register).ok_or(ExprError::Unsupported)?;
                eval.resume_with_register(Value::Generic(v))
            }
            EvaluationResult::RequiresMemory {
                address,
                size,
                space: None,
                base_type,
            } if base_type == generic => {
                let v = win
                    .read(address, size as usize)
                    .ok_or(ExprError::Read(address))?;
                eval.resume_with_memory(Value::Generic(v))
            }
            _ => return Err(ExprError::Unsupported),
        };
    }
    match eval.as_result() {
        [
            gimli::Piece {
                location: Location::Address { address },
                ..
            },
        ] => Ok(*address),
        [
            gimli::Piece {
                location: Location::Value { value },
                ..
            },
        ] => value.to_u64(u64::MAX).map_err(|_| ExprError::Unsupported),
        _ => Err(ExprError::Unsupported),
    }
}

/// The CFA of a frame whose rule `DW_OP_breg7 (rsp): N; DW_OP_deref;
/// DW_OP_plus_uconst: M` with N < 0 reads the saved entry stack pointer from
/// the red zone below `sp`, which the window does not hold. OpenSSL's AVX2 SHA
/// loops do this over most of their body (`push 0x78(%rsp); lea 8(%rsp),
/// %rsp` moves a copy of it down with the stack), but the original copy (and
/// earlier ones) stay above `sp`. So take the first 8-byte slot above `sp`
/// holding a value V that points above the slot into the window such that
/// `accept(V + M)` (the caller's frame that CFA gives looks right); then
/// CFA = V + M. Stale copies from earlier calls are why `accept` checks.
fn saved_sp_scan(
    expr: Expression<Slice<'_>>,
    win: Window<'_>,
    accept: &mut dyn FnMut(u64) -> bool,
) -> Option<u64> {
    let mut r = expr.0;
    let op = |r: &mut Slice<'_>, want: gimli::DwOp| r.read_u8().ok() == Some(want.0);
    if !op(&mut r, gimli::DW_OP_breg7) || r.read_sleb128().ok()? >= 0 {
        return None;
    }
    if !op(&mut r, gimli::DW_OP_deref) || !op(&mut r, gimli::DW_OP_plus_uconst) {
        return None;
    }
    let m = r.read_uleb128().ok()?;
    if !r.is_empty() {
        return None;
    }
    let scan_end = win.end().min(win.start.saturating_add(SAVED_SP_SCAN));
    let mut slot = win.start;
    while slot.checked_add(8).is_some_and(|e| e <= scan_end) {
        let v = win.read(slot, 8)?;
        if v > slot
            && v % 8 == 0
            && let Some(cfa) = v.checked_add(m).filter(|&c| accept(c))
        {
            return Some(cfa);
        }
        slot += 8;
    }
    None
}

/// Unwind the frame at `lookup` (the ip for the first frame, the return
/// address minus 1 after) from its CFI row in the slow-path FDE at
/// `fde_offset`, setting `regs` to the caller's. `Ok(None)`: the outermost
/// frame (no return address). `plausible` tells whether caller registers look
/// right (used only where the CFA has to be guessed, see [`saved_sp_scan`]).
fn slow_step(
    cfi: &ModuleCfi,
    fde_offset: usize,
    lookup: u64,
    regs: &mut UnwindRegsX86_64,
    ctx: &mut UnwindContext<usize>,
    win: Window<'_>,
    plausible: &mut dyn FnMut(&UnwindRegsX86_64) -> bool,
) -> Result<Option<u64>, FhError> {
    let (section, bases) = cfi.info.cfi().ok_or(SLOW_FAILED)?;
    let svma = lookup.wrapping_sub(cfi.bias);
    match section {
        CfiSection::Eh(s) => slow_step_in(&s, &bases, fde_offset, svma, regs, ctx, win, plausible),
        CfiSection::Debug(s) => {
            slow_step_in(&s, &bases, fde_offset, svma, regs, ctx, win, plausible)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn slow_step_in<'d, S: UnwindSection<Slice<'d>>>(
    section: &S,
    bases: &BaseAddresses,
    fde_offset: usize,
    svma: u64,
    regs: &mut UnwindRegsX86_64,
    ctx: &mut UnwindContext<usize>,
    win: Window<'_>,
    plausible: &mut dyn FnMut(&UnwindRegsX86_64) -> bool,
) -> Result<Option<u64>, FhError> {
    let fde = section
        .fde_from_offset(bases, S::Offset::from(fde_offset), S::cie_from_offset)
        .map_err(|_| SLOW_FAILED)?;
    let encoding = fde.cie().encoding();
    let row = fde
        .unwind_info_for_address(section, bases, ctx, svma)
        .map_err(|_| SLOW_FAILED)?;
    let cfa_rule = row.cfa().clone();
    let bp_rule = row.register(X86_64::RBP);
    let ra_rule = row.register(X86_64::RA);
    let cur = *regs;

    // Caller registers for a CFA; `Ok(None)`: no return address (outermost).
    let caller = |cfa: u64| -> Result<Option<UnwindRegsX86_64>, FhError> {
        // The return address sits at or above CFA - 8 >= sp.
        if cfa <= cur.sp() {
            return Err(SLOW_FAILED);
        }
        let ra = match &ra_rule {
            None | Some(RegisterRule::Undefined) => return Ok(None),
            Some(rule) => {
                eval_rule(section, rule.clone(), cfa, encoding, &cur, win)?.ok_or(SLOW_FAILED)?
            }
        };
        // As framehop: rbp we cannot recover keeps its value.
        let bp = match &bp_rule {
            Some(rule) => eval_rule(section, rule.clone(), cfa, encoding, &cur, win)
                .ok()
                .flatten()
                .unwrap_or(cur.bp()),
            None => cur.bp(),
        };
        Ok(Some(UnwindRegsX86_64::new(ra, cfa, bp)))
    };

    let cfa = match cfa_rule {
        CfaRule::RegisterAndOffset { register, offset } => reg_value(&cur, register)
            .and_then(|v| v.checked_add_signed(offset))
            .ok_or(SLOW_FAILED)?,
        CfaRule::Expression(e) => {
            let expr = e.get(section).map_err(|_| SLOW_FAILED)?;
            match eval_expr(expr, encoding, &cur, win, None) {
                Ok(cfa) => cfa,
                Err(ExprError::Read(a)) if a < win.start => {
                    let mut accept = |cfa: u64| matches!(caller(cfa), Ok(Some(c)) if c.ip() != 0 && plausible(&c));
                    saved_sp_scan(expr, win, &mut accept).ok_or(FhError::CouldNotReadStack(a))?
                }
                Err(e) => return Err(e.into_fh()),
            }
        }
    };
    let Some(next) = caller(cfa)? else {
        return Ok(None);
    };
    *regs = next;
    Ok(Some(next.ip()))
}

/// A register's value in the caller under `rule`; `Ok(None)`: unchanged or
/// undefined.
fn eval_rule<'d, S: UnwindSection<Slice<'d>>>(
    section: &S,
    rule: RegisterRule<usize>,
    cfa: u64,
    encoding: gimli::Encoding,
    regs: &UnwindRegsX86_64,
    win: Window<'_>,
) -> Result<Option<u64>, FhError> {
    let read = |a: u64| win.read(a, 8).ok_or(FhError::CouldNotReadStack(a));
    let expr = |e: &gimli::UnwindExpression<usize>| -> Result<u64, FhError> {
        let e = e.get(section).map_err(|_| SLOW_FAILED)?;
        eval_expr(e, encoding, regs, win, Some(cfa)).map_err(ExprError::into_fh)
    };
    let at = |o: i64| cfa.checked_add_signed(o).ok_or(SLOW_FAILED);
    Ok(Some(match rule {
        RegisterRule::Undefined | RegisterRule::SameValue => return Ok(None),
        RegisterRule::Offset(o) => read(at(o)?)?,
        RegisterRule::ValOffset(o) => at(o)?,
        RegisterRule::Register(r) => reg_value(regs, r).ok_or(SLOW_FAILED)?,
        RegisterRule::Expression(e) => read(expr(&e)?)?,
        RegisterRule::ValExpression(e) => expr(&e)?,
        _ => return Err(SLOW_FAILED),
    }))
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
    /// Its file's CFI, for frames framehop cannot unwind.
    cfi: Option<ModuleCfi>,
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
            cfi: None,
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
                let info = ElfUnwindInfo::restore(b.files.get(&file_id(dev, *inode))?)?;
                let info = Arc::new(info);
                let module = info.module(path, m.start..m.end, m.offset)?;
                Some(with_cfi(info, module))
            }
            MapKind::File { path, dev, inode } => {
                let file = open_mapped_file(pid, m, path, dev, *inode)?;
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
                        let parsed = ElfUnwindInfo::parse(&cache).map(Arc::new);
                        if parsed.is_none() {
                            log::debug!("unwind: no usable ELF unwind info in {path}");
                        }
                        parsed
                    })
                    .clone()?;
                if let Source::Live(Some(b)) = &mut self.source {
                    b.files
                        .entry(file_id(dev, *inode))
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
                let text = limits::read_proc(&format!("/proc/{pid}/maps")).ok()?;
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
fn open_mapped_file(pid: u32, m: &ExecMapping, path: &str, dev: &str, inode: u64) -> Option<File> {
    if let Ok(f) = File::open(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end)) {
        return limits::regular(f).ok();
    }
    // By path only if it is the file mapped (device and inode as maps shows
    // them): a file at the same path in another root, or replaced since it
    // was mapped, has other unwind info.
    let is_mapped = |f: &File| {
        f.metadata().is_ok_and(|meta| {
            let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
            meta.ino() == inode && format!("{major:02x}:{minor:02x}") == dev
        })
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
            // No silent skip: CI has a C compiler, and this test must run there.
            other => {
                panic!("building the C victim ({variant}) with cc failed: {other:?}; install gcc")
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

    // Hand-written frames whose CFA is a DWARF expression, as in OpenSSL's
    // assembly: the function realigns its stack, saves the entry rsp at
    // [rsp+40] and says `DW_CFA_def_cfa_expression (DW_OP_breg7 (rsp): 40;
    // DW_OP_deref; DW_OP_plus_uconst: 8)`. rbp is an ordinary register pointing
    // at junk, so a frame-pointer guess goes wrong.
    //
    // `stallprof_test_cfa_expr(cb, arg)` calls `cb(arg)` from there.
    // `stallprof_test_cfa_redzone(out, len)` then moves rsp down 128 bytes and
    // keeps a copy of the entry rsp in the red zone (`DW_OP_breg7 (rsp): -8`),
    // like OpenSSL's AVX2 SHA loops, and captures itself: `out` gets rip, rsp,
    // rbp and `len` stack bytes from rsp.
    std::arch::global_asm!(
        ".text",
        ".p2align 4",
        ".globl stallprof_test_cfa_expr",
        ".type stallprof_test_cfa_expr,@function",
        "stallprof_test_cfa_expr:",
        ".cfi_startproc",
        "mov rax, rsp",
        ".cfi_def_cfa_register rax",
        "push rbx",
        ".cfi_offset rbx, -16",
        "push rbp",
        ".cfi_offset rbp, -24",
        "sub rsp, 96",
        "and rsp, -64",
        "mov [rsp+40], rax",
        ".cfi_escape 0x0f, 0x05, 0x77, 0x28, 0x06, 0x23, 0x08",
        "mov rbx, rdi",
        "mov rdi, rsi",
        "mov rbp, rsp",
        "mov qword ptr [rsp], 0x1234567",
        "mov qword ptr [rsp+8], 0x7654321",
        "call rbx",
        "mov rax, [rsp+40]",
        "mov rbp, [rax-16]",
        "mov rbx, [rax-8]",
        "mov rsp, rax",
        ".cfi_def_cfa rsp, 8",
        ".cfi_restore rbx",
        ".cfi_restore rbp",
        "ret",
        ".cfi_endproc",
        ".size stallprof_test_cfa_expr, .-stallprof_test_cfa_expr",
        "",
        ".p2align 4",
        ".globl stallprof_test_cfa_redzone",
        ".type stallprof_test_cfa_redzone,@function",
        "stallprof_test_cfa_redzone:",
        ".cfi_startproc",
        "mov rax, rsp",
        ".cfi_def_cfa_register rax",
        "push rbx",
        ".cfi_offset rbx, -16",
        "push rbp",
        ".cfi_offset rbp, -24",
        "sub rsp, 96",
        "and rsp, -64",
        "mov [rsp+40], rax",
        ".cfi_escape 0x0f, 0x05, 0x77, 0x28, 0x06, 0x23, 0x08",
        "mov rbp, rsp",
        "mov qword ptr [rsp], 0x1234567",
        "mov qword ptr [rsp+8], 0x7654321",
        "mov qword ptr [rsp+16], 0",
        "mov qword ptr [rsp+24], 0",
        "mov qword ptr [rsp+32], 0",
        "lea rsp, [rsp-128]",
        // CFA = [rsp+168] + 8
        ".cfi_escape 0x0f, 0x06, 0x77, 0xa8, 0x01, 0x06, 0x23, 0x08",
        "mov ecx, 16",
        "2:",
        "mov qword ptr [rsp+rcx*8-8], 0",
        "dec ecx",
        "jnz 2b",
        "mov [rsp-8], rax",
        // CFA = [rsp-8] + 8
        ".cfi_escape 0x0f, 0x05, 0x77, 0x78, 0x06, 0x23, 0x08",
        "lea rax, [rip]",
        "mov [rdi], rax",
        "mov [rdi+8], rsp",
        "mov [rdi+16], rbp",
        "mov rcx, rsi",
        "lea rdi, [rdi+24]",
        "mov rsi, rsp",
        "rep movsb",
        "mov rax, [rsp+168]",
        "mov rbp, [rax-16]",
        "mov rbx, [rax-8]",
        "mov rsp, rax",
        ".cfi_def_cfa rsp, 8",
        ".cfi_restore rbx",
        ".cfi_restore rbp",
        "ret",
        ".cfi_endproc",
        ".size stallprof_test_cfa_redzone, .-stallprof_test_cfa_redzone",
    );

    unsafe extern "C" {
        fn stallprof_test_cfa_expr(cb: extern "C" fn(*mut u8), arg: *mut u8);
        fn stallprof_test_cfa_redzone(out: *mut u8, len: u64);
    }

    type Captured = Option<(UserRegs, Vec<u8>)>;

    #[inline(never)]
    extern "C" fn cfa_expr_callback(out: *mut u8) {
        let regs = capture_regs!();
        let stack = read_own_memory(regs.sp, 16 * 1024);
        // SAFETY: `out` is the `Captured` that cfa_expr_level_two passed.
        unsafe { *(out as *mut Captured) = Some((regs, stack)) };
        black_box(out);
    }

    #[inline(never)]
    fn cfa_expr_level_two() -> (UserRegs, Vec<u8>) {
        let mut out: Captured = None;
        // SAFETY: the asm function calls the callback with `arg` and returns.
        unsafe { stallprof_test_cfa_expr(cfa_expr_callback, &mut out as *mut Captured as *mut u8) };
        black_box(out).unwrap()
    }

    #[inline(never)]
    fn cfa_expr_level_one() -> (UserRegs, Vec<u8>) {
        let r = cfa_expr_level_two();
        black_box(&r);
        r
    }

    #[inline(never)]
    fn cfa_redzone_level_two() -> (UserRegs, Vec<u8>) {
        let here = capture_regs!();
        // The asm copies from its own rsp, below ours, with plain loads: stay
        // within this thread's stack (/proc/self/mem would also read a guard
        // page above it).
        let top = {
            // SAFETY: plain libc calls on this thread's attributes.
            unsafe {
                let mut attr: libc::pthread_attr_t = std::mem::zeroed();
                assert_eq!(libc::pthread_getattr_np(libc::pthread_self(), &mut attr), 0);
                let (mut addr, mut size) = (std::ptr::null_mut(), 0usize);
                assert_eq!(libc::pthread_attr_getstack(&attr, &mut addr, &mut size), 0);
                libc::pthread_attr_destroy(&mut attr);
                addr as u64 + size as u64
            }
        };
        let len = top.saturating_sub(here.sp).min(16 * 1024);
        let mut out = vec![0u8; 24 + len as usize];
        // SAFETY: `out` holds 24 + len bytes; the asm reads `len` stack bytes
        // from its rsp, which is below ours, so they are mapped.
        unsafe { stallprof_test_cfa_redzone(out.as_mut_ptr(), len) };
        let word = |i: usize| u64::from_le_bytes(out[i * 8..i * 8 + 8].try_into().unwrap());
        let regs = UserRegs {
            ip: word(0),
            sp: word(1),
            bp: word(2),
        };
        let stack = out[24..].to_vec();
        black_box(&stack);
        (regs, stack)
    }

    #[inline(never)]
    fn cfa_redzone_level_one() -> (UserRegs, Vec<u8>) {
        let r = cfa_redzone_level_two();
        black_box(&r);
        r
    }

    #[test]
    fn unwinds_through_cfa_expression() {
        let (regs, stack) = cfa_expr_level_one();
        let pid = std::process::id();
        let mut unwinder = Unwinder::new();
        let (frames, outcome) = unwinder.unwind(pid, &regs, &stack);
        let names = symbolize_pid(pid, &frames);
        let order = find_in_order(
            &names,
            &[
                "cfa_expr_callback",
                "stallprof_test_cfa_expr",
                "cfa_expr_level_two",
                "cfa_expr_level_one",
                // The test function itself may be inlined into the harness
                // in release builds; the harness's call_once is always there.
                "call_once",
            ],
        );
        // Consecutive from the callback to level_one, then the harness
        // (after the test function's own frame, unless that was inlined).
        assert_eq!(
            order.as_ref().map(|o| o[..4].to_vec()),
            Some(vec![0, 1, 2, 3]),
            "outcome {outcome:?}, frames {names:#?}"
        );
        assert_ne!(outcome, UnwindOutcome::Failed, "{names:#?}");
        // The asm frame took the slow path; the callback's did not.
        let proc = &unwinder.procs[&pid];
        assert!(proc.slow_fde(frames[1] - 1).is_some());
        assert!(proc.slow_fde(frames[0]).is_none());
        assert!(proc.slow_fde(frames[2] - 1).is_none());
    }

    #[test]
    fn unwinds_through_red_zone_cfa_expression() {
        let (regs, stack) = cfa_redzone_level_one();
        assert!(stack.len() >= 1024, "copied {} stack bytes", stack.len());
        let pid = std::process::id();
        let mut unwinder = Unwinder::new();
        let (frames, outcome) = unwinder.unwind(pid, &regs, &stack);
        let names = symbolize_pid(pid, &frames);
        let order = find_in_order(
            &names,
            &[
                "stallprof_test_cfa_redzone",
                "cfa_redzone_level_two",
                "cfa_redzone_level_one",
                // The test function itself may be inlined into the harness
                // in release builds; the harness's call_once is always there.
                "call_once",
            ],
        );
        assert_eq!(
            order.as_ref().map(|o| o[..3].to_vec()),
            Some(vec![0, 1, 2]),
            "outcome {outcome:?}, frames {names:#?}"
        );
        assert_ne!(outcome, UnwindOutcome::Failed, "{names:#?}");
    }

    #[test]
    fn evaluates_cfi_expressions() {
        let encoding = gimli::Encoding {
            address_size: 8,
            format: gimli::Format::Dwarf32,
            version: 1,
        };
        let sp = 0x7ffd_0000_1000u64;
        let mut stack = vec![0u8; 256];
        stack[152..160].copy_from_slice(&(sp + 0x200).to_le_bytes());
        let win = Window::new(sp, &stack);
        let regs = UnwindRegsX86_64::new(0x40_1236, sp, 0);
        let eval = |bytes: &[u8]| {
            let e = Expression(EndianSlice::new(bytes, LittleEndian));
            match eval_expr(e, encoding, &regs, win, None) {
                Ok(v) => Ok(v),
                Err(ExprError::Read(a)) => Err(Some(a)),
                Err(ExprError::Unsupported) => Err(None),
            }
        };
        // OpenSSL: DW_OP_breg7 (rsp): 152; DW_OP_deref; DW_OP_plus_uconst: 8.
        assert_eq!(eval(&[0x77, 0x98, 0x01, 0x06, 0x23, 0x08]), Ok(sp + 0x208));
        // Outside the window, below and above.
        assert_eq!(eval(&[0x77, 0x78, 0x06]), Err(Some(sp - 8)));
        assert_eq!(eval(&[0x77, 0x80, 0x02, 0x06]), Err(Some(sp + 256)));
        // PLT: rsp + 8 + ((rip & 15) >= 11) << 3, rip = ...6 -> +8.
        let plt = [
            0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22,
        ];
        assert_eq!(eval(&plt), Ok(sp + 8));
        // An unknown register (rax) and a loop that never ends.
        assert_eq!(eval(&[0x70, 0x00]), Err(None));
        assert_eq!(eval(&[0x2f, 0xfd, 0xff]), Err(None));
        // Garbage.
        assert_eq!(eval(&[0x06]), Err(None));
        assert_eq!(eval(&[0xff, 0xff]), Err(None));
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
            // .eh_frame, which this module does not use: the last step
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
        // Stacks through a frame that takes the gimli slow path.
        for (what, (regs, stack)) in [
            ("CFA expression", cfa_expr_level_one()),
            ("red-zone CFA expression", cfa_redzone_level_one()),
        ] {
            let (frames, _) = unwinder.unwind(pid, &regs, &stack);
            let n = 20_000;
            let t = Instant::now();
            for _ in 0..n {
                black_box(unwinder.unwind(pid, black_box(&regs), black_box(&stack)));
            }
            eprintln!(
                "{what}: {:?} per unwind of {} frames",
                t.elapsed() / n,
                frames.len()
            );
        }
    }

    /// Cost of finding the slow-path FDEs of one file, once per file (run with
    /// `--ignored --nocapture`; `STALLPROF_BENCH_ELF` picks the file, default
    /// this test binary).
    #[test]
    #[ignore]
    fn bench_slow_fde_scan() {
        let path = std::env::var("STALLPROF_BENCH_ELF").unwrap_or_else(|_| "/proc/self/exe".into());
        let data = std::fs::read(&path).unwrap();
        let t = Instant::now();
        let info = ElfUnwindInfo::parse(&data[..]).unwrap();
        let parsed = t.elapsed();
        let t = Instant::now();
        let n = info.slow_fdes().fdes.len();
        eprintln!(
            "{path}: parse {parsed:?}, slow-FDE scan {:?}: {n} slow FDEs",
            t.elapsed()
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

    /// Without `map_files` (a range that is not mapped here), a file is
    /// opened by its path only if it is the one maps names (device, inode).
    #[test]
    fn a_path_is_opened_only_if_it_is_the_mapped_file() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let meta = std::fs::metadata(&exe).unwrap();
        let dev = format!(
            "{:02x}:{:02x}",
            libc::major(meta.dev()),
            libc::minor(meta.dev())
        );
        let m = ExecMapping {
            start: 0x1000,
            end: 0x2000,
            offset: 0,
            kind: MapKind::Anon,
            has_module: false,
            cfi: None,
        };
        let path = exe.to_str().unwrap();
        let pid = std::process::id();
        assert!(open_mapped_file(pid, &m, path, &dev, meta.ino()).is_some());
        let refused = || {
            limits::counts()
                .into_iter()
                .find(|(n, _)| *n == "limit_not_the_mapped_file")
                .unwrap()
                .1
        };
        let before = refused();
        assert!(open_mapped_file(pid, &m, path, &dev, meta.ino() + 1).is_none());
        assert!(open_mapped_file(pid, &m, path, "ff:ff", meta.ino()).is_none());
        assert!(refused() >= before + 2);
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
