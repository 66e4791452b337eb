//! The kernel side seen from userspace: loading and attaching the BPF
//! programs and talking to their maps (`probe`), decoding what they send
//! (`event`), and finding what to attach to: the running kernel's task
//! layout and raw tracepoint prototypes (`btf`), the C library's wait
//! functions (`waits`) and runtime park functions (`runtimes`).
pub mod btf;
pub mod event;
pub mod plan;
pub mod probe;
pub mod runtimes;
pub mod waits;
