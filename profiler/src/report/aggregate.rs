//! Aggregation: symbolized stalls -> weighted stacks and a summary.
//!
//! In: [`Recording`]. Out: folded stacks (one weight per distinct stack, in
//! microseconds of stall time) and [`Summary`] (duration percentiles, time
//! split, top culprits in the app's terms, entry points). Which frames are
//! the app's is [`classify`]'s answer; the culprit of a part is its innermost
//! app frame past the loop, with the library call it went through
//! ([`blame`]), else the older rule ([`fallback_culprit`]).
use std::collections::{BTreeMap, HashMap};

use crate::classify::{
    self, AppPaths, is_node_internal_js, is_perf_map_js, is_runtime_frame, is_system_lib,
};
use crate::model::{
    Frame, FrameKind, HeldUp, NotReadReason, PartKind, Recording, StackPart, Stall,
};

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

/// The frame to blame when a part has no app frame ([`AppPaths::is_app`]):
/// the innermost Python frame if any, else the innermost JavaScript frame
/// outside Node's own modules (Node: read from memory or named by a perf
/// map; Node's own `node:` modules and builtins without a script are
/// skipped, then taken if there is nothing else), else the innermost
/// native frame outside the C runtime and the Rust standard library /
/// async runtime, preferring one with source information.
fn fallback_culprit(p: &StackPart) -> Option<&Frame> {
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

/// Who a part's time is blamed on: its culprit frame and, when that is the
/// app's, the library call it went through.
#[derive(Clone, Debug, PartialEq)]
pub struct Blame<'a> {
    pub frame: &'a Frame,
    /// `pypdf … PageObject.extract_text`, `time_sleep`: the first frame the
    /// app frame called that is not the interpreter's call machinery
    /// (`_PyObject_Vectorcall*`, …), with its library
    /// ([`AppPaths::library`]). None when the app's code itself ran, or the
    /// culprit is not the app's.
    pub via: Option<String>,
}

impl Blame<'_> {
    /// `parse_resume (app.py:31) → pypdf … PageObject.extract_text`, or the
    /// frame's label alone. Escaped like every label.
    pub fn label(&self) -> String {
        match &self.via {
            Some(v) => format!(
                "{} → {}",
                self.frame.label(),
                crate::model::text::escape(v).replace(';', ":")
            ),
            None => self.frame.label(),
        }
    }
}

/// The library call an app frame at `i` went through (see [`Blame::via`]).
/// Under a JavaScript frame only JavaScript counts (`test`, `node:fs …
/// readFileSync`): the native frames V8 runs a builtin through
/// (`Builtins_CEntry_…` trampolines) name no call the app made.
fn via(p: &StackPart, i: usize, app: &AppPaths) -> Option<String> {
    let js = |f: &Frame| f.kind == FrameKind::Js || is_perf_map_js(f);
    let under_js = js(&p.frames[i]);
    let f = p.frames[i + 1..].iter().find(|f| {
        if under_js {
            return js(f);
        }
        matches!(
            f.kind,
            FrameKind::Python | FrameKind::Js | FrameKind::Native
        ) && !classify::is_call_glue(f)
    })?;
    let name = classify::called_name(f).unwrap_or_else(|| f.name.to_string());
    Some(match app.library(f) {
        Some(lib) => format!("{lib} … {name}"),
        None => name,
    })
}

/// The blame for a part: its innermost app frame ([`AppPaths::is_app`])
/// past the loop ([`classify::work_start`]: not the `main` that started the
/// loop) with the library call it went through, so that a library's time
/// spread over many of its functions adds up under the app function that
/// called it; without an app frame there, [`fallback_culprit`] (no `via`).
pub fn blame<'a>(p: &'a StackPart, app: &AppPaths) -> Option<Blame<'a>> {
    let from = classify::work_start(&p.frames);
    match p.frames[from..].iter().rposition(|f| app.is_app(f)) {
        Some(i) => Some(Blame {
            frame: &p.frames[from + i],
            via: via(p, from + i, app),
        }),
        None => fallback_culprit(p).map(|frame| Blame { frame, via: None }),
    }
}

/// A part's blame as one name ([`Blame::label`]), `[no user frame]` when
/// it has none: what `top`, the daemon's pages and the CI gate name.
pub fn culprit_name(p: &StackPart, app: &AppPaths) -> String {
    blame(p, app).map_or_else(|| "[no user frame]".to_string(), |b| b.label())
}

/// The frame to blame for a part ([`blame`]).
pub fn culprit<'a>(p: &'a StackPart, app: &AppPaths) -> Option<&'a Frame> {
    blame(p, app).map(|b| b.frame)
}

/// A part's entry point: the outermost app frame past the loop's last
/// dispatch point (asyncio's or uvloop's `Handle._run`: the handler a
/// server's framework called; [`classify::work_start`]), or the outermost
/// app frame of a stack without a loop. None without an app frame there.
pub fn entry<'a>(p: &'a StackPart, app: &AppPaths) -> Option<&'a Frame> {
    p.frames[classify::work_start(&p.frames)..]
        .iter()
        .find(|f| app.is_app(f))
}

/// A stall's entry point, `parse_resume (app.py)`: the [`entry`] with the
/// most of its time, by function and file (not line: one handler is one
/// entry). None when no part has one.
pub fn stall_entry(s: &Stall, app: &AppPaths) -> Option<String> {
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for p in &s.stacks {
        if let Some(f) = entry(p, app) {
            *by.entry(f.function_label()).or_default() += p.weight_ns;
        }
    }
    let best = by.values().copied().max()?;
    by.into_iter().find(|&(_, ns)| ns == best).map(|(l, _)| l)
}

/// One line of the summary's entry points: a handler and its stall time.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// `parse_resume (app.py)` ([`stall_entry`]).
    pub label: String,
    pub ns: u64,
    pub share: f64,
    pub stalls: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Culprit {
    /// `name (file:line)` of the culprit frame, plus how it spent the time.
    pub label: String,
    pub ns: u64,
    pub share: f64,
    /// The asyncio tasks its stalls ran, heaviest first
    /// ([`crate::model::Task::describe`]).
    pub tasks: Vec<String>,
    /// The ASGI routes its stalls served, heaviest first
    /// ([`crate::model::Route::describe`]).
    pub routes: Vec<String>,
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
    /// Stall time by entry point ([`stall_entry`]), heaviest first; empty
    /// when no stall has one.
    pub entries: Vec<Entry>,
    /// Stall time by ASGI route (`POST /resume/{rid}`), heaviest first;
    /// empty when no stall has one.
    pub routes: Vec<Entry>,
}

/// Nearest-rank percentile of sorted values.
/// What the recording's stalls held up, over every stall whose loop
/// queues were read: the headline's numbers (summary, `top`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeldUpTotals {
    /// Stalls whose held-up work was read, and of them those that delayed
    /// at least one timer.
    pub read: usize,
    pub delaying: usize,
    /// Delayed timers, over those stalls.
    pub timers: usize,
    /// The worst lateness of any delayed timer.
    pub worst_ns: u64,
    /// The 99th percentile (nearest rank) of the lateness of every delayed
    /// timer of those stalls, each timer counted once.
    pub p99_ns: u64,
    /// Callbacks queued behind the stalls, summed.
    pub ready_handles: u64,
    /// Stalls not read, by process, reason and detail (none for a read
    /// that came late: by how much differs per stall).
    pub not_read: BTreeMap<(u32, NotReadReason, Option<String>), usize>,
}

/// [`HeldUpTotals`] of `stalls` (a recording's, `top`'s window).
pub fn held_up_totals<'a>(stalls: impl IntoIterator<Item = &'a Stall>) -> HeldUpTotals {
    let mut t = HeldUpTotals::default();
    let mut late: Vec<u64> = Vec::new();
    for s in stalls {
        match &s.held_up {
            Some(HeldUp::Read(d)) => {
                t.read += 1;
                t.delaying += usize::from(!d.timers_late_ns.is_empty());
                t.ready_handles += u64::from(d.ready_handles);
                late.extend(&d.timers_late_ns);
            }
            Some(HeldUp::NotRead(n)) => {
                // How late a read came differs per stall: not a group.
                let detail = match n.reason {
                    NotReadReason::AfterEnd => None,
                    _ => n.detail.clone(),
                };
                *t.not_read.entry((s.pid, n.reason, detail)).or_default() += 1;
            }
            None => {}
        }
    }
    late.sort_unstable();
    t.timers = late.len();
    t.worst_ns = late.last().copied().unwrap_or(0);
    t.p99_ns = percentile(&late, 0.99);
    t
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The summary's culprit text for a part: its [`blame`] and how it spent
/// the time, e.g. `load_tokenizer (tok.py:41) → json … loads — on-CPU`.
pub fn culprit_label(p: &StackPart, app: &AppPaths) -> String {
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
    match blame(p, app) {
        Some(b) => format!("{} — {what}", b.label()),
        None => format!("[no user frame] — {what}"),
    }
}

/// A stall's top culprit: the [`culprit_label`] with the most of its
/// time (ties: the first in label order), None for a stall with no parts.
pub fn stall_culprit(s: &Stall, app: &AppPaths) -> Option<String> {
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for p in &s.stacks {
        *by.entry(culprit_label(p, app)).or_default() += p.weight_ns;
    }
    let best = by.values().copied().max()?;
    by.into_iter().find(|&(_, ns)| ns == best).map(|(l, _)| l)
}

pub fn summarize(rec: &Recording, top: usize) -> Summary {
    summarize_where(rec, top, |_| true)
}

/// [`summarize`] over the stalls `keep` takes (those of one process:
/// `--by-process`).
pub fn summarize_where(rec: &Recording, top: usize, keep: impl Fn(&Stall) -> bool) -> Summary {
    let app = rec.app();
    let stalls: Vec<&Stall> = rec.stalls.iter().filter(|s| keep(s)).collect();
    let mut d: Vec<u64> = stalls.iter().map(|s| s.duration_ns).collect();
    d.sort_unstable();
    let total: u64 = d.iter().sum();
    let share = |ns: u64| {
        if total > 0 {
            ns as f64 / total as f64
        } else {
            0.0
        }
    };
    let mut by: HashMap<String, u64> = HashMap::new();
    let mut tasks: HashMap<String, HashMap<String, u64>> = HashMap::new();
    let mut routes_of: HashMap<String, HashMap<String, u64>> = HashMap::new();
    let mut entries: HashMap<String, (u64, usize)> = HashMap::new();
    let mut routes: HashMap<String, (u64, usize)> = HashMap::new();
    for s in stalls.iter().copied() {
        if let Some(e) = stall_entry(s, &app) {
            let v = entries.entry(e).or_default();
            v.0 += s.duration_ns;
            v.1 += 1;
        }
        let route = s.route.as_ref().map(|r| r.describe());
        if let Some(r) = &route {
            let v = routes.entry(r.clone()).or_default();
            v.0 += s.duration_ns;
            v.1 += 1;
        }
        for p in &s.stacks {
            let label = culprit_label(p, &app);
            if let Some(t) = &s.task {
                *tasks
                    .entry(label.clone())
                    .or_default()
                    .entry(t.describe())
                    .or_default() += p.weight_ns;
            }
            if let Some(r) = &route {
                *routes_of
                    .entry(label.clone())
                    .or_default()
                    .entry(r.clone())
                    .or_default() += p.weight_ns;
            }
            *by.entry(label).or_default() += p.weight_ns;
        }
    }
    let heaviest_first = |m: HashMap<String, u64>| -> Vec<String> {
        let mut t: Vec<(String, u64)> = m.into_iter().collect();
        t.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        t.into_iter().map(|(d, _)| d).collect()
    };
    let mut culprits: Vec<Culprit> = by
        .into_iter()
        .map(|(label, ns)| Culprit {
            tasks: heaviest_first(tasks.remove(&label).unwrap_or_default()),
            routes: heaviest_first(routes_of.remove(&label).unwrap_or_default()),
            label,
            ns,
            share: share(ns),
        })
        .collect();
    culprits.sort_by(|a, b| b.ns.cmp(&a.ns).then_with(|| a.label.cmp(&b.label)));
    culprits.truncate(top);
    let lines = |m: HashMap<String, (u64, usize)>| -> Vec<Entry> {
        let mut v: Vec<Entry> = m
            .into_iter()
            .map(|(label, (ns, stalls))| Entry {
                label,
                ns,
                share: share(ns),
                stalls,
            })
            .collect();
        v.sort_by(|a, b| b.ns.cmp(&a.ns).then_with(|| a.label.cmp(&b.label)));
        v.truncate(top);
        v
    };
    let entries = lines(entries);
    let routes = lines(routes);
    Summary {
        stalls: d.len(),
        total_ns: total,
        p50_ns: percentile(&d, 0.50),
        p99_ns: percentile(&d, 0.99),
        max_ns: d.last().copied().unwrap_or(0),
        on_cpu_ns: stalls.iter().map(|s| s.on_cpu_ns).sum(),
        off_cpu_ns: stalls.iter().map(|s| s.off_cpu_ns).sum(),
        runqueue_ns: stalls.iter().map(|s| s.runqueue_ns).sum(),
        throttled_ns: stalls.iter().map(|s| s.throttled_ns).sum(),
        culprits,
        entries,
        routes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

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
        assert_eq!(culprit(&p, &AppPaths::default()).unwrap().name, "load");
        let mut q = p.clone();
        q.frames.remove(1);
        assert_eq!(
            culprit(&q, &AppPaths::default()).unwrap().name,
            "spin_for_ms"
        );
        q.frames.retain(|f| f.file.is_none());
        assert_eq!(
            culprit(&q, &AppPaths::default()).unwrap().name,
            "clock_gettime"
        );
    }

    /// The library call after the app frame is the one the app made, not
    /// the interpreter's or a binding's glue between them (issue 36).
    #[test]
    fn the_library_call_named_is_past_the_glue() {
        let native = |name: &str, module: &str| Frame {
            name: name.into(),
            file: None,
            line: None,
            kind: FrameKind::Native,
            module: Some(module.into()),
        };
        let py = |name: &str, file: &str| Frame {
            name: name.into(),
            file: Some(file.into()),
            line: Some(25),
            kind: FrameKind::Python,
            module: None,
        };
        let part = |frames| StackPart {
            woken: false,
            frames,
            weight_ns: 1,
            kind: PartKind::OnCpu,
            syscall: None,
            waker_tid: None,
            gil_holder: None,
        };
        let app = AppPaths::default();
        let lib = "/srv/venv/lib/python3.11/site-packages";
        // A class instantiated: type_call, slot_tp_init, then its __init__.
        let p = part(vec![
            py("make_clients", "/srv/gateway.py"),
            native("_PyEval_EvalFrameDefault", "libpython3.11.so.1.0"),
            native("type_call", "libpython3.11.so.1.0"),
            native("slot_tp_init", "libpython3.11.so.1.0"),
            native("_PyObject_Call_Prepend", "libpython3.11.so.1.0"),
            py("AsyncClient.__init__", &format!("{lib}/httpx/_client.py")),
            py("create_default_context", "/usr/lib/python3.11/ssl.py"),
        ]);
        assert_eq!(
            blame(&p, &app).unwrap().label(),
            "make_clients (gateway.py:25) → httpx … AsyncClient.__init__"
        );
        // A Rust extension's method: pyo3's trampoline, then the method.
        let ext = "tokenizers.cpython-311-x86_64-linux-gnu.so";
        let p = part(vec![
            py("load_tokenizer", "/srv/gateway.py"),
            native("cfunction_call", "libpython3.11.so.1.0"),
            native(
                "pyo3::impl_::trampoline::fastcall_cfunction_with_keywords::<<pyo3::impl_::pyclass::PyClassImplCollector<tokenizers::tokenizer::PyTokenizer> as tokenizers::tokenizer::PyMethods>::py_methods::ITEMS::Def>",
                ext,
            ),
            native(
                "tokenizers::tokenizer::PyTokenizer::__pymethod_from_file__",
                ext,
            ),
            native("tokenizers::tokenizer::PyTokenizer::from_file", ext),
        ]);
        assert_eq!(
            blame(&p, &app).unwrap().label(),
            "load_tokenizer (gateway.py:25) → tokenizers … PyTokenizer.from_file"
        );
        // A pure-Python loop sampled in the C API its bytecode runs: no call.
        let p = part(vec![
            py("render", "/srv/app.py"),
            native("PyObject_GetAttr", "python3.11"),
            native("_PyObject_GenericGetAttrWithDict", "python3.11"),
        ]);
        assert_eq!(blame(&p, &app).unwrap().label(), "render (app.py:25)");
    }

    #[test]
    fn a_rust_std_method_inlined_into_the_app_is_not_the_culprit() {
        // A tokio worker's spin: `<u64>::wrapping_add` is core's, inlined
        // into the app's function; its file says so.
        let p = StackPart {
            woken: false,
            frames: vec![
                f(
                    "tokio::runtime::task::core::Core<T,S>::poll",
                    Some(
                        "/home/u/.cargo/registry/src/index.crates.io-1/tokio-1.54.1/src/runtime/task/core.rs",
                    ),
                    FrameKind::Native,
                ),
                f(
                    "victim::stall_task::{{closure}}",
                    Some("/srv/victim/src/main.rs"),
                    FrameKind::Native,
                ),
                f(
                    "victim::cpu_spin",
                    Some("/srv/victim/src/main.rs"),
                    FrameKind::Native,
                ),
                f(
                    "<u64>::wrapping_add",
                    Some(
                        "/rustc/59807616e1fa2540724bfbac14d7976d7e4a3860/library/core/src/num/uint_macros.rs",
                    ),
                    FrameKind::Native,
                ),
            ],
            weight_ns: 1,
            kind: PartKind::OnCpu,
            syscall: None,
            waker_tid: None,
            gil_holder: None,
        };
        assert_eq!(
            culprit(&p, &AppPaths::default()).unwrap().name,
            "victim::cpu_spin"
        );
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
        assert_eq!(culprit(&p, &AppPaths::default()).unwrap().name, "deriveKey");
        assert_eq!(
            blame(&p, &AppPaths::default()).unwrap().label(),
            "deriveKey (app.js:11) → node:internal/crypto/pbkdf2 … pbkdf2Sync"
        );
        // V8's trampolines under a JS frame are no call of the app's.
        let mut b = p.clone();
        b.frames.truncate(3);
        b.frames.push(Frame {
            module: Some("node".into()),
            ..Frame::new(
                "Builtins_CEntry_Return1_ArgvOnStack_BuiltinExit",
                FrameKind::Native,
            )
        });
        assert_eq!(
            blame(&b, &AppPaths::default()).unwrap().label(),
            "deriveKey (app.js:11)"
        );
        // Only Node's own JavaScript: the innermost of it.
        let mut q = p.clone();
        q.frames.remove(2);
        assert_eq!(
            culprit(&q, &AppPaths::default()).unwrap().name,
            "pbkdf2Sync"
        );
        // A perf map's JS frames count as JavaScript too (not as `[jit]` noise).
        let mut r = p.clone();
        r.frames[2] = Frame {
            module: Some("[jit]".into()),
            ..Frame::new("JS:*deriveKey /srv/app.js:11:19", FrameKind::Native)
        };
        r.frames.remove(3);
        r.frames.remove(1);
        assert_eq!(
            culprit(&r, &AppPaths::default()).unwrap().name,
            "JS:*deriveKey /srv/app.js:11:19"
        );
    }

    /// Issue 19: a library's time adds up under the app function that
    /// called it; the handler is the entry point; without an app frame,
    /// the older rule.
    #[test]
    fn the_culprit_is_the_apps_innermost_frame_issue_19() {
        let py = |name: &str, file: &str| Frame {
            file: Some(file.into()),
            line: Some(31),
            ..Frame::new(name, FrameKind::Python)
        };
        let site = "/venv/lib/python3.11/site-packages";
        let part = |frames: Vec<Frame>, weight_ns| StackPart {
            frames,
            weight_ns,
            kind: PartKind::OnCpu,
            syscall: None,
            waker_tid: None,
            gil_holder: None,
            woken: false,
        };
        let head = || {
            vec![
                py("<module>", "/srv/app.py"),
                py("Handle._run", "/usr/lib/python3.11/asyncio/events.py"),
                py("Router.__call__", &format!("{site}/starlette/routing.py")),
                py("parse_resume", "/srv/app.py"),
                Frame {
                    module: Some("libpython3.11.so.1.0".into()),
                    ..Frame::new("_PyObject_VectorcallTstate", FrameKind::Native)
                },
                py("PageObject.extract_text", &format!("{site}/pypdf/_page.py")),
            ]
        };
        let deep = |leaf: &str| {
            let mut v = head();
            v.push(py(leaf, &format!("{site}/pypdf/_text_extractor.py")));
            v
        };
        let app = AppPaths::default();
        let a = part(deep("TextExtraction.process_operation"), 6);
        let b = part(deep("Font.get_text_width"), 5);
        for p in [&a, &b] {
            assert_eq!(
                culprit_label(p, &app),
                "parse_resume (app.py:31) → pypdf … PageObject.extract_text — on-CPU"
            );
            assert_eq!(entry(p, &app).unwrap().name, "parse_resume");
        }
        // The interpreter's own C function: named without a library.
        let mut sleep = head();
        sleep.truncate(4);
        sleep.push(Frame {
            module: Some("libpython3.11.so.1.0".into()),
            ..Frame::new("time_sleep", FrameKind::Native)
        });
        assert_eq!(
            blame(&part(sleep, 1), &app).unwrap().label(),
            "parse_resume (app.py:31) → time_sleep"
        );
        // The app's own code running: no library call.
        let mut own = head();
        own.truncate(4);
        assert_eq!(
            blame(&part(own, 1), &app).unwrap().label(),
            "parse_resume (app.py:31)"
        );
        // No app frame past the dispatch: no entry; the culprit is the
        // innermost Python frame, as before.
        let fw = part(head()[..3].to_vec(), 1);
        assert_eq!(entry(&fw, &app), None);
        assert_eq!(
            culprit_label(&fw, &app),
            "Router.__call__ (routing.py:31) — on-CPU"
        );
        // The summary adds the library's functions up under the app's.
        let s = testing::stall(0, vec![a, b, fw]);
        assert_eq!(
            stall_entry(&s, &app).as_deref(),
            Some("parse_resume (app.py)")
        );
        assert_eq!(
            stall_culprit(&s, &app).as_deref(),
            Some("parse_resume (app.py:31) → pypdf … PageObject.extract_text — on-CPU")
        );
        // --app-path naming only the framework: it is the app now, and
        // /srv/app.py a library called from it.
        let fw_app = AppPaths::new(&[format!("{site}/starlette/")]);
        assert_eq!(
            stall_culprit(&s, &fw_app).as_deref(),
            Some("Router.__call__ (routing.py:31) → app … parse_resume — on-CPU")
        );
    }

    #[test]
    fn held_up_totals_over_the_read_stalls() {
        use crate::model::{Delayed, NotRead};
        let mut rec = Recording::for_tests(vec![]);
        let ms = 1_000_000;
        let mut stall = |held: HeldUp| {
            let mut s = crate::testing::stall(0, vec![]);
            s.pid = 7;
            s.held_up = Some(held);
            rec.stalls.push(s);
        };
        // 100 timers 1..=100 ms late over two stalls: p99 is the 99th.
        stall(HeldUp::Read(Delayed {
            timers_late_ns: (51..=100).rev().map(|n| n * ms).collect(),
            ready_handles: 3,
            truncated: false,
        }));
        stall(HeldUp::Read(Delayed {
            timers_late_ns: (1..=50).rev().map(|n| n * ms).collect(),
            ready_handles: 0,
            truncated: false,
        }));
        stall(HeldUp::Read(Delayed::default()));
        stall(HeldUp::NotRead(NotRead {
            reason: NotReadReason::Runtime,
            detail: Some("uvloop.Loop".into()),
        }));
        let t = held_up_totals(&rec.stalls);
        assert_eq!((t.read, t.delaying, t.timers), (3, 2, 100));
        assert_eq!(
            (t.worst_ns, t.p99_ns, t.ready_handles),
            (100 * ms, 99 * ms, 3)
        );
        assert_eq!(
            t.not_read.into_iter().collect::<Vec<_>>(),
            [((7, NotReadReason::Runtime, Some("uvloop.Loop".into())), 1)]
        );
    }

    #[test]
    fn percentiles() {
        assert_eq!(percentile(&[1, 2, 3, 4], 0.5), 2);
        assert_eq!(percentile(&[1, 2, 3, 4], 0.99), 4);
        assert_eq!(percentile(&[], 0.5), 0);
    }
}
