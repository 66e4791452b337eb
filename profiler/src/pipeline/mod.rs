//! The engine and the stages it owns: loop identity (`loops`), stall
//! assembly (`stall`), the engine that drives decode -> unwind -> assemble
//! on the drain thread (`engine`), and the symbolizer thread it hands
//! finished stalls to (`symbolizer`), the ASGI request of each busy period
//! (`routes`), the runtimes found per process (`discovery`, on a thread of
//! its own, and `watch`, what the engine keeps of its answers).
pub mod discovery;
pub mod engine;
pub mod loops;
pub mod routes;
pub mod stall;
pub mod symbolizer;
mod watch;
