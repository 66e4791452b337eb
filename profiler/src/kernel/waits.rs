//! Where a process's event loop parks, as uprobe points: the C library's
//! wait functions (`epoll_wait`, `poll`, `select`, …) in the files it maps.
//!
//! In: a pid. Out: [`WaitPoint`]s — the mapped file (opened as the mapping,
//! `/proc/PID/map_files/…`), its device and inode, the function, the file
//! offset to probe and the syscall it makes — or why there are none.
//!
//! Why a function's first branch and not its entry: a uprobe replaces an
//! instruction with a breakpoint; on return the kernel either emulates the
//! original instruction (jumps, calls, nops) or single-steps a copy of it.
//! On the 2-vCPU bench VM a single-stepped hit costs ~10 µs and an
//! emulated one ~0.7 µs (tracefs uprobe events on `bench/loop_cost.c`:
//! docs/architecture.md, "What runs in the kernel"), and glibc's
//! `epoll_wait` starts with a RIP-relative `cmpb`. So the probe goes on the first
//! instruction that transfers control, if every instruction before it
//! leaves the argument registers the program reads (`rdi`, `rsi`) and the
//! stack pointer alone: there, the arguments are the call's, and `[rsp]` is
//! still the return address the uretprobe takes. A function without such a
//! point is probed at its entry (correct, dearer) and counted.
//!
//! Constraints: every byte read here is the target's (a container ships
//! its own C library): files are read as mapped, bounded, and a decode
//! looks at most [`SCAN_BYTES`] of a function.
use std::{
    collections::HashSet,
    os::unix::fs::{FileExt, MetadataExt},
};

use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, InstructionInfoFactory, OpAccess, OpKind, Register,
};
use profiler_common::sysno;

use crate::os::{
    elf_symbols::ElfSymbols,
    limits,
    maps::{self, Mapping},
};

/// The C library wait functions, and the syscall each makes.
pub const WAIT_FUNCTIONS: [(&str, u32); 7] = [
    ("epoll_wait", sysno::EPOLL_WAIT),
    ("epoll_pwait", sysno::EPOLL_PWAIT),
    ("epoll_pwait2", sysno::EPOLL_PWAIT2),
    ("poll", sysno::POLL),
    ("ppoll", sysno::PPOLL),
    ("select", sysno::SELECT),
    ("pselect", sysno::PSELECT6),
];

/// How far into a function the probe point is looked for.
pub const SCAN_BYTES: usize = 64;

/// A uprobe on one wait function of one mapped file.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WaitPoint {
    /// The file as the target maps it (`/proc/PID/map_files/START-END`).
    pub path: String,
    /// (device, inode) of that file: one file, whoever maps it.
    pub file: (u64, u64),
    pub function: &'static str,
    /// The syscall the function makes (the attach cookie).
    pub nr: u32,
    /// File offset of the probed instruction.
    pub offset: u64,
    /// Bytes past the function's start.
    pub delta: u64,
    /// Probed at an instruction the kernel emulates (else its entry,
    /// single-stepped).
    pub emulated: bool,
}

/// Executable file mappings of `pid`: (map_files path, device, inode, path
/// as the process sees it), one per file.
pub fn mapped_files(pid: u32) -> Vec<(String, (u64, u64), String)> {
    match maps::read(pid) {
        Ok(maps) => files_in(pid, &maps),
        Err(_) => Vec::new(),
    }
}

/// Does `pid` map a C library (a file that may define the wait
/// functions)?
pub fn maps_c_library(pid: u32) -> bool {
    mapped_files(pid)
        .iter()
        .any(|(_, _, seen_as)| is_c_library(seen_as))
}

/// An executable mapping of a file: its path as the process sees it
/// (without the `" (deleted)"` of a file removed since).
fn exec_file(m: &Mapping) -> Option<&str> {
    (m.is_exec() && m.is_file()).then(|| m.path_undeleted())
}

/// [`mapped_files`] of mappings already read.
fn files_in(pid: u32, maps: &[Mapping]) -> Vec<(String, (u64, u64), String)> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for m in maps {
        let Some(path) = exec_file(m) else {
            continue;
        };
        let via = m.map_file(pid);
        let Ok(meta) = std::fs::metadata(&via) else {
            continue;
        };
        let file = (meta.dev(), meta.ino());
        if seen.insert(file) {
            out.push((via.to_string_lossy().into_owned(), file, path.to_string()));
        }
    }
    out
}

/// How long [`wait_points`] waits for a process caught mid-exec to map
/// its new image (microseconds to a few ms for the kernel).
const EXEC_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The wait functions `pid` can call, with their probe points, or none;
/// and whether more may come: a dynamic loader is mapped, so the C library
/// may not be yet (a command that has just exec'd), or the process is
/// still mid-exec. A process that maps its image and no loader (a static
/// binary without symbols, a runtime making raw syscalls) never will, nor
/// one whose mappings cannot be read (the caller says why). A process caught
/// mid-exec maps no file yet: the kernel switches to the new address space
/// and names the new executable in `/proc/PID/exe` before it maps the
/// image and its loader. A launched command's first look often lands there
/// (it was seen to fall back to the host-wide tracepoints), so that is
/// waited out, up to [`EXEC_WAIT`].
pub fn wait_points(pid: u32) -> WaitPoints {
    let deadline = std::time::Instant::now() + EXEC_WAIT;
    let maps = loop {
        let Ok(maps) = maps::read(pid) else {
            return WaitPoints::default(); // gone
        };
        if maps.iter().any(|m| exec_file(m).is_some()) || std::time::Instant::now() >= deadline {
            break maps;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    let files = files_in(pid, &maps);
    let mut loader = files.iter().any(|(_, _, seen_as)| is_loader(seen_as));
    let mut found = WaitPoints::default();
    for (i, (path, file, seen_as)) in files.iter().enumerate() {
        // The first mapping is the executable: a static one carries its own
        // C library. A dynamic one seen before its loader is mapped (the
        // kernel maps the image first, then the loader: a launched
        // command's first look can land between them, and fell back to
        // the host-wide tracepoints) waits for them.
        if i == 0 && !loader && asks_for_loader(path) {
            loader = true;
            continue;
        }
        if is_c_library(seen_as) || (i == 0 && !loader) {
            match points_in(path, *file) {
                Ok(points) => found.points.extend(points),
                Err(why) => found.unreadable.push(why),
            }
        }
    }
    let mid_exec = !maps.iter().any(|m| exec_file(m).is_some());
    found.more_may_come = mid_exec || loader;
    found
}

/// Does the executable at `path` name a program interpreter? (Unreadable:
/// no; it is then searched as a static one, and says why it cannot be.)
fn asks_for_loader(path: &str) -> bool {
    limits::open_elf(std::path::Path::new(path))
        .ok()
        .and_then(|f| ElfSymbols::open(&f).ok().map(|e| e.asks_for_loader()))
        .unwrap_or(false)
}

/// What [`wait_points`] found in a process.
#[derive(Default)]
pub struct WaitPoints {
    pub points: Vec<WaitPoint>,
    /// More may come (see [`wait_points`]).
    pub more_may_come: bool,
    /// Files that should have held wait functions and could not be read,
    /// each with why.
    pub unreadable: Vec<String>,
}

/// The dynamic loader (glibc's `ld-linux-*.so.2`, musl's `ld-musl-*.so.1`).
fn is_loader(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or("");
    name.starts_with("ld-") && name.contains(".so")
}

/// A file that is the C library (glibc's `libc.so.6`, musl's
/// `ld-musl-*.so.1` / `libc.musl-*.so.1`, a `libc.so`): only those are
/// read for wait functions. Reading every mapped file's symbols would mean
/// a runtime's own (Node's `node` carries ~100k) on each new process.
pub fn is_c_library(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or("");
    (name.starts_with("libc.") || name.starts_with("libc-") || name.starts_with("ld-musl"))
        && name.contains(".so")
}

/// The wait functions defined in one mapped file, or why it could not be
/// read for them (the file is named in the reason).
pub fn points_in(path: &str, file: (u64, u64)) -> Result<Vec<WaitPoint>, String> {
    let f = limits::open_elf(std::path::Path::new(path))
        .map_err(|e| format!("{path} could not be opened: {e}"))?;
    let elf = ElfSymbols::open(&f)
        .map_err(|e| format!("{path} is not an ELF file stallprof can read: {e}"))?;
    if elf.machine() != object::elf::EM_X86_64 {
        return Err(format!(
            "{path} is built for ELF machine {}; stallprof probes x86-64 code only",
            elf.machine()
        ));
    }
    if limits::symbol_tables_too_large(elf.tables_size()) {
        return Err(format!(
            "{path}: its symbol tables are over stallprof's size cap"
        ));
    }
    let names: Vec<&str> = WAIT_FUNCTIONS.iter().map(|(n, _)| *n).collect();
    let is_wait = |name: &str| names.contains(&name);
    let found = elf
        .find(&names, &is_wait)
        .map_err(|e| format!("{path}: {e}"))?;
    let mut out = Vec::new();
    for sym in found {
        let Some(&(function, nr)) = WAIT_FUNCTIONS.iter().find(|(n, _)| *n == sym.name) else {
            continue;
        };
        // A function's code (an IFUNC symbol is its resolver's, and is
        // not found).
        if sym.kind != object::elf::STT_FUNC {
            continue;
        }
        let Some(start) = elf.file_offset(&sym, 1) else {
            continue;
        };
        let mut code = [0u8; SCAN_BYTES];
        let Ok(n) = f.read_at(&mut code, start) else {
            continue;
        };
        let point = emulated_point(&code[..n], sym.value);
        let delta = point.unwrap_or(0);
        out.push(WaitPoint {
            path: path.to_string(),
            file,
            function,
            nr,
            offset: start + delta,
            delta,
            emulated: point.is_some(),
        });
    }
    Ok(out)
}

/// Registers a probe point must find as the call left them: the arguments
/// the program reads, and the stack pointer (the uretprobe takes the
/// return address at `[rsp]`).
const KEPT: [Register; 3] = [Register::RDI, Register::RSI, Register::RSP];

/// Bytes from the function's start (at `ip`) to its first direct jump,
/// conditional jump or call — instructions the kernel emulates — when
/// nothing before it writes a [`KEPT`] register or leaves the straight
/// line; None otherwise.
pub fn emulated_point(code: &[u8], ip: u64) -> Option<u64> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    while decoder.can_decode() {
        let insn = decoder.decode();
        if insn.is_invalid() {
            return None;
        }
        // A register push first (a function saving callee-saved registers):
        // the kernel emulates it, and nothing has moved yet.
        if insn.ip() == ip && insn.code() == Code::Push_r64 {
            return Some(0);
        }
        match insn.flow_control() {
            FlowControl::ConditionalBranch
            | FlowControl::UnconditionalBranch
            | FlowControl::Call
                if insn.op0_kind() == OpKind::NearBranch64 =>
            {
                return Some(insn.ip() - ip);
            }
            FlowControl::Next => {}
            _ => return None, // syscall, ret, an indirect jump: no point before it
        }
        if insn.code() == Code::Endbr64 {
            continue;
        }
        let writes_kept = info.info(&insn).used_registers().iter().any(|r| {
            !matches!(
                r.access(),
                OpAccess::Read | OpAccess::CondRead | OpAccess::None
            ) && KEPT.contains(&r.register().full_register())
        });
        if writes_kept {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_file_lines_of_maps() {
        let line = |l| {
            let m = maps::parse_line(l)?;
            let range = format!("{:x}-{:x}", m.start, m.end);
            exec_file(&m).map(|p| (range, p.to_string()))
        };
        assert_eq!(
            line("7f00-7f10 r-xp 00001000 08:01 1234   /usr/lib/libc.so.6"),
            Some(("7f00-7f10".into(), "/usr/lib/libc.so.6".into()))
        );
        assert_eq!(
            line("7f00-7f10 rw-p 00000000 08:01 1234   /usr/lib/libc.so.6"),
            None
        );
        assert_eq!(line("7ffd-7ffe rw-p 00000000 00:00 0      [stack]"), None);
        assert_eq!(line("7ffd-7ffe r-xp 00000000 00:00 0      [vdso]"), None);
        assert_eq!(line("garbage"), None);
    }

    /// glibc 2.36's `epoll_wait` (Debian 12): a RIP-relative `cmpb`, a
    /// register move, then the branch that picks the cancellable path.
    const GLIBC_EPOLL_WAIT: &[u8] = &[
        0x80, 0x3d, 0xf1, 0x26, 0x0d, 0x00, 0x00, // cmpb $0,__libc_single_threaded(%rip)
        0x41, 0x89, 0xca, // mov %ecx,%r10d
        0x74, 0x14, // je +0x14
        0xb8, 0xe8, 0x00, 0x00, 0x00, // mov $0xe8,%eax
        0x0f, 0x05, // syscall
    ];

    #[test]
    fn glibc_epoll_wait_is_probed_at_its_first_branch() {
        assert_eq!(emulated_point(GLIBC_EPOLL_WAIT, 0x108ee0), Some(0xa));
    }

    #[test]
    fn a_write_to_an_argument_or_the_stack_before_the_branch_means_entry() {
        // mov $0, %edi ; je
        assert_eq!(
            emulated_point(&[0xbf, 0, 0, 0, 0, 0x74, 0x02], 0x1000),
            None
        );
        // sub $0x28,%rsp ; je
        assert_eq!(
            emulated_point(&[0x48, 0x83, 0xec, 0x28, 0x74, 0x02], 0x1000),
            None
        );
        // mov %edi,%eax ; push %rbx ; call
        assert_eq!(
            emulated_point(&[0x89, 0xf8, 0x53, 0xe8, 0, 0, 0, 0], 0x1000),
            None
        );
    }

    /// glibc's `ppoll` and `select` save registers first: `push` at the
    /// entry is emulated.
    #[test]
    fn a_push_at_the_entry_is_the_point() {
        assert_eq!(
            emulated_point(&[0x41, 0x54, 0x45, 0x31, 0xe4], 0x1000),
            Some(0)
        );
        assert_eq!(emulated_point(&[0x55, 0x48, 0x89, 0xe5], 0x1000), Some(0));
    }

    #[test]
    fn a_syscall_before_any_branch_means_entry() {
        // mov $7,%eax ; syscall ; ret
        assert_eq!(
            emulated_point(&[0xb8, 7, 0, 0, 0, 0x0f, 0x05, 0xc3], 0x1000),
            None
        );
    }

    #[test]
    fn a_branch_first_is_the_entry_and_endbr64_is_skipped() {
        assert_eq!(emulated_point(&[0xeb, 0x00], 0x1000), Some(0));
        // endbr64 ; xor %r8d,%r8d ; jmp rel32 (musl's epoll_wait shape)
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x45, 0x31, 0xc0, 0xe9, 0, 0, 0, 0];
        assert_eq!(emulated_point(&code, 0x1000), Some(7));
    }

    #[test]
    fn a_dynamic_executable_asks_for_its_loader() {
        let me = std::env::current_exe().unwrap();
        assert!(asks_for_loader(me.to_str().unwrap()), "{}", me.display());
        // The loader itself is the one that does not (nor does a static
        // binary, or a file that cannot be read).
        let maps = maps::parse(&std::fs::read_to_string("/proc/self/maps").unwrap());
        let loader = maps
            .iter()
            .filter_map(exec_file)
            .find(|p| is_loader(p))
            .expect("a test binary maps the dynamic loader");
        assert!(!asks_for_loader(loader), "{loader}");
        assert!(!asks_for_loader("/nonexistent/stallprof-test"));
    }

    #[test]
    fn a_c_library_that_cannot_be_read_says_why() {
        let dir = crate::os::scratch_dir("waits");
        let path = dir.join("libc.so.6");
        std::fs::write(&path, b"not an ELF file").unwrap();
        let why = points_in(path.to_str().unwrap(), (0, 0)).unwrap_err();
        let gone = dir.join("gone.so");
        let why_gone = points_in(gone.to_str().unwrap(), (0, 0)).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            why.contains("libc.so.6") && why.contains("not an ELF file"),
            "{why}"
        );
        assert!(
            why_gone.contains("gone.so") && why_gone.contains("could not be opened"),
            "{why_gone}"
        );
    }

    #[test]
    fn garbage_is_no_point_not_a_panic() {
        assert_eq!(emulated_point(&[], 0), None);
        assert_eq!(emulated_point(&[0xff; 64], 0), None);
        assert_eq!(emulated_point(&[0x0f], 0), None);
    }

    /// This process's own C library: every wait function it defines is
    /// found, `epoll_wait` among them at an emulated point.
    #[test]
    fn this_process_c_library_has_wait_points() {
        assert!(is_c_library("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(is_c_library("/lib/ld-musl-x86_64.so.1"));
        assert!(!is_c_library("/usr/lib/libcrypto.so.3"));
        let WaitPoints {
            points,
            more_may_come: loader,
            unreadable,
        } = wait_points(std::process::id());
        assert!(unreadable.is_empty(), "{unreadable:?}");
        assert!(loader, "a test binary maps the dynamic loader");
        let names: Vec<_> = points.iter().map(|p| p.function).collect();
        for f in ["epoll_wait", "poll", "select"] {
            assert!(names.contains(&f), "{f} not found in {names:?}");
        }
        let ew = points.iter().find(|p| p.function == "epoll_wait").unwrap();
        assert!(ew.emulated, "{ew:?}");
    }
}
