//! The default view of stacks in the flamegraph, `stalls.folded`,
//! `stalls.speedscope.json` and `stalls.pb.gz`: the user's code, not the
//! interpreter's or the loop's, said in short names.
//!
//! In: symbolized stalls (every frame, as `stalls.json` keeps them). Out:
//! the same stalls with, unless `--native all`:
//! - **the interpreter folded away** in the interpreter's stacks (with
//!   Python frames, or native frames of the interpreter's object file):
//!   native frames of the interpreter (module `libpython*` or the `python*`
//!   executable) whose names are CPython's eval, call and bootstrap
//!   machinery (`_PyEval_*`, `_PyObject_Vectorcall*`, `Py_RunMain`,
//!   `pymain_*`, …), the C runtime's start frames (`_start`,
//!   `__libc_start*`) and asyncio's C task stepping (`_asyncio`'s
//!   `task_step*`). Every other native frame stays where it was, so a C
//!   extension (`zlib_Compress…`, `deflate`, `_ssl__SSLContext…`) and the
//!   kernel stay under the Python function that called them. The module is
//!   what decides: a frame named `_PyEval_EvalFrameDefault` in another
//!   object is not the interpreter's.
//! - **the loop's root trimmed**: in every stack the frames all stacks of
//!   that thread share (when it has two different ones), but never the
//!   frame the summary blames ([`aggregate::culprit`]) nor anything above
//!   it, and never a stack's last frame; then, in an interpreter's stack,
//!   the loop's dispatch ([`dispatch_end`]: asyncio's `Handle._run`,
//!   uvloop's Cython/libuv machinery), a task started eagerly by the
//!   framework ([`classify::is_eager_task_start`]: the task's first step
//!   run inside its constructor, `_asyncio_Task___init__` →
//!   `task_eager_start`) and past them the framework's frames down to the
//!   entry point (the handler, [`aggregate::entry`]). A stack with nothing
//!   of the program's past the dispatch (a sample inside the loop itself)
//!   is one [`FrameKind::EventLoop`] frame, `[event loop]`: a typed
//!   marker, so no renderer matches its name.
//! - **native names shortened** ([`short_name`]): a Rust or C++ name's
//!   generic arguments elided (`Harness<…>::poll`), its hash suffix
//!   dropped; one owner, so every output says a frame the same way.
//!
//! In every view:
//! - **one frame per function** unless `--lines`: the line is dropped, so
//!   `handle_request (gateway.py:144)` and `(gateway.py:145)` are one
//!   `handle_request (gateway.py)` (a flamegraph's question is which
//!   function; the summary's culprits keep their line, they name a place);
//! - **no frame without a name**: an empty name (a name read from the
//!   target may be) becomes its file or object in brackets, `[gateway.py]`.
//!
//! Weights are untouched: the view moves no time, it only drops frames and
//! renames them (so distinct stacks may merge). The asyncio task and the
//! ASGI route are no frames of the view: they are labels in
//! `stalls.pb.gz` and attributes in the timelines; `--group-by task|route`
//! roots each stack of `stalls.folded` and `stalls.svg` in one
//! ([`grouped`]). `stalls.json` keeps every frame.
use std::{borrow::Cow, collections::HashMap};

use clap::ValueEnum;

use crate::classify::{
    AppPaths, is_dispatch_frame, is_eager_task_start, is_interpreter_frame, is_interpreter_module,
    is_libuv, is_loop_machinery, work_start,
};
use crate::model::{Frame, FrameKind, Recording, Stall};
use crate::report::aggregate;

/// Which native frames a view keeps (`--native`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Native {
    /// The user's code: interpreter and bootstrap frames folded away, the
    /// loop's common root trimmed, native names shortened.
    #[default]
    User,
    /// Every frame as recorded, with its full name.
    All,
}

/// What each stack of `stalls.folded` and `stalls.svg` is rooted in
/// (`--group-by`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GroupBy {
    /// The asyncio task's coroutine: `task Gateway.handle_request`
    /// (`[no task]` for a stall outside any task).
    Task,
    /// The ASGI request's method and route: `route POST /resume/{rid}`
    /// (`[no route]` for a stall outside any request).
    Route,
}

/// How stacks are shown in the flamegraph, `stalls.folded`,
/// `stalls.speedscope.json` and `stalls.pb.gz`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct View {
    pub native: Native,
    /// A frame per line (`--lines`), not per function.
    pub lines: bool,
    /// The root of each stack in `stalls.folded` and `stalls.svg`
    /// (`--group-by`), none by default.
    pub group_by: Option<GroupBy>,
}

impl View {
    /// Every frame as recorded, lines too.
    pub const ALL: View = View {
        native: Native::All,
        lines: true,
        group_by: None,
    };
}

/// A native (Rust or C++) name as the default view says it: generic
/// arguments elided (`Harness<T,S>::poll` → `Harness<…>::poll`,
/// `fastcall_cfunction_with_keywords::<<pyo3::…>>` →
/// `fastcall_cfunction_with_keywords::<…>`), a Rust legacy hash suffix
/// (`::h0123456789abcdef`) dropped. A qualified path's own brackets stay
/// (`<T as Trait>::f`, `<impl Trait for Type>::f`, `<u64>::wrapping_add`),
/// only the generic arguments inside them go; so do C++ operators' (`operator<<`,
/// `operator->`). A name whose brackets do not balance is left whole. The
/// full name is in `stalls.json` and under `--native all`.
pub fn short_name(name: &str) -> Cow<'_, str> {
    let base = strip_rust_hash(name);
    if !base.contains('<') {
        return Cow::Borrowed(base);
    }
    let mut out = String::with_capacity(base.len());
    // Depth inside elided generic arguments; kept qualified-path brackets.
    let (mut elided, mut kept) = (0usize, 0usize);
    let mut chars = base.chars().peekable();
    while let Some(c) = chars.next() {
        if elided == 0 && out.ends_with("operator") && matches!(c, '<' | '>' | '-' | '=') {
            out.push(c);
            while let Some(&n) = chars.peek().filter(|n| matches!(n, '<' | '>' | '=')) {
                out.push(n);
                chars.next();
            }
            continue;
        }
        match c {
            '<' if elided > 0 => elided += 1,
            '<' => {
                let generic = out
                    .chars()
                    .next_back()
                    .is_some_and(|p| p.is_alphanumeric() || p == '_' || p == ':');
                if generic {
                    elided = 1;
                    out.push_str("<…>");
                } else {
                    kept += 1;
                    out.push('<');
                }
            }
            '>' if elided > 0 => elided -= 1,
            '>' if kept > 0 => {
                kept -= 1;
                out.push('>');
            }
            '>' => return Cow::Borrowed(name),
            c if elided == 0 => out.push(c),
            _ => {}
        }
    }
    if elided > 0 || kept > 0 {
        return Cow::Borrowed(name);
    }
    Cow::Owned(out)
}

/// `name` without rustc's legacy symbol hash, `::h` and 16 hex digits.
fn strip_rust_hash(name: &str) -> &str {
    match name.rsplit_once("::h") {
        Some((head, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            head
        }
        _ => name,
    }
}

/// A frame as every view says it: named (an empty name becomes its file
/// or object in brackets, `[gateway.py]`, else `[unnamed python
/// frame]`), its line dropped unless
/// `v.lines`, a native name shortened ([`short_name`]) unless `--native
/// all`.
fn present(f: &mut Frame, v: View) {
    if f.name.is_empty() {
        f.name = match f.file.as_deref().or(f.module.as_deref()) {
            Some(place) => format!("[{}]", place.rsplit('/').next().unwrap_or(place)),
            None => format!("[unnamed {} frame]", f.kind.as_str()),
        }
        .into();
    }
    if !v.lines {
        f.line = None;
    }
    if v.native == Native::User
        && f.kind == FrameKind::Native
        && let Cow::Owned(short) = short_name(&f.name)
    {
        f.name = short.into();
    }
}

/// The view of one stack before trimming: interpreter frames folded away
/// when it is the interpreter's (it holds Python frames, or native frames
/// of the interpreter: start-up and finalization run no Python code).
fn fold(frames: &[Frame]) -> Vec<Frame> {
    let interpreter = frames.iter().any(|f| {
        f.kind == FrameKind::Python
            || (f.kind == FrameKind::Native
                && f.module.as_deref().is_some_and(is_interpreter_module))
    });
    if !interpreter {
        return frames.to_vec();
    }
    frames
        .iter()
        .filter(|f| !is_interpreter_frame(f))
        .cloned()
        .collect()
}

/// Where the loop's dispatch ends in a (folded) interpreter stack: the
/// index of the first frame after it, 0 when the stack has none.
/// - asyncio: after the last `Handle._run`;
/// - a Cython/libuv loop (uvloop): from the first frame of its machinery
///   ([`classify::is_loop_machinery`]: libuv, the Cython functions of the
///   object file libuv is linked into, asyncio's C task step) through
///   every machinery or dispatch frame that follows it without a break.
///   Only that first run: a handler calling back into the loop
///   (`loop.call_later`) further up keeps its frames.
fn dispatch_end(frames: &[Frame]) -> usize {
    let asyncio = frames
        .iter()
        .rposition(|f| f.kind == FrameKind::Python && is_dispatch_frame(f))
        .map_or(0, |i| i + 1);
    if !frames.iter().any(Frame::is_interpreted) {
        return asyncio;
    }
    let libuv = frames
        .iter()
        .find(|f| is_libuv(f))
        .and_then(|f| f.module.as_deref());
    let machinery = |f: &Frame| is_loop_machinery(f, libuv) || is_dispatch_frame(f);
    let uv = match frames.iter().position(|f| libuv.is_some() && machinery(f)) {
        Some(first) => first + frames[first..].iter().take_while(|f| machinery(f)).count(),
        None => 0,
    };
    asyncio.max(uv)
}

/// One stack with the loop's dispatch trimmed ([`dispatch_end`]) and,
/// where it has an entry point ([`aggregate::entry`]: the handler), the
/// framework's frames between the two; a stack with nothing of the
/// program's after the dispatch (a sample inside the loop itself) becomes
/// one [`FrameKind::EventLoop`] frame, followed by its kernel frames and
/// markers.
fn trim_dispatch(frames: &mut Vec<Frame>, app: &AppPaths) {
    let end = loop_end(frames, app);
    if end == 0 {
        return;
    }
    let code = |f: &Frame| {
        matches!(
            f.kind,
            FrameKind::Native | FrameKind::Python | FrameKind::Js
        )
    };
    if !frames[end..].iter().any(code) {
        let rest = frames.split_off(end);
        *frames = std::iter::once(Frame::new("[event loop]", FrameKind::EventLoop))
            .chain(rest)
            .collect();
        return;
    }
    let handler = frames[end..]
        .iter()
        .position(|f| app.is_app(f))
        .map_or(end, |i| end + i);
    frames.drain(..handler);
}

/// Where the loop's part of an interpreter's (folded) stack ends: past
/// its dispatch ([`dispatch_end`]), its run ([`classify::work_start`]: a
/// stack whose native frames were not unwound shows uvloop's run only as
/// `Runner.run` before the task's Python frames) and a task's eager start
/// by the framework; 0 for a stack with none of them, or not the
/// interpreter's.
fn loop_end(frames: &[Frame], app: &AppPaths) -> usize {
    if !frames.iter().any(Frame::is_interpreted) {
        return 0;
    }
    let mut end = dispatch_end(frames).max(work_start(frames));
    // A task the framework started eagerly (aiohttp's request handler
    // task, the eager task factory): its first step ran inside the
    // constructor, under the framework's frames. It starts there as it
    // would after `Handle._run`, so its stacks merge with its later
    // steps'. Not when the app's own code created it: that call is
    // where the time went.
    while let Some(i) = frames[end..].iter().position(is_eager_task_start) {
        let at = end + i;
        if frames[end..at].iter().any(|f| app.is_app(f)) {
            break;
        }
        end = at
            + frames[at..]
                .iter()
                .take_while(|f| is_eager_task_start(f))
                .count();
    }
    end
}

/// The stalls as `view` shows them, the application's frames told by `app`.
/// Any stalls given by reference (a recording's, or a daemon's picked from
/// several processes): they are copied once, here.
pub fn apply<'a>(
    stalls: impl IntoIterator<Item = &'a Stall>,
    view: View,
    app: &AppPaths,
) -> Vec<Stall> {
    let mut out: Vec<Stall> = stalls.into_iter().cloned().collect();
    if view.native == Native::User {
        trim(&mut out, app);
    }
    for f in out
        .iter_mut()
        .flat_map(|s| s.stacks.iter_mut())
        .flat_map(|p| p.frames.iter_mut())
    {
        present(f, view);
    }
    out
}

/// The interpreter folded away and the loop's root and dispatch trimmed,
/// in place (the view's `--native user`).
fn trim(out: &mut [Stall], app: &AppPaths) {
    for s in out.iter_mut() {
        for p in s.stacks.iter_mut() {
            p.frames = fold(&p.frames);
        }
    }
    // Per thread, the root every stack shares, cut short of every stack's
    // culprit and last frame: (frames shared, a stack to compare with,
    // whether two stacks differed). A stack through the dispatch point is
    // cut there too (the loop's own stacks, e.g. its selector, only
    // down to the root they share with the rest).
    let mut root: HashMap<u32, (usize, Vec<Frame>, bool)> = HashMap::new();
    for s in out.iter() {
        for p in &s.stacks {
            // A stack with no code frame (`[on-cpu: between samples]`), or
            // whose unwinding stopped short of the thread's start (its
            // outermost frame unnamed: `[libcrypto.so.3+0x12d3d5]`,
            // `[truncated]`), says nothing of the root.
            if p.frames.first().is_some_and(|f| f.name.starts_with('['))
                || !p.frames.iter().any(|f| {
                    matches!(
                        f.kind,
                        FrameKind::Native | FrameKind::Python | FrameKind::Js
                    )
                })
            {
                continue;
            }
            let limit = aggregate::culprit(p, app)
                .and_then(|c| p.frames.iter().position(|f| std::ptr::eq(f, c)))
                .unwrap_or(usize::MAX)
                .min(p.frames.len().saturating_sub(1));
            match root.get_mut(&s.tid) {
                None => {
                    root.insert(s.tid, (limit, p.frames.clone(), false));
                }
                Some((n, first, differed)) => {
                    *differed |= *first != p.frames;
                    *n = first
                        .iter()
                        .zip(&p.frames)
                        .take((*n).min(limit))
                        .take_while(|(a, b)| a == b)
                        .count();
                }
            }
        }
    }
    for s in out.iter_mut() {
        let (shared, prefix): (usize, &[Frame]) = match root.get(&s.tid) {
            // One stack alone shows no root to share: keep it whole.
            Some((n, first, true)) => (*n, &first[..*n]),
            _ => (0, &[]),
        };
        for p in s.stacks.iter_mut() {
            // A stack through the loop's dispatch is cut there, and past
            // it down to the handler ([`trim_dispatch`]): cut at the
            // shared root first, it would have lost the dispatch that
            // tells where the framework's frames end.
            if loop_end(&p.frames, app) == 0
                && p.frames.len() > shared
                && p.frames.starts_with(prefix)
            {
                p.frames.drain(..shared);
            }
            trim_dispatch(&mut p.frames, app);
        }
    }
}

/// The stalls as `stalls.folded` and `stalls.svg` show them: in `view`,
/// grouped as it says ([`grouped`]) and with their processes at the root
/// ([`with_processes`]).
pub fn shown(rec: &Recording, view: View) -> Vec<Stall> {
    let stalls = apply(&rec.stalls, view, &rec.app());
    with_processes(grouped(stalls, view.group_by), rec)
}

/// The stalls with each stack rooted in its group (`--group-by`): its
/// asyncio task's coroutine (`task Gateway.handle_request`: the
/// coroutine, not the Task's name, so a server's per-connection tasks
/// `Task-7`, `Task-9` … running one handler are one tower; the Task's
/// name when the coroutine is unknown, `task "janitor"`) or its ASGI
/// route (`route POST /resume/{rid}`); `[no task]`, `[no route]` when the
/// stall has none. A [`FrameKind::Group`] frame. Without a grouping the
/// stalls are left as they are: the task and route are labels
/// (`stalls.pb.gz`) and attributes (the timelines), never frames.
pub fn grouped(mut stalls: Vec<Stall>, by: Option<GroupBy>) -> Vec<Stall> {
    let Some(by) = by else { return stalls };
    for s in stalls.iter_mut() {
        let name = match by {
            GroupBy::Task => match (s.coroutine_name(), &s.task) {
                (Some(c), _) => format!("task {c}"),
                (None, Some(t)) => match &t.coro {
                    Some(c) => format!("task {c}"),
                    None => format!("task {:?}", t.name),
                },
                (None, None) => "[no task]".to_string(),
            },
            GroupBy::Route => match &s.route {
                Some(r) => format!("route {}", r.describe()),
                None => "[no route]".to_string(),
            },
        };
        let root = Frame::new(name, FrameKind::Group);
        for p in s.stacks.iter_mut() {
            p.frames.insert(0, root.clone());
        }
    }
    stalls
}

/// With stalls in more than one process ([`Recording::stalls_in_several_processes`]):
/// the stalls with their process as the root frame of each stack
/// (`uvicorn worker 2 (pid 1240)`, [`FrameKind::Process`]), so the graph
/// has one tower per process. The stalls of one process are left as they
/// are.
pub fn with_processes(mut stalls: Vec<Stall>, rec: &Recording) -> Vec<Stall> {
    if !rec.stalls_in_several_processes() {
        return stalls;
    }
    let roots: HashMap<u32, Frame> = rec
        .stall_pids()
        .into_iter()
        .map(|pid| {
            let title = match rec.process_of(pid) {
                Some(p) => p.title(),
                None => format!("pid {pid}"),
            };
            (pid, Frame::new(title, FrameKind::Process))
        })
        .collect();
    for s in stalls.iter_mut() {
        let root = &roots[&s.pid];
        for p in s.stacks.iter_mut() {
            p.frames.insert(0, root.clone());
        }
    }
    stalls
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::PartKind;
    use crate::testing;

    fn n(name: &str, module: &str) -> Frame {
        Frame {
            module: Some(module.into()),
            ..Frame::new(name, FrameKind::Native)
        }
    }
    fn py(name: &str) -> Frame {
        Frame {
            file: Some("/app/gw.py".into()),
            line: Some(7),
            ..Frame::new(name, FrameKind::Python)
        }
    }
    fn stall(tid: u32, stacks: Vec<Vec<Frame>>) -> Stall {
        let parts = stacks
            .into_iter()
            .map(|frames| testing::part(PartKind::OnCpu, 5, frames))
            .collect();
        Stall {
            tid,
            end_ns: 10,
            duration_ns: 10,
            on_cpu_ns: 10,
            ..testing::stall(0, parts)
        }
    }
    fn names(s: &Stall, i: usize) -> Vec<&str> {
        s.stacks[i].frames.iter().map(|f| f.name.as_str()).collect()
    }

    /// `_start -> Py_RunMain -> eval[run_forever, Handle._run] -> context_run
    ///  -> task_step -> eval[handle, compress] -> zlib_compress -> deflate`
    fn asyncio_stack(step: &str, ext: &[(&str, &str)]) -> Vec<Frame> {
        let mut v = vec![
            n("_start", "python3.11"),
            n("__libc_start_main_impl", "libc.so.6"),
            n("main", "python3.11"),
            n("Py_RunMain", "python3.11"),
            n("pymain_run_python", "python3.11"),
            py("BaseEventLoop.run_forever"),
            n("_PyEval_EvalFrameDefault", "python3.11"),
            py("Handle._run"),
            n("context_run", "python3.11"),
            n("task_step", "_asyncio.cpython-311-x86_64-linux-gnu.so"),
            n("_PyObject_VectorcallTstate", "python3.11"),
            py("handle_request"),
            py(step),
            n("method_vectorcall_O", "python3.11"),
        ];
        v.extend(ext.iter().map(|(f, m)| n(f, m)));
        v
    }

    #[test]
    fn interpreter_folded_extensions_kept_root_trimmed() {
        let zlib = [
            (
                "zlib_Compress_compress",
                "zlib.cpython-311-x86_64-linux-gnu.so",
            ),
            ("deflate", "libz.so.1"),
        ];
        let stalls = vec![stall(
            1,
            vec![asyncio_stack("Gateway.compress_payload", &zlib)],
        )];
        let v = apply(&stalls, View::default(), &AppPaths::default());
        assert_eq!(
            names(&v[0], 0),
            [
                "handle_request",
                "Gateway.compress_payload",
                "zlib_Compress_compress",
                "deflate"
            ]
        );
        let all = apply(&stalls, View::ALL, &AppPaths::default());
        assert_eq!(all, stalls);
        // The loop's own stack (its selector) loses the root it shares
        // with the callbacks' stacks, no more.
        let selector = vec![
            n("_start", "python3.11"),
            n("Py_RunMain", "python3.11"),
            py("BaseEventLoop.run_forever"),
            py("BaseEventLoop._run_once"),
            py("EpollSelector.select"),
            n("epoll_wait", "libc.so.6"),
        ];
        let stalls = vec![stall(
            1,
            vec![asyncio_stack("Gateway.compress_payload", &zlib), selector],
        )];
        let v = apply(&stalls, View::default(), &AppPaths::default());
        assert_eq!(
            names(&v[0], 0)[..2],
            ["handle_request", "Gateway.compress_payload"]
        );
        assert_eq!(
            names(&v[0], 1),
            [
                "BaseEventLoop._run_once",
                "EpollSelector.select",
                "epoll_wait"
            ]
        );
    }

    #[test]
    fn the_module_decides_not_the_name() {
        // A C extension's own `_PyEval_something` is not the interpreter's.
        let stalls = vec![stall(
            1,
            vec![vec![
                py("f"),
                n("_PyEval_EvalFrameDefault", "python3.11"),
                n("_PyEval_helper", "myext.so"),
            ]],
        )];
        assert_eq!(
            names(&apply(&stalls, View::default(), &AppPaths::default())[0], 0),
            ["f", "_PyEval_helper"]
        );
        // Finalization runs no Python code: still the interpreter's.
        let stalls = vec![stall(
            1,
            vec![vec![
                n("_start", "python3.11"),
                n("Py_RunMain", "python3.11"),
                n("Py_FinalizeEx", "python3.11"),
                n("gc_collect_main", "python3.11"),
            ]],
        )];
        assert_eq!(
            names(&apply(&stalls, View::default(), &AppPaths::default())[0], 0),
            ["Py_FinalizeEx", "gc_collect_main"]
        );
        // No Python frame: a native program keeps its frames.
        let stalls = vec![stall(1, vec![vec![n("_start", "app"), n("main", "app")]])];
        assert_eq!(
            names(&apply(&stalls, View::default(), &AppPaths::default())[0], 0),
            ["_start", "main"]
        );
    }

    #[test]
    fn a_rust_workers_shared_root_stops_at_the_apps_function_not_inlined_std() {
        // A tokio worker that ran only the spinning task: its stacks
        // differ only in the inlined core method under the app's function.
        let src = |name: &str, file: &str| Frame {
            file: Some(file.into()),
            line: Some(3),
            ..n(name, "victim")
        };
        let core = "/rustc/5980761/library/core/src/num/uint_macros.rs";
        let root = || {
            vec![
                n("_start", "victim"),
                src(
                    "tokio::runtime::task::harness::Harness<T,S>::poll",
                    "/r/tokio/src/harness.rs",
                ),
                src("victim::stall_task::{{closure}}", "/srv/victim/src/main.rs"),
                src("victim::cpu_spin", "/srv/victim/src/main.rs"),
            ]
        };
        let a = [root(), vec![src("<u64>::wrapping_add", core)]].concat();
        let b = [root(), vec![src("<u64>::wrapping_mul", core)]].concat();
        let v = apply(
            &[stall(1, vec![a, b])],
            View::default(),
            &AppPaths::default(),
        );
        assert_eq!(names(&v[0], 0), ["victim::cpu_spin", "<u64>::wrapping_add"]);
        assert_eq!(names(&v[0], 1), ["victim::cpu_spin", "<u64>::wrapping_mul"]);
    }

    #[test]
    fn c_loop_root_shared_by_every_stack_is_trimmed_short_of_the_culprit() {
        let c = |name: &str| Frame {
            file: Some("loop.c".into()),
            line: Some(3),
            ..n(name, "c_loop")
        };
        let root = || vec![n("_start", "c_loop"), c("main"), c("run_loop")];
        let a = [root(), vec![c("handle"), c("spin")]].concat();
        let b = [root(), vec![c("handle"), c("parse")]].concat();
        let other_thread = [root(), vec![c("handle")]].concat();
        let between = vec![Frame::marker("[on-cpu: between samples]")];
        let cut_short = vec![n("[libx.so+0x10]", "libx.so"), c("handle"), c("spin")];
        let stalls = vec![
            stall(1, vec![a, b, between.clone(), cut_short.clone()]),
            stall(2, vec![other_thread.clone()]),
        ];
        // With lines, to compare whole frames.
        let lines = View {
            lines: true,
            ..View::default()
        };
        let v = apply(&stalls, lines, &AppPaths::default());
        assert_eq!(names(&v[0], 0), ["spin"]);
        assert_eq!(names(&v[0], 1), ["parse"]);
        // A part without code frames neither stops the trim nor is cut.
        assert_eq!(v[0].stacks[2].frames, between);
        // Nor does a stack whose unwinding stopped short of the start.
        assert_eq!(v[0].stacks[3].frames, cut_short);
        // A thread with one stack has no root to tell apart: kept whole.
        assert_eq!(v[1].stacks[0].frames, other_thread);
        // Weights are untouched.
        assert_eq!(v[0].stacks[0].weight_ns, 5);
    }

    /// Issue 37: the task and route are no frames by default (they were a
    /// `[task NAME]` leaf on top of every stack, half the frames of a
    /// demo); `--group-by` roots each stack in its task's coroutine or
    /// its route instead.
    #[test]
    fn the_task_is_a_root_only_when_grouped_issue_37() {
        let mut a = stall(
            1,
            vec![vec![py("handle"), py("crunch")], vec![py("handle")]],
        );
        a.task = Some(crate::model::Task {
            name: "conn;7".into(),
            coro: Some("handle".into()),
            awaited_by: vec![],
            ..Default::default()
        });
        // The line where the task was read, not the samples' (7).
        a.coroutine = Some("handle (gw.py:99)".into());
        a.route = Some(crate::model::Route {
            method: "POST".into(),
            template: "/resume/{rid}".into(),
        });
        let mut b = stall(1, vec![vec![py("tick")]]);
        b.task = Some(crate::model::Task {
            name: "janitor".into(),
            coro: None,
            awaited_by: vec![],
            ..Default::default()
        });
        let c = stall(1, vec![vec![py("idle")]]);
        // A coroutine with no frame in the stacks: its label's name.
        let d = Stall {
            coroutine: Some("Server.serve (srv.py:12)".into()),
            ..stall(1, vec![vec![py("tick")]])
        };
        let stalls = vec![a, b, c, d];
        let plain = grouped(stalls.clone(), None);
        assert_eq!(plain, stalls, "no grouping, no frame");
        let by_task = grouped(stalls.clone(), Some(GroupBy::Task));
        assert_eq!(names(&by_task[0], 0), ["task handle", "handle", "crunch"]);
        assert_eq!(names(&by_task[0], 1), ["task handle", "handle"]);
        assert_eq!(by_task[0].stacks[0].frames[0].kind, FrameKind::Group);
        assert_eq!(names(&by_task[1], 0), ["task \"janitor\"", "tick"]);
        assert_eq!(names(&by_task[2], 0), ["[no task]", "idle"]);
        assert_eq!(names(&by_task[3], 0), ["task Server.serve", "tick"]);
        let by_route = grouped(stalls, Some(GroupBy::Route));
        assert_eq!(
            names(&by_route[0], 0),
            ["route POST /resume/{rid}", "handle", "crunch"]
        );
        assert_eq!(names(&by_route[1], 0), ["[no route]", "tick"]);
        let lines = aggregate::folded_lines(&by_task);
        assert!(
            lines
                .iter()
                .any(|l| l == "task handle;handle (gw.py:7);crunch (gw.py:7) 1"),
            "{lines:?}"
        );
    }

    /// Issue 37: a frame per function unless `--lines`; no frame without
    /// a name; the summary's culprit keeps its line.
    #[test]
    fn one_frame_per_function_unless_lines_issue_37() {
        let at = |line| Frame {
            line: Some(line),
            ..py("Gateway.handle_request")
        };
        let unnamed = Frame {
            module: Some("libfoo.so".into()),
            ..Frame::new("", FrameKind::Native)
        };
        let stalls = vec![stall(
            1,
            vec![vec![at(144), unnamed.clone()], vec![at(145), unnamed]],
        )];
        let nowhere = stall(1, vec![vec![Frame::new("", FrameKind::Python)]]);
        assert_eq!(
            names(
                &apply(&[nowhere], View::default(), &AppPaths::default())[0],
                0
            ),
            ["[unnamed python frame]"]
        );
        let merged =
            aggregate::folded_lines(&apply(&stalls, View::default(), &AppPaths::default()));
        assert_eq!(merged, ["Gateway.handle_request (gw.py);[libfoo.so] 1"]);
        let lines = View {
            lines: true,
            ..View::default()
        };
        let apart = aggregate::folded_lines(&apply(&stalls, lines, &AppPaths::default()));
        assert_eq!(
            apart,
            [
                "Gateway.handle_request (gw.py:144);[libfoo.so] 1",
                "Gateway.handle_request (gw.py:145);[libfoo.so] 1"
            ]
        );
        // `--native all` names the unnamed frame too, and merges lines.
        let all = View {
            native: Native::All,
            ..View::default()
        };
        assert_eq!(
            aggregate::folded_lines(&apply(&stalls, all, &AppPaths::default())),
            merged
        );
        let alone = stall(1, vec![vec![at(144)], vec![at(145)]]);
        let summary = aggregate::summarize(&Recording::for_tests(vec![alone]), 5);
        let culprits: Vec<&str> = summary.culprits.iter().map(|c| c.label.as_str()).collect();
        assert_eq!(
            culprits,
            [
                "Gateway.handle_request (gw.py:144) — on-CPU",
                "Gateway.handle_request (gw.py:145) — on-CPU"
            ]
        );
    }

    /// Rust and C++ names as demangled (rustc-demangle, the C++ ABI's
    /// demangler): the generic arguments go, the path and the qualified
    /// type stay.
    #[test]
    fn native_names_shortened_generics_elided_issue_37() {
        let cases = [
            (
                "pyo3::impl_::trampoline::fastcall_cfunction_with_keywords::<<pyo3::pycell::PyCell<tokenizers::tokenizer::PyTokenizer>>::try_from::{closure#0}, tokenizers::models::PyModel, tokenizers::normalizers::PyNormalizer, tokenizers::decoders::PyDecoder>",
                "pyo3::impl_::trampoline::fastcall_cfunction_with_keywords::<…>",
            ),
            (
                "tokio::runtime::task::harness::Harness<T,S>::poll",
                "tokio::runtime::task::harness::Harness<…>::poll",
            ),
            (
                "<tokio::runtime::blocking::task::BlockingTask<T> as core::future::future::Future>::poll",
                "<tokio::runtime::blocking::task::BlockingTask<…> as core::future::future::Future>::poll",
            ),
            (
                "<impl core::ops::drop::Drop for tokenizers::utils::Cache<K, V>>::drop",
                "<impl core::ops::drop::Drop for tokenizers::utils::Cache<…>>::drop",
            ),
            (
                "<alloc::vec::Vec<T> as pyo3::conversion::IntoPy<pyo3::Py<pyo3::types::any::PyAny>>>::into_py",
                "<alloc::vec::Vec<…> as pyo3::conversion::IntoPy<…>>::into_py",
            ),
            (
                "tokenizers::tokenizer::TokenizerImpl<M,N,PT,PP,D>::encode_batch::{{closure}}",
                "tokenizers::tokenizer::TokenizerImpl<…>::encode_batch::{{closure}}",
            ),
            ("<<A as B>::C as D>::f", "<<A as B>::C as D>::f"),
            (
                "core::ptr::drop_in_place<alloc::string::String>::h0123456789abcdef",
                "core::ptr::drop_in_place<…>",
            ),
            (
                "std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(__gnu_cxx::__normal_iterator<int*, std::vector<int, std::allocator<int> > >, int const&)",
                "std::vector<…>::_M_realloc_insert<…>(__gnu_cxx::__normal_iterator<…>, int const&)",
            ),
            (
                "std::operator<< <std::char_traits<char> >(std::basic_ostream<char, std::char_traits<char> >&, char const*)",
                "std::operator<< <std::char_traits<…> >(std::basic_ostream<…>&, char const*)",
            ),
            ("Foo::operator->() const", "Foo::operator->() const"),
            (
                "bool operator<(Foo const&, Foo const&)",
                "bool operator<(Foo const&, Foo const&)",
            ),
            ("<u64>::wrapping_add", "<u64>::wrapping_add"),
            ("deflate", "deflate"),
            (
                "victim::stall_task::{{closure}}",
                "victim::stall_task::{{closure}}",
            ),
            ("broken<a", "broken<a"),
            ("broken>a", "broken>a"),
        ];
        for (full, short) in cases {
            assert_eq!(short_name(full), short, "{full}");
        }
        // In the default view only, on native frames only; --native all
        // and stalls.json keep the full name.
        let rust = "tokio::runtime::task::harness::Harness<T,S>::poll";
        let stalls = vec![stall(1, vec![vec![n(rust, "victim"), py("<module>")]])];
        let v = apply(&stalls, View::default(), &AppPaths::default());
        assert_eq!(
            names(&v[0], 0),
            [
                "tokio::runtime::task::harness::Harness<…>::poll",
                "<module>"
            ]
        );
        let all = View {
            native: Native::All,
            ..View::default()
        };
        assert_eq!(
            names(&apply(&stalls, all, &AppPaths::default())[0], 0)[0],
            rust
        );
    }

    /// Issue 37: an aiohttp handler in two towers, one under its task's
    /// eager start (`RequestHandler.start → type_call →
    /// _asyncio_Task___init__ → task_eager_start → …`), the other under
    /// the loop's dispatch. The eager start is trimmed as the dispatch
    /// is, so the two merge; a task the app's own code started eagerly
    /// keeps its creator.
    #[test]
    fn a_tasks_eager_start_is_trimmed_like_the_dispatch_issue_37() {
        let aio = "_asyncio.cpython-312-x86_64-linux-gnu.so";
        let site = "/venv/lib/python3.12/site-packages/aiohttp";
        let dispatch = || {
            vec![
                n("_start", "python3.12"),
                n("Py_RunMain", "python3.12"),
                lib_py(
                    "BaseEventLoop.run_forever",
                    "/usr/lib/python3.12/asyncio/base_events.py",
                ),
                lib_py("Handle._run", "/usr/lib/python3.12/asyncio/events.py"),
                n("context_run", "python3.12"),
                n("task_step", aio),
            ]
        };
        let handler = || vec![py("handle_upload"), py("parse_csv")];
        let mut later = dispatch();
        later.push(lib_py(
            "RequestHandler._handle_request",
            &format!("{site}/web_protocol.py"),
        ));
        later.extend(handler());
        let mut eager = dispatch();
        eager.extend([
            lib_py("RequestHandler.start", &format!("{site}/web_protocol.py")),
            n("_PyObject_MakeTpCall", "python3.12"),
            n("type_call", "python3.12"),
            n("_asyncio_Task___init__", aio),
            n("_asyncio_Task___init___impl", aio),
            n("task_eager_start", aio),
            n("task_step_impl", aio),
            lib_py(
                "RequestHandler._handle_request",
                &format!("{site}/web_protocol.py"),
            ),
        ]);
        eager.extend(handler());
        let stalls = vec![stall(1, vec![later.clone(), eager.clone()])];
        let v = apply(&stalls, View::default(), &AppPaths::default());
        assert_eq!(names(&v[0], 0), ["handle_upload", "parse_csv"]);
        assert_eq!(names(&v[0], 1), ["handle_upload", "parse_csv"]);
        // Without an app frame (all of it a library's): both start at the
        // task's coroutine, not at `RequestHandler.start`.
        let lib = AppPaths::new(&["/nowhere/".to_string()]);
        let v = apply(&stalls, View::default(), &lib);
        assert_eq!(names(&v[0], 0)[0], "RequestHandler._handle_request");
        assert_eq!(names(&v[0], 1)[0], "RequestHandler._handle_request");
        assert_eq!(names(&v[0], 0), names(&v[0], 1));
        // The app's own code started the task eagerly: it stays.
        let mut own = dispatch();
        own.extend([
            py("schedule_jobs"),
            n("_asyncio_Task___init__", aio),
            n("task_eager_start", aio),
            py("job"),
        ]);
        let v = apply(
            &[stall(1, vec![own, later])],
            View::default(),
            &AppPaths::default(),
        );
        assert_eq!(
            names(&v[0], 0),
            [
                "schedule_jobs",
                "_asyncio_Task___init__",
                "task_eager_start",
                "job"
            ]
        );
    }

    fn lib_py(name: &str, file: &str) -> Frame {
        Frame {
            file: Some(file.into()),
            line: Some(9),
            ..Frame::new(name, FrameKind::Python)
        }
    }

    /// Issue 19's flake: a sample taken inside asyncio's `Handle._run`
    /// itself (its innermost Python frame, the rest folded away) kept
    /// `Handle._run` in the default view, depending on which other stacks
    /// the thread had. Now a stack that ends in the dispatch is one
    /// `[event loop]` frame whatever else the recording holds.
    #[test]
    fn a_sample_inside_the_dispatch_is_the_event_loop_issue_19() {
        let events = "/usr/lib/python3.11/asyncio/events.py";
        let inside = || {
            vec![
                n("_start", "python3.11"),
                n("Py_RunMain", "python3.11"),
                lib_py(
                    "BaseEventLoop.run_forever",
                    "/usr/lib/python3.11/asyncio/base_events.py",
                ),
                lib_py("Handle._run", events),
                n("context_run", "python3.11"),
            ]
        };
        let handler = || {
            let mut v = inside();
            v.push(py("handle_request"));
            v
        };
        // Alone, with a handler's stack, and with an off-CPU marker: the
        // same answer each time (before the fix it depended on the others).
        for others in [vec![], vec![handler()]] {
            let mut stacks = vec![inside()];
            stacks.extend(others);
            let v = apply(&[stall(1, stacks)], View::default(), &AppPaths::default());
            assert_eq!(names(&v[0], 0), ["[event loop]"]);
            assert_eq!(v[0].stacks[0].frames[0].kind, FrameKind::EventLoop);
        }
        let mut blocked = inside();
        blocked.push(Frame {
            ..Frame::new("do_syscall_64", FrameKind::Kernel)
        });
        blocked.push(Frame::marker("[off-cpu: read]"));
        let v = apply(
            &[stall(1, vec![blocked])],
            View::default(),
            &AppPaths::default(),
        );
        assert_eq!(
            names(&v[0], 0),
            ["[event loop]", "do_syscall_64", "[off-cpu: read]"]
        );
    }

    /// uvloop (Cython + libuv) under uvicorn and FastAPI, as recorded: the
    /// default view starts at the handler; a sample in libuv's own poll is
    /// `[event loop]`.
    #[test]
    fn uvloop_dispatch_and_the_framework_trimmed_to_the_handler() {
        let so = "loop.cpython-311-x86_64-linux-gnu.so";
        let aio = "_asyncio.cpython-311-x86_64-linux-gnu.so";
        let site = "/venv/lib/python3.11/site-packages";
        let root = || {
            vec![
                n("_start", "python3.11"),
                n("Py_BytesMain", "libpython3.11.so.1.0"),
                py("<module>"),
                lib_py("Server.run", &format!("{site}/uvicorn/server.py")),
                lib_py("Runner.run", "/usr/lib/python3.11/asyncio/runners.py"),
                n("_PyObject_VectorcallTstate", "libpython3.11.so.1.0"),
                n("__pyx_pw_6uvloop_4loop_4Loop_45run_until_complete", so),
                n("PyObject_VectorcallMethod", "libpython3.11.so.1.0"),
                n("__pyx_f_6uvloop_4loop_4Loop__run", so),
                n("uv_run", so),
            ]
        };
        let mut handler = root();
        handler.extend([
            n("uv__run_idle", so),
            n("__pyx_f_6uvloop_4loop_cb_idle_callback", so),
            n("__pyx_f_6uvloop_4loop_6Handle__run", so),
            n("__Pyx_PyObject_Call", so),
            n("TaskStepMethWrapper_call", aio),
            n("task_step", aio),
            n("gen_send_ex2", "libpython3.11.so.1.0"),
            lib_py(
                "RequestResponseCycle.run_asgi",
                &format!("{site}/uvicorn/protocols/http/httptools_impl.py"),
            ),
            lib_py("Router.__call__", &format!("{site}/starlette/routing.py")),
            lib_py(
                "run_endpoint_function",
                &format!("{site}/fastapi/routing.py"),
            ),
            py("parse_resume"),
            lib_py("PageObject.extract_text", &format!("{site}/pypdf/_page.py")),
        ]);
        let mut poll = root();
        poll.extend([n("uv__io_poll", so), n("uv__epoll_ctl_flush", so)]);
        let mut framework = root();
        framework.extend([
            n("uv__io_poll", so),
            n("uv__stream_io", so),
            n("__pyx_f_6uvloop_4loop_9UVStream__on_read", so),
            lib_py(
                "HttpToolsProtocol.data_received",
                &format!("{site}/uvicorn/protocols/http/httptools_impl.py"),
            ),
        ]);
        // A task step whose Python frames could not be read (seen once on
        // a fresh clone): still the interpreter's, the dispatch goes.
        let mut unread: Vec<Frame> = root()
            .into_iter()
            .filter(|f| f.kind != FrameKind::Python)
            .collect();
        unread.extend([
            n("uv__run_idle", so),
            n("__pyx_f_6uvloop_4loop_6Handle__run", so),
            n("TaskStepMethWrapper_call", aio),
            n("bytes_decode", "libpython3.11.so.1.0"),
            Frame::unknown_python(),
        ]);
        let stalls = vec![stall(1, vec![handler, poll, framework, unread])];
        let v = apply(&stalls, View::default(), &AppPaths::default());
        assert_eq!(names(&v[0], 0), ["parse_resume", "PageObject.extract_text"]);
        assert_eq!(names(&v[0], 1), ["[event loop]"]);
        assert_eq!(names(&v[0], 2), ["HttpToolsProtocol.data_received"]);
        assert_eq!(
            names(&v[0], 3),
            ["bytes_decode", crate::model::UNKNOWN_PYTHON]
        );
        // --native all keeps it all.
        assert_eq!(apply(&stalls, View::ALL, &AppPaths::default()), stalls);
        // Native frames not unwound (a truncated stack copy): uvloop shows
        // only as asyncio's `Runner.run` before the task's Python frames;
        // still trimmed to the handler, which is still the entry.
        let bare = vec![
            py("<module>"),
            lib_py("Runner.run", "/usr/lib/python3.11/asyncio/runners.py"),
            lib_py(
                "RequestResponseCycle.run_asgi",
                &format!("{site}/uvicorn/protocols/http/httptools_impl.py"),
            ),
            py("parse_resume"),
            lib_py("PageObject.extract_text", &format!("{site}/pypdf/_page.py")),
        ];
        let stalls = vec![stall(1, vec![bare])];
        let v = apply(&stalls, View::default(), &AppPaths::default());
        assert_eq!(names(&v[0], 0), ["parse_resume", "PageObject.extract_text"]);
        assert_eq!(
            aggregate::stall_entry(&stalls[0], &AppPaths::default()).as_deref(),
            Some("parse_resume (gw.py)")
        );
    }

    /// Stalls in two processes: every stack rooted in its process, in
    /// `stalls.folded` and `stalls.svg` alike; a recording of one process
    /// shows none.
    #[test]
    fn a_root_frame_per_process_only_among_several() {
        let rec = testing::two_workers();
        let lines = aggregate::folded_lines(&shown(&rec, View::ALL));
        assert_eq!(
            lines,
            [
                "uvicorn worker 1 (pid 1210);main;spin 30000",
                "uvicorn worker 2 (pid 1220);main;nap 20000",
            ]
        );
        let svg =
            String::from_utf8(crate::report::flamegraph::render(&rec, View::ALL).unwrap()).unwrap();
        for root in ["uvicorn worker 1 (pid 1210)", "uvicorn worker 2 (pid 1220)"] {
            assert!(svg.contains(root), "{root} not in the SVG");
        }
        // One process: the same stalls, no root, whatever its role.
        let mut one = rec.clone();
        one.stalls.retain(|s| s.pid == 1220);
        assert_eq!(
            aggregate::folded_lines(&shown(&one, View::ALL)),
            ["main;nap 20000"]
        );
        let svg =
            String::from_utf8(crate::report::flamegraph::render(&one, View::ALL).unwrap()).unwrap();
        assert!(!svg.contains("(pid 1220)"), "{svg}");
    }
}
