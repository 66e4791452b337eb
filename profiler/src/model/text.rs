//! Names are data, not markup: the one escape every name goes through
//! before it reaches a line-based output, a terminal or a log.
//!
//! In: any name the target controls (a Python qualname, a symbol, a thread
//! name, a file path, a command name). Out: the same text with control
//! characters spelled out: `\n`, `\r`, `\t` as those two characters, every
//! other C0 control, DEL and C1 control as `\xNN` (`\u{NN}` above 0xff is
//! not needed: only these code points move a cursor or end a line). A
//! newline in a qualname thus stays one line of `stalls.folded`, and a name
//! cannot rewrite the terminal. Backslashes are left alone so that ordinary
//! names print unchanged.
use std::borrow::Cow;

fn is_control(c: char) -> bool {
    c.is_control() // C0, DEL and C1 (U+0080–U+009F)
}

/// `s` with its control characters escaped; borrowed when there are none.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if is_control(c) => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn controls_are_spelled_out() {
        assert_eq!(escape("plain name (a.py:3)"), "plain name (a.py:3)");
        assert_eq!(escape("evil\nname"), "evil\\nname");
        assert_eq!(escape("a\rb\tc"), "a\\rb\\tc");
        assert_eq!(escape("\x1b[2Jx\x7f"), "\\x1b[2Jx\\x7f");
        assert_eq!(escape("\u{85}"), "\\x85");
        assert_eq!(escape("ünïcode ✓"), "ünïcode ✓");
    }
}
