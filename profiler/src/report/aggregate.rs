//! Aggregation: symbolized stalls -> weighted stacks and a summary.
//!
//! In: [`Recording`]. Out: folded stacks (one weight per distinct stack, in
//! microseconds of stall time) and [`Summary`] (duration percentiles, time
//! split, top culprits).
use std::collections::{BTreeMap, HashMap};

use crate::report::model::{Frame, FrameKind, PartKind, Recording, StackPart, Stall};

/// Stall time per distinct folded stack, in nanoseconds, sorted by stack.
pub fn folded_ns(stalls: &[Stall]) -> BTreeMap<String, u64> {
    let mut acc: BTreeMap<String, u64> = BTreeMap::new();
    for s in stalls {
        for p in &s.stacks {
            let key = p
                .frames
                .iter()
                .map(Frame::label)
                .collect::<Vec<_>>()
                .join(";");
            let key = if key.is_empty() {
                "[unknown]".to_string()
            } else {
                key
            };
            *acc.entry(key).or_default() += p.weight_ns;
        }
    }
    acc
}

/// Folded lines `a;b;c weight_us`, weights rounded to whole microseconds
/// (stacks under 1 µs are kept as 1 so nothing vanishes).
pub fn folded_lines(stalls: &[Stall]) -> Vec<String> {
    folded_ns(stalls)
        .into_iter()
        .map(|(k, ns)| format!("{k} {}", ((ns + 500) / 1000).max(1)))
        .collect()
}

/// The C runtime and the vDSO: their frames are the means of blocking
/// (`read`, `nanosleep`), never the culprit.
fn is_system_lib(f: &Frame) -> bool {
    let Some(m) = f.module.as_deref() else {
        return f.name.starts_with('[');
    };
    m.starts_with('[')
        || [
            "libc.so",
            "libc-",
            "ld-linux",
            "libpthread",
            "libm.so",
            "librt",
            "libdl",
            "libgcc_s",
            "libstdc++",
        ]
        .iter()
        .any(|p| m.starts_with(p))
}

/// Rust's standard library and async runtimes: like libc, the means, not
/// the culprit (`Timespec::now` under a spin loop, tokio's poll machinery).
fn is_runtime_frame(f: &Frame) -> bool {
    let n = f.name.trim_start_matches('<');
    [
        "std::",
        "core::",
        "alloc::",
        "tokio::",
        "futures_",
        "futures::",
        "__rust",
    ]
    .iter()
    .any(|p| n.starts_with(p))
}

/// A JavaScript function named by a perf map (`--perf-basic-prof`):
/// `JS:*parseBig /app/app.js:11:19` (`LazyCompile:`, `Function:` in older V8).
fn is_perf_map_js(f: &Frame) -> bool {
    f.kind == FrameKind::Native
        && f.module.as_deref() == Some("[jit]")
        && ["JS:", "LazyCompile:", "Function:"]
            .iter()
            .any(|p| f.name.starts_with(p))
}

/// Node's own JavaScript (`node:internal/...`, `node:fs`): like libc, the
/// means, not the culprit.
fn is_node_internal_js(f: &Frame) -> bool {
    match f.kind {
        FrameKind::Js => f
            .file
            .as_deref()
            .is_none_or(|file| file.starts_with("node:")),
        _ => f.name.contains(" node:"),
    }
}

/// The frame to blame for a part: the innermost Python frame if any, else
/// the innermost JavaScript frame of the user's code (Node: read from
/// memory or named by a perf map; Node's own `node:` modules and builtins
/// without a script are skipped, then taken if there is nothing else),
/// else the innermost native frame outside the C runtime and the Rust
/// standard library / async runtime, preferring one with source information.
pub fn culprit(p: &StackPart) -> Option<&Frame> {
    let user = || {
        p.frames
            .iter()
            .rev()
            .filter(|f| f.kind == FrameKind::Native && !is_system_lib(f) && !is_runtime_frame(f))
    };
    let js = || {
        p.frames
            .iter()
            .rev()
            .filter(|f| f.kind == FrameKind::Js || is_perf_map_js(f))
    };
    p.frames
        .iter()
        .rev()
        .find(|f| f.kind == FrameKind::Python)
        .or_else(|| js().find(|f| !is_node_internal_js(f)))
        .or_else(|| js().next())
        .or_else(|| user().find(|f| f.file.is_some()))
        .or_else(|| user().next())
        .or_else(|| p.frames.iter().rev().find(|f| f.kind == FrameKind::Native))
}

#[derive(Debug, Clone, PartialEq)]
pub struct Culprit {
    /// `name (file:line)` of the culprit frame, plus how it spent the time.
    pub label: String,
    pub ns: u64,
    pub share: f64,
    /// The asyncio tasks its stalls ran, heaviest first
    /// ([`crate::report::model::Task::describe`]).
    pub tasks: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub stalls: usize,
    pub total_ns: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    pub on_cpu_ns: u64,
    pub off_cpu_ns: u64,
    pub runqueue_ns: u64,
    pub throttled_ns: u64,
    pub culprits: Vec<Culprit>,
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The summary's culprit text for a part: its culprit frame and how it
/// spent the time, e.g. `load_tokenizer (tok.py:41) — off-CPU in read`.
pub fn culprit_label(p: &StackPart) -> String {
    let gc = p
        .frames
        .iter()
        .any(|f| f.kind == FrameKind::Marker && f.name == "[gc]");
    let what = match p.kind {
        PartKind::OnCpu if gc => "garbage collection (on-CPU)".to_string(),
        PartKind::OnCpu => "on-CPU".to_string(),
        PartKind::OffCpu => format!("off-CPU in {}", p.syscall.as_deref().unwrap_or("?")),
        PartKind::Runqueue => match &p.gil_holder {
            Some(h) => format!(
                "run queue, between waits for the GIL held by {}",
                h.describe()
            ),
            None => "run queue".to_string(),
        },
        PartKind::GilWait => match &p.gil_holder {
            Some(h) => format!("waiting for the GIL held by {}", h.describe()),
            None => "waiting for the GIL".to_string(),
        },
        PartKind::Throttled => "CPU throttled".to_string(),
    };
    // Before its own code ran: the park it was woken from is the place.
    if p.woken {
        let what = match p.kind {
            PartKind::Throttled => "CPU throttled",
            _ => "waiting for a CPU",
        };
        return format!(
            "woken from {} — {what}",
            p.syscall.as_deref().unwrap_or("its wait")
        );
    }
    match culprit(p) {
        Some(f) => format!("{} — {what}", f.label()),
        None => format!("[no user frame] — {what}"),
    }
}

/// A stall's top culprit: the [`culprit_label`] with the most of its
/// time (ties: the first in label order), None for a stall with no parts.
pub fn stall_culprit(s: &Stall) -> Option<String> {
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for p in &s.stacks {
        *by.entry(culprit_label(p)).or_default() += p.weight_ns;
    }
    let best = by.values().copied().max()?;
    by.into_iter().find(|&(_, ns)| ns == best).map(|(l, _)| l)
}

pub fn summarize(rec: &Recording, top: usize) -> Summary {
    let mut d: Vec<u64> = rec.stalls.iter().map(|s| s.duration_ns).collect();
    d.sort_unstable();
    let total: u64 = d.iter().sum();
    let mut by: HashMap<String, u64> = HashMap::new();
    let mut tasks: HashMap<String, HashMap<String, u64>> = HashMap::new();
    for s in &rec.stalls {
        for p in &s.stacks {
            let label = culprit_label(p);
            if let Some(t) = &s.task {
                *tasks
                    .entry(label.clone())
                    .or_default()
                    .entry(t.describe())
                    .or_default() += p.weight_ns;
            }
            *by.entry(label).or_default() += p.weight_ns;
        }
    }
    let mut culprits: Vec<Culprit> = by
        .into_iter()
        .map(|(label, ns)| Culprit {
            tasks: {
                let mut t: Vec<(String, u64)> = tasks
                    .remove(&label)
                    .unwrap_or_default()
                    .into_iter()
                    .collect();
                t.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                t.into_iter().map(|(d, _)| d).collect()
            },
            label,
            ns,
            share: if total > 0 {
                ns as f64 / total as f64
            } else {
                0.0
            },
        })
        .collect();
    culprits.sort_by(|a, b| b.ns.cmp(&a.ns).then_with(|| a.label.cmp(&b.label)));
    culprits.truncate(top);
    Summary {
        stalls: d.len(),
        total_ns: total,
        p50_ns: percentile(&d, 0.50),
        p99_ns: percentile(&d, 0.99),
        max_ns: d.last().copied().unwrap_or(0),
        on_cpu_ns: rec.stalls.iter().map(|s| s.on_cpu_ns).sum(),
        off_cpu_ns: rec.stalls.iter().map(|s| s.off_cpu_ns).sum(),
        runqueue_ns: rec.stalls.iter().map(|s| s.runqueue_ns).sum(),
        throttled_ns: rec.throttled_ns(),
        culprits,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(name: &str, file: Option<&str>, kind: FrameKind) -> Frame {
        let module = (kind == FrameKind::Native).then(|| {
            if file.is_some() {
                "app".into()
            } else {
                "libc.so.6".into()
            }
        });
        Frame {
            name: name.into(),
            file: file.map(Into::into),
            line: file.map(|_| 7),
            kind,
            module,
        }
    }

    #[test]
    fn culprit_prefers_python_then_sourced_native() {
        let p = StackPart {
            woken: false,
            frames: vec![
                f("main", Some("m.c"), FrameKind::Native),
                f("load", Some("tok.py"), FrameKind::Python),
                f("spin_for_ms", Some("v.c"), FrameKind::Native),
                f("clock_gettime", None, FrameKind::Native),
            ],
            weight_ns: 1,
            kind: PartKind::OnCpu,
            syscall: None,
            waker_tid: None,
            gil_holder: None,
        };
        assert_eq!(culprit(&p).unwrap().name, "load");
        let mut q = p.clone();
        q.frames.remove(1);
        assert_eq!(culprit(&q).unwrap().name, "spin_for_ms");
        q.frames.retain(|f| f.file.is_none());
        assert_eq!(culprit(&q).unwrap().name, "clock_gettime");
    }

    #[test]
    fn culprit_is_the_users_innermost_javascript() {
        let js = |name: &str, file: &str| Frame {
            file: Some(file.into()),
            line: Some(11),
            ..Frame::new(name, FrameKind::Js)
        };
        let p = StackPart {
            woken: false,
            frames: vec![
                f("uv__run_timers", Some("timer.c"), FrameKind::Native),
                js("listOnTimeout", "node:internal/timers"),
                js("deriveKey", "/srv/app.js"),
                js("pbkdf2Sync", "node:internal/crypto/pbkdf2"),
                f("PKCS5_PBKDF2_HMAC", None, FrameKind::Native),
            ],
            weight_ns: 1,
            kind: PartKind::OnCpu,
            syscall: None,
            waker_tid: None,
            gil_holder: None,
        };
        assert_eq!(culprit(&p).unwrap().name, "deriveKey");
        // Only Node's own JavaScript: the innermost of it.
        let mut q = p.clone();
        q.frames.remove(2);
        assert_eq!(culprit(&q).unwrap().name, "pbkdf2Sync");
        // A perf map's JS frames count as JavaScript too (not as `[jit]` noise).
        let mut r = p.clone();
        r.frames[2] = Frame {
            module: Some("[jit]".into()),
            ..Frame::new("JS:*deriveKey /srv/app.js:11:19", FrameKind::Native)
        };
        r.frames.remove(3);
        r.frames.remove(1);
        assert_eq!(culprit(&r).unwrap().name, "JS:*deriveKey /srv/app.js:11:19");
    }

    #[test]
    fn percentiles() {
        assert_eq!(percentile(&[1, 2, 3, 4], 0.5), 2);
        assert_eq!(percentile(&[1, 2, 3, 4], 0.99), 4);
        assert_eq!(percentile(&[], 0.5), 0);
    }
}
