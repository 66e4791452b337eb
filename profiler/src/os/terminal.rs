//! The terminal stdout writes to, if any: how many columns it has.
//!
//! In: stdout (fd 1), `COLUMNS`. Out: its width in columns when stdout is a
//! terminal; None when it is a file or a pipe (a test capturing it, `| less`),
//! where the caller picks its own width.
use std::io::IsTerminal;

/// The columns of the terminal on stdout: `COLUMNS` when set to a number
/// (the user's word), else the terminal's own size (`TIOCGWINSZ`); None
/// when stdout is not a terminal, or its size is unknown (0).
pub fn stdout_columns() -> Option<usize> {
    if !std::io::stdout().is_terminal() {
        return None;
    }
    if let Some(n) = std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return Some(n);
    }
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one `winsize` through the pointer, which
    // points at one.
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_col > 0).then_some(usize::from(ws.ws_col))
}
