//! What opens each output file: the one table of those words, which the
//! summary prints after `wrote:` and the README's table of outputs
//! follows (a test checks it lists every file here).
//!
//! In: an output's file name. Out: what to open it with, `{path}` standing
//! for the file's path and `{dir}` for its directory; None for a file no
//! viewer reads (the saved raw events).

/// Each output file and what opens it.
pub const OPEN_WITH: &[(&str, &str)] = &[
    ("stalls.json", "stallprof report {dir}"),
    ("stalls.folded", "speedscope, inferno"),
    ("stalls.svg", "open in a web browser"),
    ("stalls.pb.gz", "go tool pprof -http=127.0.0.1:8080 {path}"),
    ("stalls.pftrace", "https://ui.perfetto.dev"),
    ("stalls.speedscope.json", "https://www.speedscope.app"),
];

/// What opens `path` (by its file name), with its path and directory
/// filled in; None for a file the table does not name.
pub fn open_with(path: &str) -> Option<String> {
    let (dir, name) = match path.rsplit_once('/') {
        Some(("", name)) => ("/", name),
        Some((dir, name)) => (dir, name),
        None => (".", path),
    };
    let (_, how) = OPEN_WITH.iter().find(|(file, _)| *file == name)?;
    Some(how.replace("{path}", path).replace("{dir}", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_file_says_what_opens_it() {
        assert_eq!(
            open_with("out/stalls.pb.gz").as_deref(),
            Some("go tool pprof -http=127.0.0.1:8080 out/stalls.pb.gz")
        );
        assert_eq!(
            open_with("/tmp/r/stalls.json").as_deref(),
            Some("stallprof report /tmp/r")
        );
        assert_eq!(
            open_with("stalls.json").as_deref(),
            Some("stallprof report .")
        );
        assert_eq!(open_with("out/events.bin.gz"), None);
    }

    /// Every file the README's table of outputs names has its words here
    /// (the table is the README's longer say of the same).
    #[test]
    fn every_file_of_the_readme_table_is_here() {
        let readme = include_str!("../../../README.md");
        let table: Vec<&str> = readme
            .lines()
            .skip_while(|l| !l.starts_with("Outputs in `DIR`, and what opens each"))
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
            .collect();
        assert!(table.len() >= 5, "README.md's table of outputs: {table:?}");
        for file in table {
            assert!(
                OPEN_WITH.iter().any(|(f, _)| *f == file),
                "{file} is in README.md's table of outputs, not in OPEN_WITH"
            );
        }
    }
}
