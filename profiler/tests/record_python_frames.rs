//! Python-aware stall stacks, root integration tests: `stallprof record`
//! against three asyncio victims that mirror the field reports, on every
//! CPython we support (pyenv 3.10-3.13 and Debian's stripped 3.11). One test
//! per (victim, interpreter): `gateway::pyenv_3_12`, `gil::debian_3_11`, ...
//!
//! - `gateway` (victims/py_gateway.py): each new request runs, on the loop,
//!   `Gateway.make_tls_contexts`, `.load_tokenizer`, `.compress_payload` and
//!   `.score_candidates` back-to-back: one stall per request.
//! - `session` (victims/py_session.py): each turn runs a sync streaming HTTP
//!   client (`stream_completion`: http.client with a socket timeout reading
//!   60 server-sent events 3 ms apart, so CPython polls the socket 60+ times
//!   inside one stall), a webhook with a `time.sleep(0.1)` retry
//!   (`send_webhook`) and pure-Python parsing (`parse_document`): one stall
//!   per turn. The client's polls must not take over the loop's identity
//!   (issue 10): no stall time in the loop's own epoll wait, no stall of the
//!   loop outside the turns, and every turn >= 95% covered by stalls.
//! - `gil` (victims/py_gil.py): the loop does nothing blocking; a thread named
//!   "gil-hog" holds the GIL in one long `re.match` inside `hog()`. The loop's
//!   stalls are GIL waits, and the holder is named with its Python stack.
//!
//! For every cause the victim logs its function (name, qualname, def line,
//! last line, the blocking statement's line) and times each step with
//! time.monotonic_ns(). The assertions:
//! - the cause is named by a frame of kind "python" whose name is the
//!   qualname (3.11+) or the bare name (3.10), whose file ends with the
//!   victim's file name, and whose line lies within the function (for a
//!   single-statement step: is the blocking line);
//! - its share of stall time (weight of the stacks containing that frame,
//!   whatever their kind -- run-queue time counts for the cause it
//!   interrupted -- over the total duration of the stalls matched to the
//!   victim's requests/turns by overlap) is within 5 points of the victim's
//!   own share (step time over logged request/turn time);
//! - off-CPU causes show their syscall (poll for the socket client;
//!   clock_nanosleep for time.sleep, select/pselect6 on 3.10);
//! - gil: gil_wait stacks carry >= 70% of the loop's stall time outside the
//!   run queue (run-queue time is the machine's load; see check_gil), and
//!   at least 90% of them name the holder "gil-hog" (its tid) with `hog`
//!   (py_gil.py, on the re.match line) in its frames and marker. Every
//!   heartbeat the victim logs late during a match lies in a stall, and no
//!   stall of the loop lies outside the matches unless it is >= 90% run
//!   queue (the host's load, printed as a NOTE).
//!
//! Shares are printed (`--nocapture`) as `SHARE victim python cause measured
//! truth`; for gateway on pyenv builds the `[gc]` share is printed, not
//! asserted. Needs root (see tests/common/mod.rs for
//! STALLPROF_SKIP_ROOT_TESTS).

mod common;
mod pyrecord;

use pyrecord::*;

/// One test per interpreter for a victim: `$victim::pyenv_3_10`, ...
macro_rules! on_every_python {
    ($victim:ident, $check:ident) => {
        mod $victim {
            use super::*;
            #[test]
            fn pyenv_3_10() {
                $check(
                    concat!(stringify!($victim), "_pyenv_3_10"),
                    found_python(10),
                );
            }
            #[test]
            fn pyenv_3_11() {
                $check(
                    concat!(stringify!($victim), "_pyenv_3_11"),
                    found_python(11),
                );
            }
            #[test]
            fn pyenv_3_12() {
                $check(
                    concat!(stringify!($victim), "_pyenv_3_12"),
                    found_python(12),
                );
            }
            #[test]
            fn pyenv_3_13() {
                $check(
                    concat!(stringify!($victim), "_pyenv_3_13"),
                    found_python(13),
                );
            }
            /// Debian's interpreter: static libpython, non-PIE, stripped.
            #[test]
            fn debian_3_11() {
                $check(
                    concat!(stringify!($victim), "_debian_3_11"),
                    debian_python(),
                );
            }
        }
    };
}

on_every_python!(gateway, check_gateway);
on_every_python!(session, check_session);
on_every_python!(gil, check_gil);
