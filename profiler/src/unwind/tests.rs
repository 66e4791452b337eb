//! The unwinder's tests: its own stack, C victims built with and without
//! frame pointers, CFA expressions, garbage input.

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
    let dev = (libc::major(meta.dev()), libc::minor(meta.dev()));
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
    assert!(open_mapped_file(pid, &m, path, dev, meta.ino()).is_some());
    let refused = || {
        limits::counts()
            .into_iter()
            .find(|(n, _)| *n == "limit_not_the_mapped_file")
            .unwrap()
            .1
    };
    let before = refused();
    assert!(open_mapped_file(pid, &m, path, dev, meta.ino() + 1).is_none());
    assert!(open_mapped_file(pid, &m, path, (0xff, 0xff), meta.ino()).is_none());
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
