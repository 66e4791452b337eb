//! What an event loop has waiting while a stall holds it, as one read of
//! its own bookkeeping found it, for every runtime read: asyncio and
//! uvloop ([`super::python::QueueReader`]), Node
//! ([`super::v8::JsResolver::node_timers`]). The reads table
//! (`pipeline::reads`) turns a read into what the stall held up.

/// Handles (timers, callbacks) read from each queue; past this the read is
/// `truncated`.
pub const MAX_HANDLES: usize = 4096;

/// What one read of a loop found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Queues {
    /// The due time (CLOCK_MONOTONIC ns) of each live timer: asyncio's
    /// `_when` of each timer in the scheduled heap and in the ready queue;
    /// Node's `_idleStart + msecs` of each `Timeout` in its timer lists.
    pub timers_when_ns: Vec<u64>,
    /// Other live handles in the ready queue (asyncio's callbacks and
    /// task steps; Node's `setImmediate` callbacks).
    pub ready_handles: u32,
    /// A queue held more than [`MAX_HANDLES`]: only that many were read.
    pub truncated: bool,
}

/// Why a loop's queues were not read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueuesMiss {
    /// The loop is one no reader knows (a Python loop class that is
    /// neither asyncio's nor uvloop's), or the runtime's bookkeeping is not
    /// readable in this build: what it is.
    Unsupported(String),
    /// The thread's loop is not known (why).
    NoLoop(&'static str),
    /// The loop or its queues could not be read (why).
    Unreadable(String),
}
