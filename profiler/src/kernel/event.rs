//! Ring-buffer bytes -> typed events. The one place that reads Pod bytes.
//!
//! In: one ring-buffer record (`profiler_common` layout). Out: [`Event`], an
//! owned, serializable value. Everything downstream is fed `Event`s, so the
//! same pipeline serves live recording, replay of a saved recording (the raw records), and
//! golden tests.
use profiler_common::{
    CpuHolderEvent, EventHeader, MAX_KSTACK, MAX_USTACK, PY_HOLDER_FRAMES, SchedEvent, StackEvent,
    TASK_CHAIN, TASK_NAME_BYTES, TASK_OBJ_BYTES, THROTTLE_NOT_MEASURED, TaskEvent, TaskPart,
    USER_STACK_COPY, UserRegs, WaitEvent, kind, preempt, python::PY_MAX_FRAMES,
};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::model::Holder;

/// What a stack copy says of one JavaScript frame, taken at sample time
/// (the copy is gone after unwinding): its index in the user stack, its
/// tagged `JSFunction`, and, for interpreted and baseline frames, its
/// tagged `BytecodeArray` and bytecode-offset slot (0 where the frame has
/// none or the layout does not say), its frame pointer, and the words its
/// caller passed: the receiver (`this`) and the first argument (0 where
/// the copy or the layout does not reach them). A request's objects are
/// read through these (`symbolize::v8::express`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct JsSlot {
    pub frame: u32,
    pub func: u64,
    #[serde(default)]
    pub bytecode: u64,
    #[serde(default)]
    pub offset: u64,
    #[serde(default)]
    pub fp: u64,
    #[serde(default, skip_serializing_if = "is_zero64")]
    pub this: u64,
    #[serde(default, skip_serializing_if = "is_zero64")]
    pub arg0: u64,
}

impl JsSlot {
    /// What names the frame, the key its answer is kept under: the slot
    /// without its place in the stack and the values passed to it (a
    /// request's objects differ with every call).
    pub fn identity(&self) -> JsSlot {
        JsSlot {
            frame: 0,
            this: 0,
            arg0: 0,
            ..*self
        }
    }
}

/// Stacks captured at one instant, innermost frame first in each list.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RawStack {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernel: Vec<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub user: Vec<u64>,
    /// JavaScript frames found in the stack copy (V8): index in `user`,
    /// tagged `JSFunction` and, interpreted, `BytecodeArray` and offset;
    /// innermost first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub js: Vec<JsSlot>,
    /// Python frames as (code object address, instruction value).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub python: Vec<(u64, u64)>,
    /// Why the Python walk stopped (`profiler_common::py_status`), 0 = no walk.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub py_status: u32,
    /// Switch-out into a wait for the GIL: the holder's `PyThreadState*`.
    #[serde(default, skip_serializing_if = "is_zero64")]
    pub gil_holder: u64,
    /// The GIL holder's Python frames at that moment, innermost first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holder_python: Vec<(u64, u64)>,
}

/// Bytes BPF read at an address of the target.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryRead {
    pub addr: u64,
    pub bytes: Vec<u8>,
}

fn is_zero64(v: &u64) -> bool {
    *v == 0
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    WaitEnter {
        tid: u32,
        tgid: u32,
        ts: u64,
        nr: u32,
        fd: i32,
    },
    WaitExit {
        tid: u32,
        tgid: u32,
        ts: u64,
        nr: u32,
        fd: i32,
        ret: i64,
    },
    /// A busy thread left the CPU. `runnable`: preempted rather than blocked.
    /// `syscall`: the syscall it was in, if any.
    SwitchOut {
        tid: u32,
        tgid: u32,
        ts: u64,
        runnable: bool,
        syscall: Option<u32>,
        stack: RawStack,
        /// As [`Event::Sample`]'s.
        #[serde(default, skip_serializing_if = "is_zero64")]
        task: u64,
    },
    /// A busy thread was preempted (still runnable); no stack.
    /// `throttled`: because its cgroup's CPU quota ran out.
    Preempted {
        tid: u32,
        tgid: u32,
        ts: u64,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        throttled: bool,
        /// Reported at the park's return: the wait between the park
        /// returning and the loop's own code running (`preempt::WOKEN`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        woken: bool,
    },
    /// `throttled_ns`: after a throttled preemption, how much of the time
    /// off the CPU the kernel measured as throttled, None when it could not
    /// measure it; after any other switch-out it is `Some(0)` and unused.
    SwitchIn {
        tid: u32,
        tgid: u32,
        ts: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        throttled_ns: Option<u64>,
    },
    /// A task that ran on the CPU loop thread `tid` waited for, for `ns`
    /// (reported at `tid`'s switch-in, `ts`).
    CpuHolder {
        tid: u32,
        tgid: u32,
        ts: u64,
        holder: Holder,
        ns: u64,
    },
    Wakeup {
        tid: u32,
        tgid: u32,
        ts: u64,
        /// Who woke it; `None` when no program saw the wakeup (per-thread
        /// switch events date it from the thread's run delay).
        waker: Option<u32>,
    },
    Sample {
        tid: u32,
        tgid: u32,
        ts: u64,
        stack: RawStack,
        /// CPython 3.14+: the asyncio task object running at capture (0:
        /// none or not read), kept apart from the interned stack.
        #[serde(default, skip_serializing_if = "is_zero64")]
        task: u64,
    },
    /// CPython 3.14+: the asyncio task `tid` ran when its next stack
    /// event was captured (sent just before it): the parts of target memory
    /// that name it, as read then (`profiler_common::TaskEvent`).
    Task {
        tid: u32,
        tgid: u32,
        ts: u64,
        task: u64,
        memory: Vec<MemoryRead>,
    },
    /// A thread exited; `process` when it was the last one.
    Exit {
        tid: u32,
        tgid: u32,
        ts: u64,
        process: bool,
    },
    /// Recording a process tree: watched process `parent` started process
    /// `tgid` (`tid` is its first thread, the same id), watched from now.
    Fork {
        tid: u32,
        tgid: u32,
        ts: u64,
        parent: u32,
    },
}

impl Event {
    pub fn tid(&self) -> u32 {
        match *self {
            Event::WaitEnter { tid, .. }
            | Event::WaitExit { tid, .. }
            | Event::SwitchOut { tid, .. }
            | Event::SwitchIn { tid, .. }
            | Event::Preempted { tid, .. }
            | Event::CpuHolder { tid, .. }
            | Event::Wakeup { tid, .. }
            | Event::Sample { tid, .. }
            | Event::Task { tid, .. }
            | Event::Exit { tid, .. }
            | Event::Fork { tid, .. } => tid,
        }
    }

    pub fn ts(&self) -> u64 {
        match *self {
            Event::WaitEnter { ts, .. }
            | Event::WaitExit { ts, .. }
            | Event::SwitchOut { ts, .. }
            | Event::SwitchIn { ts, .. }
            | Event::Preempted { ts, .. }
            | Event::CpuHolder { ts, .. }
            | Event::Wakeup { ts, .. }
            | Event::Sample { ts, .. }
            | Event::Task { ts, .. }
            | Event::Exit { ts, .. }
            | Event::Fork { ts, .. } => ts,
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum EventError {
    #[error("ring-buffer record of {len} bytes is too short for event kind {kind}")]
    Short { kind: u32, len: usize },
    #[error(
        "unknown event kind {0}: the eBPF object and the agent were built from different sources"
    )]
    Kind(u32),
}

fn read<T: Copy>(bytes: &[u8], kind: u32) -> Result<T, EventError> {
    if bytes.len() < size_of::<T>() {
        return Err(EventError::Short {
            kind,
            len: bytes.len(),
        });
    }
    // SAFETY: the length is checked; T is a repr(C) Pod type from
    // profiler-common, valid for any bit pattern; read_unaligned copes with
    // the ring buffer's 8-byte alignment.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// Read the stack parts of a `StackEvent` in place: the record is ~19 KiB,
/// mostly the user-stack copy that only the unwinder looks at (through
/// [`stack_copy`]), so it is never copied whole.
fn stack_of(bytes: &[u8], kind: u32) -> Result<(RawStack, i64, i64), EventError> {
    macro_rules! field {
        ($name:ident, $ty:ty) => {
            read::<$ty>(
                bytes
                    .get(std::mem::offset_of!(StackEvent, $name)..)
                    .unwrap_or(&[]),
                kind,
            )?
        };
    }
    let (k, u, p, h) = (
        (field!(kstack_len, u32) as usize).min(MAX_KSTACK),
        (field!(ustack_len, u32) as usize).min(MAX_USTACK),
        (field!(py_len, u32) as usize).min(PY_MAX_FRAMES),
        (field!(holder_py_len, u32) as usize).min(PY_HOLDER_FRAMES),
    );
    let words = |at: usize, n: usize| -> Result<Vec<u64>, EventError> {
        let raw = bytes.get(at..at + n * 8).ok_or(EventError::Short {
            kind,
            len: bytes.len(),
        })?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect())
    };
    let pairs = |at: usize, n: usize| -> Result<Vec<(u64, u64)>, EventError> {
        let w = words(at, 2 * n)?;
        Ok(w.chunks_exact(2).map(|c| (c[0], c[1])).collect())
    };
    let gil_holder = field!(gil_holder, u64);
    let stack = RawStack {
        kernel: words(std::mem::offset_of!(StackEvent, kstack), k)?,
        user: words(std::mem::offset_of!(StackEvent, ustack), u)?
            .into_iter()
            .take_while(|&a| a != 0)
            .collect(),
        js: Vec::new(),
        python: pairs(std::mem::offset_of!(StackEvent, py), p)?,
        py_status: field!(py_status, u32),
        gil_holder,
        holder_python: if gil_holder != 0 {
            pairs(std::mem::offset_of!(StackEvent, holder_py), h)?
        } else {
            Vec::new()
        },
    };
    Ok((stack, field!(state, i64), field!(syscall, i64)))
}

/// Decode one ring-buffer record.
pub fn parse(bytes: &[u8]) -> Result<Event, EventError> {
    let hdr: EventHeader = read(bytes, 0)?;
    let (tid, tgid, ts) = (hdr.tid, hdr.tgid, hdr.ts_ns);
    Ok(match hdr.kind {
        kind::WAIT_ENTER | kind::WAIT_EXIT => {
            let w: WaitEvent = read(bytes, hdr.kind)?;
            if hdr.kind == kind::WAIT_ENTER {
                Event::WaitEnter {
                    tid,
                    tgid,
                    ts,
                    nr: w.nr,
                    fd: w.fd,
                }
            } else {
                Event::WaitExit {
                    tid,
                    tgid,
                    ts,
                    nr: w.nr,
                    fd: w.fd,
                    ret: w.ret,
                }
            }
        }
        kind::SWITCH_OUT | kind::SAMPLE => {
            // A saved recording keeps only the valid part of the stack copy.
            if bytes.len() < std::mem::offset_of!(StackEvent, stack) {
                return Err(EventError::Short {
                    kind: hdr.kind,
                    len: bytes.len(),
                });
            }
            let (stack, state, syscall) = stack_of(bytes, hdr.kind)?;
            let task = read::<u64>(
                bytes
                    .get(std::mem::offset_of!(StackEvent, task)..)
                    .unwrap_or(&[]),
                hdr.kind,
            )?;
            if hdr.kind == kind::SAMPLE {
                Event::Sample {
                    tid,
                    tgid,
                    ts,
                    stack,
                    task,
                }
            } else {
                let runnable = state == 0 || state & profiler_common::TASK_REPORT_MAX != 0;
                let syscall = (syscall >= 0).then_some(syscall as u32);
                Event::SwitchOut {
                    tid,
                    tgid,
                    ts,
                    runnable,
                    syscall,
                    stack,
                    task,
                }
            }
        }
        kind::SWITCH_IN | kind::WAKEUP | kind::EXIT | kind::PREEMPTED | kind::FORK => {
            let s: SchedEvent = read(bytes, hdr.kind)?;
            match hdr.kind {
                kind::SWITCH_IN => Event::SwitchIn {
                    tid,
                    tgid,
                    ts,
                    // Read downstream only after a throttled preemption.
                    throttled_ns: (s.arg != THROTTLE_NOT_MEASURED).then_some(s.arg as u64),
                },
                kind::PREEMPTED => Event::Preempted {
                    tid,
                    tgid,
                    ts,
                    throttled: s.arg & preempt::THROTTLED != 0,
                    woken: s.arg & preempt::WOKEN != 0,
                },
                kind::WAKEUP => Event::Wakeup {
                    tid,
                    tgid,
                    ts,
                    waker: (s.arg != profiler_common::NO_WAKER).then_some(s.arg),
                },
                kind::FORK => Event::Fork {
                    tid,
                    tgid,
                    ts,
                    parent: s.arg,
                },
                _ => Event::Exit {
                    tid,
                    tgid,
                    ts,
                    process: s.arg != 0,
                },
            }
        }
        kind::CPU_HOLDER => {
            let h: CpuHolderEvent = read(bytes, hdr.kind)?;
            let len = h.comm.iter().position(|&b| b == 0).unwrap_or(h.comm.len());
            let comm = || String::from_utf8_lossy(&h.comm[..len]).into_owned();
            let holder = match h.pid {
                profiler_common::CPU_HOLDER_OTHERS => Holder::OtherTasks,
                0 => Holder::Idle { comm: comm() },
                pid => Holder::Task {
                    pid,
                    tgid: h.tgid,
                    comm: comm(),
                },
            };
            Event::CpuHolder {
                tid,
                tgid,
                ts,
                holder,
                ns: h.ns,
            }
        }
        kind::TASK => {
            // Sent cut after its valid parts.
            let head = std::mem::offset_of!(TaskEvent, parts);
            let mut full = [0u8; size_of::<TaskEvent>()];
            let n = bytes.len().min(full.len());
            if n < head {
                return Err(EventError::Short {
                    kind: hdr.kind,
                    len: bytes.len(),
                });
            }
            full[..n].copy_from_slice(&bytes[..n]);
            let t: TaskEvent = read(&full, hdr.kind)?;
            let sent = (n - head) / size_of::<TaskPart>();
            let parts = &t.parts[..(t.parts_len as usize).min(sent).min(TASK_CHAIN)];
            let read_at = |addr: u64, b: &[u8]| MemoryRead {
                addr,
                bytes: b.to_vec(),
            };
            let mut memory = Vec::new();
            for p in parts {
                let task_len = (p.task_len as usize).min(TASK_OBJ_BYTES);
                if task_len != 0 {
                    memory.push(read_at(p.task, &p.task_bytes[..task_len]));
                }
                let name_len = (p.name_len as usize).min(TASK_NAME_BYTES);
                if name_len != 0 {
                    memory.push(read_at(p.name, &p.name_bytes[..name_len]));
                }
                if p.name_flags_at != 0 {
                    memory.push(read_at(p.name_flags_at, &p.name_flags.to_le_bytes()));
                }
            }
            for (at, v) in [(t.code_at, t.code), (t.instr_at, t.instr)] {
                if at != 0 {
                    memory.push(read_at(at, &v.to_le_bytes()));
                }
            }
            Event::Task {
                tid,
                tgid,
                ts,
                task: parts.first().map_or(0, |p| p.task),
                memory,
            }
        }
        other => return Err(EventError::Kind(other)),
    })
}

/// How much of a record a recording keeps: all of it, except for a stack
/// event, whose user-stack copy is cut to its valid bytes.
pub fn saved_len(bytes: &[u8]) -> usize {
    let Ok(hdr) = read::<EventHeader>(bytes, 0) else {
        return bytes.len();
    };
    if hdr.kind != kind::SAMPLE && hdr.kind != kind::SWITCH_OUT {
        return bytes.len();
    }
    let len_at = std::mem::offset_of!(StackEvent, stack_len);
    let stack_at = std::mem::offset_of!(StackEvent, stack);
    match bytes
        .get(len_at..)
        .and_then(|b| read::<u32>(b, hdr.kind).ok())
    {
        Some(n) => (stack_at + (n as usize).min(USER_STACK_COPY)).min(bytes.len()),
        None => bytes.len(),
    }
}

/// The user registers and the copied user stack of a stack event (sample or
/// switch-out), borrowed from the record, for the unwinder.
pub fn stack_copy(bytes: &[u8]) -> Option<(UserRegs, &[u8])> {
    let hdr: EventHeader = read(bytes, 0).ok()?;
    if hdr.kind != kind::SAMPLE && hdr.kind != kind::SWITCH_OUT {
        return None;
    }
    let regs_at = std::mem::offset_of!(StackEvent, regs);
    let len_at = std::mem::offset_of!(StackEvent, stack_len);
    let stack_at = std::mem::offset_of!(StackEvent, stack);
    let regs: UserRegs = read(bytes.get(regs_at..)?, hdr.kind).ok()?;
    let len: u32 = read(bytes.get(len_at..)?, hdr.kind).ok()?;
    let len = (len as usize).min(USER_STACK_COPY);
    Some((regs, bytes.get(stack_at..stack_at + len)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T>(v: &T) -> Vec<u8> {
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    #[test]
    fn wait_roundtrip() {
        let w = WaitEvent {
            hdr: EventHeader {
                kind: kind::WAIT_EXIT,
                tid: 7,
                tgid: 5,
                cpu: 1,
                ts_ns: 99,
            },
            nr: 232,
            fd: 3,
            ret: 1,
        };
        assert_eq!(
            parse(&bytes_of(&w)).unwrap(),
            Event::WaitExit {
                tid: 7,
                tgid: 5,
                ts: 99,
                nr: 232,
                fd: 3,
                ret: 1
            }
        );
    }

    #[test]
    fn task_event_keeps_each_read_that_succeeded_with_its_address() {
        let mut t: TaskEvent = unsafe { std::mem::zeroed() };
        t.hdr = EventHeader {
            kind: kind::TASK,
            tid: 7,
            tgid: 5,
            cpu: 0,
            ts_ns: 99,
        };
        (t.code_at, t.code) = (0x4000, 0xc0de);
        (t.instr_at, t.instr) = (0, 0); // failed
        t.parts_len = 2;
        let p = &mut t.parts[0];
        (p.task, p.task_len, p.task_bytes[0]) = (0x1000, 168, 1);
        (p.name, p.name_len) = (0x2000, 0); // its read failed: not sent
        (p.name_flags_at, p.name_flags) = (0x3000, 1 << 28);
        let p = &mut t.parts[1];
        (p.task, p.task_len) = (0x5000, 168);
        (p.name, p.name_len) = (0x6000, 48);
        // Sent cut after its two parts.
        let head = std::mem::offset_of!(TaskEvent, parts);
        let all = bytes_of(&t);
        let sent = &all[..head + 2 * size_of::<TaskPart>()];
        let Event::Task {
            tid,
            tgid,
            ts,
            task,
            memory,
        } = parse(sent).unwrap()
        else {
            panic!("not a task event");
        };
        assert_eq!((tid, tgid, ts, task), (7, 5, 99, 0x1000));
        let parts: Vec<(u64, usize)> = memory.iter().map(|m| (m.addr, m.bytes.len())).collect();
        assert_eq!(
            parts,
            [
                (0x1000, 168),
                (0x3000, 8),
                (0x5000, 168),
                (0x6000, 48),
                (0x4000, 8)
            ]
        );
        assert_eq!(memory[0].bytes[0], 1);
        assert_eq!(memory[4].bytes, 0xc0deu64.to_le_bytes());
        // A count or a length past what was sent is cut to it.
        t.parts_len = 9;
        t.parts[0].task_len = 5000;
        let all = bytes_of(&t);
        let Ok(Event::Task { memory, .. }) = parse(&all[..head + size_of::<TaskPart>()]) else {
            panic!("not a task event");
        };
        assert_eq!(memory[0].bytes.len(), TASK_OBJ_BYTES);
        assert!(memory.iter().all(|m| m.addr < 0x5000));
        assert!(matches!(
            parse(&all[..head - 1]),
            Err(EventError::Short { .. })
        ));
    }

    #[test]
    fn short_and_unknown_records_are_errors() {
        assert!(matches!(parse(&[0u8; 4]), Err(EventError::Short { .. })));
        let h = EventHeader {
            kind: 99,
            ..Default::default()
        };
        assert_eq!(parse(&bytes_of(&h)), Err(EventError::Kind(99)));
    }

    #[test]
    fn stack_event_trims_to_lengths() {
        let mut s: StackEvent = unsafe { std::mem::zeroed() };
        s.hdr = EventHeader {
            kind: kind::SWITCH_OUT,
            tid: 1,
            tgid: 1,
            cpu: 0,
            ts_ns: 5,
        };
        s.state = 1; // TASK_INTERRUPTIBLE: blocked
        s.syscall = 0; // read
        s.kstack_len = 2;
        s.kstack[..3].copy_from_slice(&[10, 11, 12]);
        s.ustack_len = 1;
        s.ustack[0] = 20;
        let Event::SwitchOut {
            runnable,
            syscall,
            stack,
            ..
        } = parse(&bytes_of(&s)).unwrap()
        else {
            panic!()
        };
        assert!(!runnable);
        assert_eq!(syscall, Some(0));
        assert_eq!(stack.kernel, [10, 11]);
        assert_eq!(stack.user, [20]);
    }
}
