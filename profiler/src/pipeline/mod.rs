//! The driver on top of the stages: the engine that drives decode ->
//! unwind -> assemble on the drain thread (`engine`), the symbolizer
//! thread it hands finished stalls to (`symbolizer`), the live reads of
//! each busy period — its asyncio task and ASGI request (`reads`) —, the
//! runtimes found per process (`discovery`, on a thread of its own, and
//! `watch`, what the engine keeps of its answers), the one port back to
//! the kernel side (`control`), the recording's files (`recording`) and
//! their replay through the engine (`replay`).
//!
//! Imports point one way (no module uses one that uses it): `replay` ->
//! `engine` -> the rest; `pending` -> `symbolizer` -> `reads` ->
//! `counters`; `watch` -> `control`, `discovery`; `recording`,
//! `identities` use none.
pub mod control;
pub mod counters;
pub mod discovery;
pub mod engine;
mod identities;
mod pending;
pub mod reads;
pub mod recording;
pub mod replay;
pub mod symbolizer;
mod watch;
