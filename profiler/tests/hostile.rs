//! Issue 13, item 2: reads the target cannot weaponize. Root integration
//! tests against tests/victims/hostile_loop.c, a loop that stalls in code
//! it put in an anonymous executable page named by its own
//! `/tmp/perf-PID.map`.
//!
//! A hostile target grows that perf map to 3 GB (sparse: a few valid lines,
//! then zeros without a newline) and maps a sparse 4 GB file executable.
//! `record --duration 3s` must finish on time, its peak RSS (`VmHWM`) must
//! stay within 100 MiB of the same recording of the same victim without
//! them, and the JIT name from the map's valid first line must still be
//! found.
//!
//! A Python target whose thread-state list loops back on itself
//! (tests/victims/py_cyclic_threads.py points its own `PyThreadState.next`
//! at itself): `record` must still end on time, count the cycle in `drops`
//! and read the Python frames of its stalls. (The walker's unit test:
//! `symbolize::python::tests::thread_list_cycles_stop_and_are_counted`.)
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn build_hostile_loop(dir: &Path) -> PathBuf {
    let out = dir.join("hostile_loop");
    let src = victims_dir().join("hostile_loop.c");
    let result = Command::new("cc")
        .args(["-O1", "-g", "-o"])
        .arg(&out)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running cc to build {}: {e} (is a C compiler installed?)",
                src.display()
            )
        });
    assert!(
        result.status.success(),
        "cc failed to build {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

struct Run {
    peak_kib: u64,
    elapsed: Duration,
    out: RunOutput,
    recording: serde_json::Value,
}

/// `record --pid PID --duration 3s --threshold T -q -o OUT`.
fn record_3s(pid: u32, threshold: &str, out_dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = ["record", "--pid"].map(String::from).into();
    args.push(pid.to_string());
    args.extend(["--duration", "3s", "--threshold", threshold, "-q", "-o"].map(String::from));
    args.push(out_dir.to_string_lossy().into_owned());
    args
}

/// Starts the victim, lets `hostile` grow what the target controls, then
/// runs `record --pid --duration 3s`, sampling its `VmHWM` until it exits.
fn record_victim(scratch: &Scratch, name: &str, map_exec: Option<&Path>, hostile: bool) -> Run {
    let exe = build_hostile_loop(&scratch.path);
    let ready = scratch.join(&format!("{name}.ready"));
    let mut cmd = Command::new(&exe);
    cmd.arg(&ready);
    if let Some(p) = map_exec {
        cmd.arg("--map-exec").arg(p);
    }
    let mut victim = Victim::spawn(&mut cmd);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        victim.assert_running();
        assert!(Instant::now() < deadline, "the victim never became ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    let perf_map = PathBuf::from(format!("/tmp/perf-{}.map", victim.pid()));
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _cleanup = Remove(perf_map.clone());
    if hostile {
        // More valid lines, then a 3 GB sparse tail of zeros (no newline).
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&perf_map)
            .unwrap();
        for i in 0..1000u64 {
            writeln!(f, "{:x} 10 filler_{i}", 0x1000_0000 + i * 0x10).unwrap();
        }
        f.set_len(3 << 30).unwrap();
    }
    let out_dir = scratch.join(&format!("{name}-out"));
    let args = record_3s(victim.pid(), "30ms", &out_dir);
    let start = Instant::now();
    let mut prof = Profiler::spawn(&args);
    let pid = prof.pid();
    let mut peak_kib = 0;
    let out = loop {
        if let Some(kib) = vm_hwm_kib(pid) {
            peak_kib = peak_kib.max(kib);
        }
        if let Some(out) = prof.try_finished() {
            break out;
        }
        if start.elapsed() > Duration::from_secs(30) {
            prof.signal(libc::SIGKILL);
            panic!("record --duration 3s still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    victim.assert_running();
    assert!(out.status.success(), "record failed:\n{}", out.describe());
    let recording = read_stalls_json(&out_dir.join("stalls.json"));
    Run {
        peak_kib,
        elapsed,
        out,
        recording,
    }
}

fn jit_named(rec: &serde_json::Value) -> bool {
    rec.to_string().contains("jit_spin_loop")
}

#[test]
fn hostile_perf_map_and_exec_mapping_cost_bounded_memory_and_time() {
    if !require_root_and_bpf("hostile_perf_map_and_exec_mapping_cost_bounded_memory_and_time") {
        return;
    }
    let _g = serial();
    let scratch = Scratch::new("hostile");

    let base = record_victim(&scratch, "baseline", None, false);
    // A 4 GB sparse file the target maps PROT_READ|PROT_EXEC.
    let huge = scratch.join("huge.bin");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(4 << 30)
        .unwrap();
    let hostile = record_victim(&scratch, "hostile", Some(&huge), true);
    let _ = std::fs::remove_file(&huge);

    let mib = |k: u64| k as f64 / 1024.0;
    eprintln!(
        "peak RSS of record: baseline {:.1} MiB in {:.2} s, hostile {:.1} MiB in {:.2} s",
        mib(base.peak_kib),
        base.elapsed.as_secs_f64(),
        mib(hostile.peak_kib),
        hostile.elapsed.as_secs_f64()
    );
    eprintln!("hostile drops: {}", hostile.recording["drops"]);
    let mut c = Checks::new(format!(
        "hostile recording:\n{}\nbaseline:\n{}",
        hostile.out.describe(),
        base.out.describe()
    ));
    c.check(base.peak_kib > 0 && hostile.peak_kib > 0, || {
        "VmHWM of record was never read".into()
    });
    c.check(hostile.peak_kib < base.peak_kib + 100 * 1024, || {
        format!(
            "the hostile target cost {:.1} MiB more peak RSS (baseline {:.1} MiB, hostile {:.1} MiB); the bound is 100 MiB",
            mib(hostile.peak_kib.saturating_sub(base.peak_kib)),
            mib(base.peak_kib),
            mib(hostile.peak_kib)
        )
    });
    for (what, run) in [("baseline", &base), ("hostile", &hostile)] {
        c.check(run.elapsed < Duration::from_secs(10), || {
            format!(
                "the {what} recording took {:?} (--duration 3s)",
                run.elapsed
            )
        });
    }
    c.check(jit_named(&base.recording), || {
        "the baseline recording does not name jit_spin_loop from the perf map".into()
    });
    c.check(jit_named(&hostile.recording), || {
        "the perf map's first line is no longer used once the file is 3 GB".into()
    });
    let drops = &hostile.recording["drops"];
    c.check(
        drops["limit_perf_map_line_too_long"].as_u64().unwrap_or(0) >= 1,
        || format!("the 3 GB line of zeros is not counted in drops: {drops}"),
    );
    c.finish();
}

#[test]
fn cyclic_thread_state_list_still_ends_on_time() {
    let test = "cyclic_thread_state_list_still_ends_on_time";
    if !require_root_and_bpf(test) {
        return;
    }
    let _g = serial();
    let python = require_python(3, 12);
    let scratch = Scratch::new("cyclic");
    let log = scratch.join("victim.jsonl");
    let mut cmd = Command::new(&python);
    cmd.arg(victims_dir().join("py_cyclic_threads.py"))
        .arg(&log);
    let mut victim = Victim::spawn(&mut cmd);
    wait_for_log_kind(&log, "ready", Duration::from_secs(10));
    let out_dir = scratch.join("out");
    let start = Instant::now();
    let out = run_stallprof(
        &record_3s(victim.pid(), "50ms", &out_dir),
        Duration::from_secs(30),
    );
    let elapsed = start.elapsed();
    victim.assert_running();
    // Let the victim restore its list and exit by itself.
    unsafe { libc::kill(victim.pid() as i32, libc::SIGTERM) };
    let mut c = Checks::new(out.describe());
    c.check(out.status.success(), || "record failed".into());
    c.check(elapsed < Duration::from_secs(12), || {
        format!("record --duration 3s took {elapsed:?} against a cyclic thread-state list")
    });
    let rec = read_stalls_json(&out_dir.join("stalls.json"));
    let cycles = rec["drops"]["limit_python_list_cycle"]
        .as_u64()
        .unwrap_or(0);
    c.check(cycles >= 1, || {
        format!("the cycle was not counted: drops {}", rec["drops"])
    });
    let recording = load_recording(&out_dir);
    let truth = python_truth(&read_log(&log));
    let cpu_calls = truth.iter().filter(|t| t.func == "burn_cpu").count();
    let named = recording
        .stalls
        .iter()
        .filter(|s| s.stacks.iter().any(|st| st.has_frame("burn_cpu")))
        .count();
    eprintln!(
        "cyclic list: record took {:.2} s, {cycles} cycles counted, {} stalls, {named} with burn_cpu (victim: {cpu_calls} calls)",
        elapsed.as_secs_f64(),
        recording.stalls.len()
    );
    c.check(named >= 3, || {
        format!("Python frames were lost: {named} stalls name burn_cpu; the victim made {cpu_calls} calls")
    });
    c.finish();
}
