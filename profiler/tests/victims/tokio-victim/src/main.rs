//! tokio-victim: a tokio program whose tasks block a runtime worker thread on
//! a known schedule, and write down with CLOCK_MONOTONIC exactly when. The
//! root integration tests (profiler/tests/record_native.rs) compare
//! stallprof's stalls with this log: truth comes from the victim.
//!
//! Usage: tokio-victim LOG_PATH [--flavor multi|current]
//!
//!   multi    (default) multi-thread runtime with 2 workers; main() only
//!            schedules, the stalling tasks run on the workers
//!   current  current-thread runtime: everything runs on the main thread,
//!            inside block_on
//!
//! Timeline: ~600 ms of idle (a 10 ms ticker task keeps the workers parking
//! and waking), then for each step of SCHEDULE: tokio::time::sleep ~200 ms (the
//! workers park), spawn one task that blocks its worker in one of
//!
//!   blocking_sleep(ms)   off-CPU: std::thread::sleep (clock_nanosleep)
//!   cpu_spin(ms)         on-CPU: arithmetic, checking Instant between chunks
//!
//! (both #[inline(never)], names the tests look for), and wait for it.
//!
//! Log: JSON lines, one write(2) each:
//!   {"kind":"ready","pid":P,"tid":T,"flavor":"multi"|"current","mono_ns":NOW}
//!   {"kind":"sleep"|"spin","func":"blocking_sleep"|"cpu_spin","ms":MS,"seq":N,
//!    "tid":T,"thread":NAME,"start_ns":..,"end_ns":..,"cpu_ns":..}
//!   {"kind":"done"}
//! start_ns/end_ns are CLOCK_MONOTONIC right before/after the call, on the
//! worker thread T that ran it; cpu_ns is T's CPU time over the call
//! (CLOCK_THREAD_CPUTIME_ID).
//!
//! Built in release without frame pointers, with debug = 1 (see Cargo.toml).

use std::fs::File;
use std::hint::black_box;
use std::io::Write;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const STARTUP_IDLE_MS: u64 = 600;
const GAP_MS: u64 = 200;
const TICK_MS: u64 = 10;

#[derive(Clone, Copy)]
enum Kind {
    Sleep,
    Spin,
}

const SCHEDULE: &[(Kind, u64)] = &[
    (Kind::Sleep, 100),
    (Kind::Spin, 120),
    (Kind::Sleep, 80),
    (Kind::Spin, 150),
    (Kind::Sleep, 130),
    (Kind::Spin, 90),
    (Kind::Sleep, 110),
    (Kind::Spin, 100),
];

static LOG: OnceLock<Mutex<File>> = OnceLock::new();

fn log_line(line: String) {
    let mut f = LOG.get().unwrap().lock().unwrap();
    f.write_all(format!("{line}\n").as_bytes()).expect("writing the log");
}

fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid timespec to write to.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn mono_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn gettid() -> i64 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) }
}

// ---- the two culprits --------------------------------------------------------

/// Blocks the worker off-CPU. The work after the sleep keeps the call from
/// becoming a tail call (this frame must be on the stack during the sleep).
#[inline(never)]
fn blocking_sleep(ms: u64) -> u64 {
    let t = Instant::now();
    std::thread::sleep(Duration::from_millis(ms));
    black_box(t.elapsed().as_nanos() as u64)
}

/// Blocks the worker on-CPU. Most of the time is spent in this function's own
/// arithmetic, not in the clock read (vDSO).
#[inline(never)]
fn cpu_spin(ms: u64) -> u64 {
    let end = Instant::now() + Duration::from_millis(ms);
    let mut acc: u64 = 0;
    loop {
        for _ in 0..20_000 {
            acc = black_box(acc).wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
        if Instant::now() >= end {
            break;
        }
    }
    black_box(acc)
}

// ---- the program -------------------------------------------------------------

async fn stall_task(seq: usize, kind: Kind, ms: u64) {
    let tid = gettid();
    let thread = std::thread::current().name().unwrap_or("").to_string();
    let (start, cpu_start) = (mono_ns(), thread_cpu_ns());
    let (kind_s, func) = match kind {
        Kind::Sleep => {
            black_box(blocking_sleep(black_box(ms)));
            ("sleep", "blocking_sleep")
        }
        Kind::Spin => {
            black_box(cpu_spin(black_box(ms)));
            ("spin", "cpu_spin")
        }
    };
    let (end, cpu_end) = (mono_ns(), thread_cpu_ns());
    log_line(format!(
        "{{\"kind\":\"{kind_s}\",\"func\":\"{func}\",\"ms\":{ms},\"seq\":{seq},\"tid\":{tid},\
         \"thread\":\"{thread}\",\"start_ns\":{start},\"end_ns\":{end},\"cpu_ns\":{}}}",
        cpu_end - cpu_start
    ));
}

async fn run() {
    // A periodic timer, as every service has: the workers wake and park again
    // every 10 ms between the stalls.
    let ticker = tokio::spawn(async {
        let mut iv = tokio::time::interval(Duration::from_millis(TICK_MS));
        loop {
            iv.tick().await;
        }
    });
    // Keep every worker cycling through its park function while the
    // profiler attaches: a worker parked since before the uprobes went in
    // returns without a uretprobe hit, and its first task would be missed.
    let warm_until = std::time::Instant::now() + Duration::from_millis(STARTUP_IDLE_MS);
    while std::time::Instant::now() < warm_until {
        let hs: Vec<_> = (0..4).map(|_| tokio::spawn(tokio::time::sleep(Duration::from_millis(1)))).collect();
        for h in hs {
            let _ = h.await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (seq, &(kind, ms)) in SCHEDULE.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(GAP_MS)).await;
        tokio::spawn(stall_task(seq, kind, ms)).await.expect("stall task panicked");
    }
    tokio::time::sleep(Duration::from_millis(GAP_MS)).await;
    ticker.abort();
    log_line("{\"kind\":\"done\"}".into());
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut log_path = None;
    let mut flavor = "multi".to_string();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--flavor" if i + 1 < args.len() => {
                flavor = args[i + 1].clone();
                i += 1;
            }
            a if !a.starts_with('-') && log_path.is_none() => log_path = Some(a.to_string()),
            _ => {
                eprintln!("usage: tokio-victim LOG_PATH [--flavor multi|current]");
                std::process::exit(2);
            }
        }
        i += 1;
    }
    let Some(log_path) = log_path else {
        eprintln!("tokio-victim: missing LOG_PATH");
        std::process::exit(2);
    };
    let file = File::create(&log_path).unwrap_or_else(|e| panic!("creating {log_path}: {e}"));
    LOG.set(Mutex::new(file)).unwrap();

    let rt = match flavor.as_str() {
        "multi" => tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build(),
        "current" => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        other => {
            eprintln!("tokio-victim: unknown flavor {other:?} (want multi or current)");
            std::process::exit(2);
        }
    }
    .expect("building the tokio runtime");
    log_line(format!(
        "{{\"kind\":\"ready\",\"pid\":{},\"tid\":{},\"flavor\":\"{flavor}\",\"mono_ns\":{}}}",
        std::process::id(),
        gettid(),
        mono_ns()
    ));
    rt.block_on(run());
}
