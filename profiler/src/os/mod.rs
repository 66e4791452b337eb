//! The operating system as stallprof sees it: procfs, the clock, units, output
//! directories that cannot be redirected, the invoking user.
pub mod clock;
pub mod outdir;
pub mod proc;
pub mod units;
pub mod user;
