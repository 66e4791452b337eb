//! The driver on top of the stages: the engine that drives decode ->
//! unwind -> assemble on the drain thread (`engine`), the symbolizer
//! thread it hands finished stalls to (`symbolizer`), the ASGI request of
//! each busy period (`routes`), the runtimes found per process
//! (`discovery`, on a thread of its own, and `watch`, what the engine
//! keeps of its answers).
pub mod discovery;
pub mod engine;
pub mod routes;
pub mod symbolizer;
mod watch;
