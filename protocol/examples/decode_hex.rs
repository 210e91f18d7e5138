//! Decodes intent bodies given as hex, one per stdin line, and prints one verdict per line:
//! `ok` or `<code> <field>` (`-` when the error names no field). The Python client's tests feed
//! it generated bodies to check that their validator agrees with this decoder on every one.

use std::io::{BufRead, Write};

use protocol::{decode_intent, DecodeError};

/// The field the error names, as hex (field names come from the body), or `-`.
fn field(e: &DecodeError) -> String {
    let name = match e {
        DecodeError::DuplicateField(f) | DecodeError::UnknownField(f) => f.as_str(),
        DecodeError::MissingField(f) | DecodeError::EmptyField(f) => f,
        DecodeError::WrongType { field, .. }
        | DecodeError::TooLong { field, .. }
        | DecodeError::InvalidCharacters { field, .. } => field,
        DecodeError::TooLarge { .. }
        | DecodeError::NotJson(_)
        | DecodeError::NotAnObject
        | DecodeError::KeyTooLong { .. }
        | DecodeError::NulCharacter(_) => return "-".to_string(),
    };
    name.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(line: &str) -> Vec<u8> {
    (0..line.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&line[i..i + 2], 16).expect("hex input"))
        .collect()
}

fn main() {
    let stdin = std::io::stdin();
    let mut out = std::io::BufWriter::new(std::io::stdout());
    for line in stdin.lock().lines() {
        let body = unhex(line.expect("stdin").trim());
        match decode_intent(&body) {
            Ok(_) => writeln!(out, "ok"),
            Err(e) => writeln!(out, "{} {}", e.code(), field(&e)),
        }
        .expect("stdout");
    }
}
