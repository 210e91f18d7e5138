//! Characters that change how text looks without being seen: Unicode's `Default_Ignorable_Code_Point`
//! set (zero-width spaces and joiners, the soft hyphen, variation selectors, tag characters, the
//! Hangul fillers, the byte-order mark...), which holds every `Bidi_Control` character (the
//! marks, embeddings, overrides and isolates that reorder text), and the line and paragraph
//! separators (U+2028, U+2029). Shown raw they can make one id look like another or turn a line
//! around; a display writes them as `\u{NNNN}` and a name refuses them.

/// The ranges of `Default_Ignorable_Code_Point` (Unicode 16.0, DerivedCoreProperties.txt).
const DEFAULT_IGNORABLE: [(u32, u32); 17] = [
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
];

/// Whether `c` is a `Default_Ignorable_Code_Point` (every `Bidi_Control` character is one).
pub fn is_default_ignorable(c: char) -> bool {
    let c = c as u32;
    DEFAULT_IGNORABLE
        .iter()
        .any(|(from, to)| (*from..=*to).contains(&c))
}

/// Whether `c` is a `Bidi_Control` character (U+061C, U+200E, U+200F, U+202A..U+202E,
/// U+2066..U+2069).
pub fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Whether `c` would not be seen as itself: a control character, a default-ignorable one, or a
/// line or paragraph separator.
pub fn is_unseen(c: char) -> bool {
    c.is_control() || is_default_ignorable(c) || matches!(c, '\u{2028}' | '\u{2029}')
}

/// `s` with every unseen character (see [`is_unseen`]) other than newline and tab written as
/// `\xNN` (below U+0100) or `\u{NNNN}`, so it shows as text.
pub fn visible(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' | '\t' => out.push(c),
            c if is_unseen(c) && (c as u32) < 0x100 => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c if is_unseen(c) => out.push_str(&format!("\\u{{{:04x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_character_the_probe_found_raw_is_written_out() {
        for c in [
            '\u{061c}',
            '\u{2060}',
            '\u{feff}',
            '\u{00ad}',
            '\u{2028}',
            '\u{e0041}',
            '\u{3164}',
            '\u{202e}',
            '\u{200b}',
            '\u{2066}',
            '\u{180e}',
            '\u{fe0f}',
            '\u{1d173}',
        ] {
            assert!(is_unseen(c), "U+{:04X}", c as u32);
            let shown = visible(&format!("a{c}b"));
            let written = if (c as u32) < 0x100 {
                format!("\\x{:02x}", c as u32)
            } else {
                format!("\\u{{{:04x}}}", c as u32)
            };
            assert_eq!(shown, format!("a{written}b"));
        }
        assert_eq!(
            visible("tab\tnl\nnul\0bell\u{7}"),
            "tab\tnl\nnul\\x00bell\\x07"
        );
        assert_eq!(
            visible("plain é ü 中文 emoji 🙂"),
            "plain é ü 中文 emoji 🙂"
        );
    }

    #[test]
    fn bidi_controls_are_default_ignorable() {
        for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
            if is_bidi_control(c) {
                assert!(is_default_ignorable(c), "U+{:04X}", c as u32);
            }
        }
        assert!(!is_default_ignorable('a'));
        assert!(!is_default_ignorable('\u{0600}'));
    }
}
