//! What a frame is, by its name, module and file: the one place every
//! name-based rule lives, so that adding one runtime's machinery touches
//! this file only.
//!
//! In: a [`Frame`] (and the recording's `--app-path` prefixes). Out:
//! - whose code it is: the application's ([`AppPaths::is_app`]) or which
//!   library's ([`AppPaths::library`]);
//! - the interpreter's own machinery ([`is_interpreter_frame`]: CPython's
//!   eval, call and start-up frames) and its eval loop
//!   ([`is_eval_frame`]: where Python frames are merged into native ones);
//! - the event loop's: its dispatch to a callback ([`is_dispatch_frame`]),
//!   its run ([`work_start`]), uvloop/libuv machinery
//!   ([`is_loop_machinery`]), asyncio's task step ([`is_task_step`]);
//! - the means of blocking, never the culprit: the C runtime
//!   ([`is_system_lib`]), Rust's standard library and async runtimes
//!   ([`is_runtime_frame`]), Node's own JavaScript
//!   ([`is_node_internal_js`]).
//!
//! The symbolizer (a task's coroutine, merging Python frames), the culprit
//! and entry rules (`report::aggregate`) and the default view
//! (`report::view`) ask here; nothing else decides it.
//!
//! App or library: the guess, by the path the runtime reports for the code (a Python code
//! object's file, a JavaScript script's name):
//! - **library**: the runtime's standard library (a path under
//!   `…/lib/pythonX.Y/` or `…/lib64/pythonX.Y/`, frozen and generated code
//!   such as `<frozen importlib._bootstrap>` and dataclasses' `<string>`;
//!   Node's `node:` modules and builtins without a script), installed
//!   packages (`site-packages`, `dist-packages`, `node_modules`), and
//!   every native frame (the interpreter, libpython, C extensions, libc);
//! - **app**: every other Python or JavaScript frame.
//!
//! Native frames are never the app's here: a native program's own code is
//! found by the older rule the culprit falls back to when a stack has no
//! app frame. Where the guess is wrong (an app installed into
//! site-packages, a library vendored into the app's tree) `--app-path
//! PREFIX` (repeatable; the daemon's `app_paths`) replaces it: then a
//! Python or JavaScript frame is the app's exactly when its file starts
//! with one of the prefixes.
use crate::model::{Frame, FrameKind};

impl crate::model::Recording {
    /// Which frames are the application's in this recording (its
    /// `app_paths`, else the guess).
    pub fn app(&self) -> AppPaths {
        AppPaths::new(&self.app_paths)
    }
}

/// Which code is the application's: the guess, or the user's prefixes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AppPaths {
    prefixes: Vec<String>,
}

impl AppPaths {
    /// `prefixes` empty: the guess (module docs).
    pub fn new(prefixes: &[String]) -> AppPaths {
        AppPaths {
            prefixes: prefixes.to_vec(),
        }
    }

    /// The source path of an interpreted frame: a Python or JavaScript
    /// frame's file, or the script of a perf map's JavaScript entry
    /// (`JS:*deriveKey /srv/app.js:11:19`).
    fn script(f: &Frame) -> Option<&str> {
        match f.kind {
            FrameKind::Python | FrameKind::Js => f.file.as_deref(),
            FrameKind::Native if is_perf_map_js(f) => f.name.rsplit_once(' ').map(|(_, path)| path),
            _ => None,
        }
    }

    /// Is this frame the application's own code?
    pub fn is_app(&self, f: &Frame) -> bool {
        let Some(file) = Self::script(f) else {
            return false;
        };
        if !self.prefixes.is_empty() {
            return self.prefixes.iter().any(|p| file.starts_with(p.as_str()));
        }
        library_of_path(file).is_none()
    }

    /// The library a non-app frame belongs to, as the user names it:
    /// `pypdf`, `requests`, `json` (the standard library's module),
    /// `express`, `node:internal/crypto/pbkdf2`, `libz` (a native frame's
    /// object file); None for the interpreter's own native code (its
    /// function name says enough: `time_sleep`) and for frames without a
    /// file.
    pub fn library(&self, f: &Frame) -> Option<String> {
        if self.is_app(f) {
            return None;
        }
        if let Some(file) = Self::script(f) {
            return library_of_path(file).or_else(|| {
                // Outside the user's prefixes but not a known library
                // layout: its file's name.
                let base = file.rsplit('/').next().unwrap_or(file);
                Some(base.trim_end_matches(".py").to_string())
            });
        }
        let module = f.module.as_deref()?;
        if f.kind != FrameKind::Native || is_interpreter_module(module) {
            return None;
        }
        Some(module.split('.').next().unwrap_or(module).to_string())
    }
}

/// A JavaScript function named by a perf map (`--perf-basic-prof`):
/// `JS:*parseBig /app/app.js:11:19` (`LazyCompile:`, `Function:` in older V8).
pub fn is_perf_map_js(f: &Frame) -> bool {
    f.kind == FrameKind::Native
        && f.module.as_deref() == Some("[jit]")
        && ["JS:", "LazyCompile:", "Function:"]
            .iter()
            .any(|p| f.name.starts_with(p))
}

/// The first path component after `marker` (`/x/site-packages/pypdf/_page.py`
/// → `pypdf`), a `.py` module's name without its suffix.
fn component_after<'a>(path: &'a str, marker: &str) -> Option<&'a str> {
    let i = path.rfind(marker)?;
    let rest = &path[i + marker.len()..];
    let first = rest.split('/').next().filter(|c| !c.is_empty())?;
    Some(first.strip_suffix(".py").unwrap_or(first))
}

/// The library a script path belongs to, None for the app's.
fn library_of_path(path: &str) -> Option<String> {
    if let Some(rest) = path.strip_prefix("node:") {
        return Some(format!("node:{rest}"));
    }
    if let Some(rest) = path.strip_prefix("<frozen ") {
        return Some(rest.trim_end_matches('>').to_string());
    }
    if path.starts_with('<') {
        // Generated code: dataclasses' and namedtuple's `<string>`.
        return Some(path.to_string());
    }
    if let Some(i) = path.rfind("/node_modules/") {
        let rest = &path[i + "/node_modules/".len()..];
        let mut parts = rest.split('/');
        let first = parts.next().unwrap_or("");
        return Some(match (first.starts_with('@'), parts.next()) {
            (true, Some(name)) => format!("{first}/{name}"),
            _ => first.to_string(),
        });
    }
    for marker in ["/site-packages/", "/dist-packages/"] {
        if let Some(c) = component_after(path, marker) {
            return Some(c.to_string());
        }
    }
    // The standard library: `…/lib/python3.11/json/decoder.py`.
    for lib in ["/lib/python", "/lib64/python"] {
        let mut from = 0;
        while let Some(i) = path[from..].find(lib) {
            let at = from + i + lib.len();
            let rest = &path[at..];
            let version_len = rest
                .find('/')
                .filter(|&n| n > 0 && rest[..n].chars().all(|c| c.is_ascii_digit() || c == '.'));
            if let Some(n) = version_len {
                let module = rest[n + 1..].split('/').next().unwrap_or("");
                return Some(module.strip_suffix(".py").unwrap_or(module).to_string());
            }
            from = at;
        }
    }
    None
}

/// A Cython function (`__pyx_f_6uvloop_4loop_6Handle__run`) or one of
/// Cython's call helpers (`__Pyx_PyObject_Call`).
fn is_cython(f: &Frame) -> bool {
    f.kind == FrameKind::Native && (f.name.starts_with("__pyx_") || f.name.starts_with("__Pyx_"))
}

/// libuv's own functions (`uv_run`, `uv__io_poll`, `uv__run_idle`), linked
/// into uvloop's extension or a shared libuv.
pub fn is_libuv(f: &Frame) -> bool {
    f.kind == FrameKind::Native && (f.name.starts_with("uv_") || f.name.starts_with("uv__"))
}

/// The point where a loop hands over to a callback: asyncio's
/// `Handle._run` (Python), uvloop's `Handle._run`/`TimerHandle._run`
/// (Cython: `__pyx_f_…Handle__run`).
pub fn is_dispatch_frame(f: &Frame) -> bool {
    match f.kind {
        FrameKind::Python => f.name == "Handle._run" || f.name.ends_with(".Handle._run"),
        FrameKind::Native => is_cython(f) && f.name.ends_with("Handle__run"),
        _ => false,
    }
}

/// Where a loop starts running: asyncio's `BaseEventLoop.run_forever`
/// and the standard library's calls into it (`asyncio.run`,
/// `Runner.run`, `run_until_complete`: in a stack whose native frames
/// could not be unwound, uvloop's run shows only as these), uvloop's
/// (`__pyx_…Loop_…run_forever`), libuv's `uv_run`.
fn is_loop_run_frame(f: &Frame) -> bool {
    match f.kind {
        FrameKind::Python => {
            f.name.ends_with("EventLoop.run_forever")
                || (f.file.as_deref().is_some_and(|p| p.contains("/asyncio/"))
                    && matches!(
                        f.name.as_str(),
                        "run" | "Runner.run" | "BaseEventLoop.run_until_complete"
                    ))
        }
        FrameKind::Native => f.name == "uv_run" || (is_cython(f) && f.name.contains("run_forever")),
        _ => false,
    }
}

/// Where the program's own work starts in a stack: past the loop's last
/// dispatch point or, in a stack inside the loop that dispatched nothing
/// (its selector, its timers), past the loop itself; 0 for a stack with no
/// loop in it. Frames before it ran the loop (`<module>` → `main` →
/// `asyncio.run`): they are not what a callback's time is blamed on.
pub fn work_start(frames: &[Frame]) -> usize {
    frames
        .iter()
        .rposition(|f| is_dispatch_frame(f) || is_loop_run_frame(f))
        .map_or(0, |i| i + 1)
}

/// A frame of a Cython/libuv loop's machinery (uvloop): libuv, the
/// Cython functions and call helpers of the object file libuv is in
/// (`module_of_libuv`), and asyncio's C task stepping it calls into.
pub fn is_loop_machinery(f: &Frame, module_of_libuv: Option<&str>) -> bool {
    if is_libuv(f) {
        return true;
    }
    if is_cython(f) && module_of_libuv.is_some() && f.module.as_deref() == module_of_libuv {
        return true;
    }
    f.kind == FrameKind::Native
        && f.module
            .as_deref()
            .is_some_and(|m| m.starts_with("_asyncio"))
        && (f.name.starts_with("task_step") || f.name.starts_with("TaskStepMethWrapper"))
}

/// Is `module` the CPython interpreter: its shared library or an executable
/// with it linked in (`libpython3.11.so.1.0`, `python3.11`, `python3`)?
pub fn is_interpreter_module(module: &str) -> bool {
    module.starts_with("libpython") || module.starts_with("python")
}

/// CPython's eval loop, call dispatch and start-up, by name.
fn is_interpreter_machinery(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "_PyEval_",
        "PyEval_",
        "_PyObject_Vectorcall",
        "PyObject_Vectorcall",
        "_PyObject_Call",
        "PyObject_Call",
        "_PyObject_FastCall",
        "_PyObject_MakeTpCall",
        "_PyFunction_Vectorcall",
        "_PyVectorcall_",
        "PyVectorcall_",
        "_PyCFunction",
        "PyCFunction_Call",
        "cfunction_vectorcall",
        "cfunction_call",
        "method_vectorcall",
        "vectorcall_",
        "slot_tp_call",
        "Py_RunMain",
        "Py_BytesMain",
        "Py_Main",
        "pymain_",
        "_PyRun_",
        "PyRun_",
        "pyrun_",
        "run_mod",
        "run_eval_code_obj",
        "_PyGen_Send",
        "PyGen_am_send",
        "gen_send",
        "gen_iternext",
        "PyIter_Send",
        "context_run",
        "_PyContext_",
        "builtin_exec",
        "exec_code_in_module",
        "object_vacall",
        "function_code_fastcall",
        "call_function",
        "do_call_core",
    ];
    name == "main" || PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Is this native frame the interpreter's own, or process start-up?
pub fn is_interpreter_frame(f: &Frame) -> bool {
    if f.kind != FrameKind::Native {
        return false;
    }
    let module = f.module.as_deref().unwrap_or("");
    if f.name == "_start" || f.name.starts_with("__libc_start") {
        return true;
    }
    if module.starts_with("_asyncio") && f.name.starts_with("task_step") {
        return true;
    }
    is_interpreter_module(module) && is_interpreter_machinery(&f.name)
}

/// Glue between a call and the function called: the interpreter's call
/// machinery ([`is_interpreter_frame`], the type-call path a class
/// instantiation runs, `type_call`, `slot_tp_init`, …, and the C API the
/// eval loop runs bytecode through) and a binding
/// layer's trampolines (pyo3's `pyo3::impl_::trampoline::…`, its argument
/// extraction and conversions). Never the call the app made.
pub fn is_call_glue(f: &Frame) -> bool {
    if f.kind != FrameKind::Native {
        return false;
    }
    if is_interpreter_frame(f) {
        return true;
    }
    const TYPE_CALL: &[&str] = &[
        "type_call",
        "slot_tp_init",
        "slot_tp_new",
        "tp_new_wrapper",
        "wrap_init",
        "wrapper_call",
        "wrapperdescr_call",
        "method_vectorcall",
        "_PyStack_",
    ];
    let module = f.module.as_deref().unwrap_or("");
    // The C API (`PyObject_GetAttr`, `PyDict_GetItem`, …) under an app
    // frame is the interpreter running that frame's own bytecode, no call
    // the app made; a builtin module's functions (`time_sleep`) are not
    // named so.
    if is_interpreter_module(module)
        && (TYPE_CALL.iter().any(|p| f.name.starts_with(p))
            || f.name.starts_with("Py")
            || f.name.starts_with("_Py"))
    {
        return true;
    }
    let name = f.name.trim_start_matches('<');
    // Cython's runtime helpers (`__Pyx_PyObject_Call`,
    // `__Pyx_CyFunction_Vectorcall_…`): its calls and conversions.
    name.starts_with("pyo3::") || name.starts_with("pyo3_ffi::") || name.starts_with("__Pyx_")
}

/// The name the caller called, for a binding's entry point: pyo3's
/// `tokenizers::tokenizer::PyTokenizer::__pymethod_from_file__` is
/// `PyTokenizer.from_file`, `…::__pyfunction_encode` is `encode`;
/// Cython's `__pyx_pw_6uvloop_4loop_4Loop_31call_later` is
/// `uvloop.loop.Loop.call_later` ([`cython_called_name`]). None for any
/// other frame (its own name stands).
pub fn called_name(f: &Frame) -> Option<String> {
    if f.kind != FrameKind::Native {
        return None;
    }
    pyo3_called_name(&f.name).or_else(|| cython_called_name(&f.name))
}

/// A Cython function's Python name. Cython names a `def` function's
/// wrapper `__pyx_pw_` and its body `__pyx_pf_` followed by its scope's
/// names (module path, class), each as its length and itself and an `_`,
/// then the function's index among the scope's and its name
/// (`6uvloop_4loop_4Loop_` `31` `call_later`); a `cdef` function
/// `__pyx_f_` and the scope and its name (`6uvloop_4loop_6Handle_`
/// `_run`). None for another name, or one that does not split so.
fn cython_called_name(name: &str) -> Option<String> {
    let (rest, indexed) = if let Some(r) = name
        .strip_prefix("__pyx_pw_")
        .or_else(|| name.strip_prefix("__pyx_pf_"))
    {
        (r, true)
    } else {
        (name.strip_prefix("__pyx_f_")?, false)
    };
    let parts = cython_parts(rest, indexed, 0)?;
    (parts.len() >= 2).then(|| parts.join("."))
}

/// Scopes nested deeper than this are not split.
const MAX_CYTHON_SCOPES: usize = 16;

/// The parts of a Cython name after its prefix: each length-prefixed
/// scope, then the function's name (after its index when `indexed`).
fn cython_parts(s: &str, indexed: bool, depth: usize) -> Option<Vec<&str>> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    // A scope: its length, its name, `_`, and the rest.
    if digits > 0
        && depth < MAX_CYTHON_SCOPES
        && let Ok(n) = s[..digits].parse::<usize>()
        && let Some(scope) = s.get(digits..digits.saturating_add(n))
        && let Some(rest) = s.get(digits + n..).and_then(|r| r.strip_prefix('_'))
        && is_identifier(scope)
        && let Some(mut parts) = cython_parts(rest, indexed, depth + 1)
    {
        parts.insert(0, scope);
        return Some(parts);
    }
    // The function: its index (a `def`), then its name.
    let name = match (indexed, digits) {
        (true, 0) => return None,
        (true, d) => &s[d..],
        (false, 0) => s,
        (false, _) => return None,
    };
    is_identifier(name).then(|| vec![name])
}

fn is_identifier(s: &str) -> bool {
    let mut b = s.bytes();
    b.next()
        .is_some_and(|c| c == b'_' || c.is_ascii_alphabetic())
        && b.all(|c| c == b'_' || c.is_ascii_alphanumeric())
}

fn pyo3_called_name(name: &str) -> Option<String> {
    let (path, last) = name.rsplit_once("::")?;
    if let Some(m) = last
        .strip_prefix("__pymethod_")
        .and_then(|m| m.strip_suffix("__"))
    {
        // `__pymethod___new____` (a #[new]) is the type's constructor.
        let m = m.trim_start_matches("_");
        let ty = path.rsplit("::").next().unwrap_or(path);
        let m = if m.is_empty() || m == "new__" || m == "_new__" {
            "__new__"
        } else {
            m
        };
        return Some(format!("{ty}.{m}"));
    }
    last.strip_prefix("__pyfunction_").map(str::to_string)
}

/// The C runtime and the vDSO: their frames are the means of blocking
/// (`read`, `nanosleep`), never the culprit.
pub fn is_system_lib(f: &Frame) -> bool {
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
/// By name, and by source file for what the name does not tell: a
/// primitive type's method inlined into the app (`<u64>::wrapping_add`)
/// is named after the type but its file is the standard library's, as the
/// compiler's debug info gives it (`/rustc/<commit>/library/core/…`).
pub fn is_runtime_frame(f: &Frame) -> bool {
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
        || f.file
            .as_deref()
            .is_some_and(|file| file.starts_with("/rustc/"))
}

/// Node's own JavaScript (`node:internal/...`, `node:fs`): like libc, the
/// means, not the culprit.
pub fn is_node_internal_js(f: &Frame) -> bool {
    match f.kind {
        FrameKind::Js => f
            .file
            .as_deref()
            .is_none_or(|file| file.starts_with("node:")),
        _ => f.name.contains(" node:"),
    }
}

/// asyncio's task step, where a task's coroutine is resumed: the C
/// accelerator's `task_step`/`task_step_impl` (native), or the pure-Python
/// `Task.__step` (3.10's and a build without `_asyncio`).
/// JavaScript of the OpenTelemetry SDK or its instrumentations (an
/// express handler wrapped by `@opentelemetry/instrumentation-express`):
/// the process is traced, in a context stallprof does not read in Node.
pub fn is_otel_js(f: &Frame) -> bool {
    f.kind == FrameKind::Js
        && f.file
            .as_deref()
            .is_some_and(|p| p.contains("/node_modules/@opentelemetry/"))
}

pub fn is_task_step(f: &Frame) -> bool {
    (f.kind == FrameKind::Native && (f.name == "task_step" || f.name == "task_step_impl"))
        || (f.kind == FrameKind::Python && f.name.contains("Task.__step"))
}

/// A task's eager start (CPython 3.12+: `create_task(…, eager_start=True)`,
/// the eager task factory): the task's constructor runs the coroutine's
/// first step inside its caller, `_asyncio`'s `_asyncio_Task___init__`
/// (and its `_impl`) → `task_eager_start` → `task_step_impl`, or the
/// pure-Python `Task.__eager_start`. A start of the task's own stack, as
/// a step from the loop's dispatch is.
pub fn is_eager_task_start(f: &Frame) -> bool {
    match f.kind {
        FrameKind::Native => {
            f.module
                .as_deref()
                .is_some_and(|m| m.starts_with("_asyncio"))
                && (f.name.starts_with("_asyncio_Task___init__") || f.name == "task_eager_start")
        }
        FrameKind::Python => f.name.ends_with("Task.__eager_start"),
        _ => false,
    }
}

/// The native function that executes Python bytecode: each activation runs
/// one or more Python frames. (Its inline wrapper `_PyEval_EvalFrame`
/// shows up as an inlined frame of the caller and must not count twice.)
pub fn is_eval_frame(f: &Frame) -> bool {
    f.kind == FrameKind::Native && f.name == "_PyEval_EvalFrameDefault"
}

/// Entry points of CPython's cyclic garbage collector (3.10-3.13).
pub fn is_gc_frame(f: &Frame) -> bool {
    f.kind == FrameKind::Native
        && matches!(
            &*f.name,
            "collect_with_callback"
                | "collect_generations"
                | "gc_collect_main"
                | "gc_collect_with_callback"
                | "gc_collect_generations"
                | "gc_collect_region"
                | "gc_collect_full"
                | "gc_collect_young"
                | "gc_collect_increment"
                | "_PyGC_Collect"
                | "_Py_RunGC"
                | "PyGC_Collect"
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cython_names_split() {
        let n = |s: &str| cython_called_name(s);
        assert_eq!(
            n("__pyx_pw_6uvloop_4loop_4Loop_31call_later").as_deref(),
            Some("uvloop.loop.Loop.call_later")
        );
        assert_eq!(
            n("__pyx_pf_6uvloop_4loop_4Loop_30call_later").as_deref(),
            Some("uvloop.loop.Loop.call_later")
        );
        assert_eq!(
            n("__pyx_f_6uvloop_4loop_6Handle__run").as_deref(),
            Some("uvloop.loop.Handle._run")
        );
        // The index may read as a length: the split that parses wins.
        assert_eq!(
            n("__pyx_pw_5numpy_6random_13bit_generator_12BitGenerator_5random_raw").as_deref(),
            Some("numpy.random.bit_generator.BitGenerator.random_raw")
        );
        assert_eq!(
            n("__pyx_pw_4lxml_5etree_3get_x").as_deref(),
            Some("lxml.etree.get_x")
        );
        // Module-level def: the module and the function.
        assert_eq!(
            n("__pyx_pw_7fastmod_1parse").as_deref(),
            Some("fastmod.parse")
        );
        for bad in [
            "__pyx_pw_",
            "__pyx_pw_6uvloop",
            "__pyx_pw_99uvloop_1x",
            "__pyx_f_6uvloop_",
            "__pyx_tp_new_6uvloop_4loop_Loop",
            "__pyx_pw_6uvlo\u{e9}p_1x",
        ] {
            assert_eq!(n(bad), None, "{bad}");
        }
        let f = |name: &str| Frame {
            module: Some("loop.cpython-311-x86_64-linux-gnu.so".into()),
            ..Frame::new(name, FrameKind::Native)
        };
        assert_eq!(
            called_name(&f("__pyx_pw_6uvloop_4loop_4Loop_31call_later")).as_deref(),
            Some("uvloop.loop.Loop.call_later")
        );
        assert!(is_call_glue(&f("__Pyx_PyObject_Call")));
        assert!(!is_call_glue(&f(
            "__pyx_pw_6uvloop_4loop_4Loop_31call_later"
        )));
    }

    fn py(name: &str, file: &str) -> Frame {
        Frame {
            file: Some(file.into()),
            line: Some(3),
            ..Frame::new(name, FrameKind::Python)
        }
    }
    fn js(name: &str, file: &str) -> Frame {
        Frame {
            file: Some(file.into()),
            line: Some(3),
            ..Frame::new(name, FrameKind::Js)
        }
    }

    #[test]
    fn the_guess_by_path() {
        let g = AppPaths::default();
        let lib = |f: &Frame| (g.is_app(f), g.library(f));
        assert_eq!(lib(&py("parse_resume", "/srv/app/main.py")), (true, None));
        assert_eq!(lib(&py("handler", "app.py")), (true, None));
        assert_eq!(
            lib(&py(
                "PageObject.extract_text",
                "/venv/lib/python3.11/site-packages/pypdf/_page.py"
            )),
            (false, Some("pypdf".into()))
        );
        assert_eq!(
            lib(&py("f", "/usr/lib/python3/dist-packages/six.py")),
            (false, Some("six".into()))
        );
        assert_eq!(
            lib(&py(
                "JSONDecoder.raw_decode",
                "/root/.pyenv/versions/3.11.7/lib/python3.11/json/decoder.py"
            )),
            (false, Some("json".into()))
        );
        assert_eq!(
            lib(&py(
                "SSLContext.load_default_certs",
                "/usr/lib/python3.13/ssl.py"
            )),
            (false, Some("ssl".into()))
        );
        assert_eq!(
            lib(&py("_find_and_load", "<frozen importlib._bootstrap>")),
            (false, Some("importlib._bootstrap".into()))
        );
        // A directory merely named lib/python… without a version is the app's.
        assert!(g.is_app(&py("f", "/home/u/lib/pythonic/app.py")));
        assert_eq!(
            lib(&js("pbkdf2Sync", "node:internal/crypto/pbkdf2")),
            (false, Some("node:internal/crypto/pbkdf2".into()))
        );
        assert_eq!(
            lib(&js("parse", "/srv/node_modules/@babel/parser/lib/index.js")),
            (false, Some("@babel/parser".into()))
        );
        assert_eq!(lib(&js("deriveKey", "/srv/app.js")), (true, None));
        assert!(
            !g.is_app(&Frame::new("Math.max", FrameKind::Js)),
            "a builtin"
        );
        let native = Frame {
            module: Some("libz.so.1".into()),
            ..Frame::new("deflate", FrameKind::Native)
        };
        assert_eq!(lib(&native), (false, Some("libz".into())));
        let interp = Frame {
            module: Some("libpython3.11.so.1.0".into()),
            ..Frame::new("time_sleep", FrameKind::Native)
        };
        assert_eq!(lib(&interp), (false, None));
        let perf = Frame {
            module: Some("[jit]".into()),
            ..Frame::new("JS:*deriveKey /srv/app.js:11:19", FrameKind::Native)
        };
        assert!(g.is_app(&perf));
    }

    #[test]
    fn app_paths_replace_the_guess() {
        let a = AppPaths::new(&["/venv/lib/python3.11/site-packages/myapp/".into()]);
        assert!(a.is_app(&py(
            "handler",
            "/venv/lib/python3.11/site-packages/myapp/api.py"
        )));
        assert!(!a.is_app(&py("vendored", "/srv/app/vendor/x.py")));
        assert_eq!(
            a.library(&py("vendored", "/srv/app/vendor/x.py")),
            Some("x".into())
        );
    }

    #[test]
    fn dispatch_and_machinery() {
        let n = |name: &str, module: &str| Frame {
            module: Some(module.into()),
            ..Frame::new(name, FrameKind::Native)
        };
        let so = "loop.cpython-311-x86_64-linux-gnu.so";
        assert!(is_dispatch_frame(&py(
            "Handle._run",
            "/x/lib/python3.11/asyncio/events.py"
        )));
        assert!(is_dispatch_frame(&n(
            "__pyx_f_6uvloop_4loop_6Handle__run",
            so
        )));
        assert!(is_dispatch_frame(&n(
            "__pyx_f_6uvloop_4loop_11TimerHandle__run",
            so
        )));
        assert!(!is_dispatch_frame(&n("Handle__run", "app")));
        assert!(is_loop_machinery(&n("uv__io_poll", so), Some(so)));
        assert!(is_loop_machinery(&n("__Pyx_PyObject_Call", so), Some(so)));
        assert!(!is_loop_machinery(
            &n("__pyx_f_5other_f", "other.so"),
            Some(so)
        ));
        assert!(is_loop_machinery(
            &n("task_step", "_asyncio.cpython-311-x86_64-linux-gnu.so"),
            Some(so)
        ));
    }
}
