//! The operating system as stallprof sees it: procfs, the clock, units, output
//! directories that cannot be redirected, the container a process runs in, the invoking user, the bounds on
//! reads the target controls.
pub mod clock;
pub mod container;
pub mod cpu_quota;
pub mod heap;
pub mod lacking;
pub mod limits;
pub mod outdir;
pub mod proc;
pub mod units;
pub mod user;
