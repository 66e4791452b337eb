//! The kernel side seen from userspace: loading and attaching the BPF
//! programs and talking to their maps (`probe`), decoding what they send
//! (`event`), and finding runtime park functions to attach to (`runtimes`).
pub mod event;
pub mod probe;
pub mod runtimes;
