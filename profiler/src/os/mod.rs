//! The operating system as stallprof sees it: procfs, the clock, units.
pub mod clock;
pub mod proc;
pub mod units;
