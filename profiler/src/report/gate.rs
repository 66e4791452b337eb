//! The CI gate (`record --fail-on-stall DUR`): did any stall last at least
//! DUR, and the summary line that says so.
//!
//! In: a [`Recording`] and the limit. Out: [`Gate`], whose `line` is the
//! summary's last line: `gate: 2 stalls >= 100.0ms (worst 240.0ms at
//! +3.21s on MainThread (tid 4242), in load_tokenizer (tok.py:41))` or
//! `gate: no stall >= 100.0ms`. The command turns `failed` into its exit
//! status; this module decides nothing else.
use std::collections::HashMap;

use crate::model::{Recording, Stall};
use crate::{classify::AppPaths, os::units::fmt_ns, report::aggregate::blame};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gate {
    /// Some stall lasted at least the limit.
    pub failed: bool,
    /// How many did.
    pub count: usize,
    pub line: String,
}

/// The culprit that took most of a stall's time (by the same rule as the
/// summary's culprits), as `name (file:line)` with the library call it
/// went through.
fn stall_culprit(s: &Stall, app: &AppPaths) -> Option<String> {
    let mut by: HashMap<String, u64> = HashMap::new();
    for p in &s.stacks {
        if let Some(b) = blame(p, app) {
            *by.entry(b.label()).or_default() += p.weight_ns;
        }
    }
    by.into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
        .map(|(label, _)| label)
}

pub fn check(rec: &Recording, limit_ns: u64) -> Gate {
    let over: Vec<&Stall> = rec
        .stalls
        .iter()
        .filter(|s| s.duration_ns >= limit_ns)
        .collect();
    let Some(worst) = over.iter().max_by_key(|s| s.duration_ns) else {
        return Gate {
            failed: false,
            count: 0,
            line: format!("gate: no stall >= {}", fmt_ns(limit_ns)),
        };
    };
    let ns = worst
        .ns_tid
        .map(|ns| format!(", {ns} in its namespace"))
        .unwrap_or_default();
    let at = format!(
        "+{:.2}s on {} (tid {}{ns})",
        worst.start_ns.saturating_sub(rec.started_ns) as f64 / 1e9,
        worst.thread_name,
        worst.tid
    );
    let what = stall_culprit(worst, &rec.app())
        .map(|c| format!(", in {c}"))
        .unwrap_or_default();
    Gate {
        failed: true,
        count: over.len(),
        line: format!(
            "gate: {} stall{} >= {} (worst {} at {at}{what})",
            over.len(),
            if over.len() == 1 { "" } else { "s" },
            fmt_ns(limit_ns),
            fmt_ns(worst.duration_ns)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frame, FrameKind, PartKind};
    use crate::testing;

    fn stall(start_ms: u64, ms: u64, func: &str) -> Stall {
        let ns = ms * 1_000_000;
        let frames = vec![Frame {
            name: func.into(),
            file: Some("/app/tok.py".into()),
            line: Some(41),
            kind: FrameKind::Python,
            module: None,
        }];
        Stall {
            tid: 7,
            thread_name: "MainThread".into(),
            ..testing::stall(
                start_ms * 1_000_000,
                vec![testing::part(PartKind::OnCpu, ns, frames)],
            )
        }
    }

    fn rec(stalls: Vec<Stall>) -> Recording {
        Recording {
            threshold_ns: 50_000_000,
            ..Recording::for_tests(stalls)
        }
    }

    #[test]
    fn counts_stalls_at_or_over_the_limit_and_names_the_worst() {
        let r = rec(vec![
            stall(1000, 60, "small"),
            stall(2000, 100, "exactly"),
            stall(3210, 240, "load_tokenizer"),
        ]);
        let g = check(&r, 100_000_000);
        assert!(g.failed);
        assert_eq!(g.count, 2);
        assert_eq!(
            g.line,
            "gate: 2 stalls >= 100.0ms (worst 240.0ms at +3.21s on MainThread (tid 7), \
             in load_tokenizer (tok.py:41))"
        );
    }

    #[test]
    fn names_the_namespace_tid_in_a_container() {
        let mut worst = stall(3210, 240, "load_tokenizer");
        worst.ns_tid = Some(1);
        let g = check(&rec(vec![worst]), 100_000_000);
        assert!(
            g.line.contains("on MainThread (tid 7, 1 in its namespace)"),
            "{}",
            g.line
        );
    }

    #[test]
    fn passes_when_every_stall_is_shorter() {
        let g = check(&rec(vec![stall(1000, 99, "f")]), 100_000_000);
        assert!(!g.failed);
        assert_eq!(g.line, "gate: no stall >= 100.0ms");
        assert!(!check(&rec(vec![]), 1).failed);
    }
}
