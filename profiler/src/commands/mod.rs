//! The commands: thin drivers of the engine and the report writers.
pub mod daemon;
pub mod live;
pub mod record;
pub mod report;
pub mod top;

use clap::Args;

use crate::os::units::parse_duration;

#[derive(Args, Debug, Clone)]
pub struct StallArgs {
    /// Busy periods at least this long are stalls (e.g. 50ms, 0.2s, 1s).
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    pub threshold: u64,
}
