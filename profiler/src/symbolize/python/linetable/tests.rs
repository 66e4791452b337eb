//! Decoders checked against real tables: `cases_3XX.rs` hold `co_linetable`
//! bytes and `co_lines()` output printed by each pyenv interpreter
//! (`gen_cases.py`; regenerate with
//! `for v in 3.10.13 3.11.7 3.12.1 3.13.0; do /root/.pyenv/versions/$v/bin/python3 gen_cases.py > cases_$(echo $v | cut -d. -f1,2 | tr -d .).rs; done`;
//! 3.14 and 3.15 with Debian's builds in the forky root: `chroot ROOT python3.14 /tmp/gen_cases.py > cases_314.rs`).

use super::*;

struct Case {
    name: &'static str,
    first_line: u32,
    code_len: u32,
    table: &'static [u8],
    /// `co_lines()`: (start, end, line), line -1 for None.
    lines: &'static [(u32, u32, i64)],
}

include!("cases_310.rs");
include!("cases_311.rs");
include!("cases_312.rs");
include!("cases_313.rs");
include!("cases_314.rs");
include!("cases_315.rs");

fn check(format: LineTableFormat, cases: &[Case]) {
    for case in cases {
        let ranges = decode(format, case.table, case.first_line);
        let mut covered = 0;
        for &(start, end, line) in case.lines {
            let want = u32::try_from(line).ok();
            for addr in (start..end).step_by(2) {
                assert_eq!(
                    line_at(&ranges, addr),
                    want,
                    "{}: offset {addr} (range {start}..{end})",
                    case.name
                );
                covered += 2;
            }
        }
        assert_eq!(
            covered, case.code_len,
            "{}: co_lines covers the bytecode",
            case.name
        );
        assert_eq!(
            line_at(&ranges, case.code_len),
            None,
            "{}: past the end",
            case.name
        );
    }
}

#[test]
fn pep626_table_matches_co_lines_310() {
    check(LineTableFormat::Pep626, CASES_310);
}

#[test]
fn location_table_matches_co_lines_311() {
    check(LineTableFormat::Locations, CASES_311);
}

#[test]
fn location_table_matches_co_lines_312() {
    check(LineTableFormat::Locations, CASES_312);
}

#[test]
fn location_table_matches_co_lines_313() {
    check(LineTableFormat::Locations, CASES_313);
}

/// Debian's 3.14.8 and 3.15.0 (the forky root of docs/containers.md):
/// the location table is unchanged.
#[test]
fn location_table_matches_co_lines_314_315() {
    check(LineTableFormat::Locations, CASES_314);
    check(LineTableFormat::Locations, CASES_315);
}

#[test]
fn cases_exercise_every_entry_kind() {
    let kinds: std::collections::BTreeSet<u8> =
        [CASES_311, CASES_312, CASES_313, CASES_314, CASES_315]
            .iter()
            .flat_map(|cases| cases.iter())
            .flat_map(|c| {
                c.table
                    .iter()
                    .filter(|b| *b & 0x80 != 0)
                    .map(|b| (b >> 3) & 15)
            })
            .collect();
    for code in [
        CODE_NO_LOCATION,
        CODE_LONG,
        CODE_NO_COLUMNS,
        CODE_ONE_LINE0,
        0,
    ] {
        assert!(
            kinds.contains(&code),
            "no entry with code {code} in the cases: {kinds:?}"
        );
    }
    // 3.10: a >255-byte run (split pairs) and a >127-line jump (0, 127) pairs.
    let t310: Vec<&[u8]> = CASES_310.iter().map(|c| c.table).collect();
    assert!(t310.iter().any(|t| t.chunks(2).any(|p| p == [0, 127])));
    assert!(t310.iter().any(|t| t.chunks(2).any(|p| p[0] > 200)));
}

#[test]
fn torn_tables_do_not_panic() {
    for cases in [CASES_311, CASES_312, CASES_313, CASES_314, CASES_315] {
        for case in cases {
            for cut in 0..case.table.len() {
                let _ = decode(
                    LineTableFormat::Locations,
                    &case.table[..cut],
                    case.first_line,
                );
                let _ = decode(
                    LineTableFormat::Locations,
                    &case.table[cut..],
                    case.first_line,
                );
            }
        }
    }
    let _ = decode(LineTableFormat::Pep626, &[1, 2, 3], 1);
    let _ = decode(LineTableFormat::Locations, &[0xff, 0xff, 0xff], 0);
    let _ = decode(
        LineTableFormat::Locations,
        &[
            0xf0, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f,
        ],
        1,
    );
}
