//! The engine and the stages it owns: loop identity (`loops`), stall
//! assembly (`stall`), and the engine that drives decode -> unwind ->
//! assemble -> symbolize (`engine`).
pub mod engine;
pub mod loops;
pub mod stall;
