//! RFC 8785 canonical JSON: key order by UTF-16 code units, JCS string escaping and
//! ECMAScript number form, checked against the RFC's own examples and test vectors.

use protocol::canonical_json;
use serde_json::{json, Value};

fn canon(text: &str) -> String {
    canonical_json(&serde_json::from_str::<Value>(text).unwrap())
}

fn canon_f64(x: f64) -> String {
    canonical_json(&Value::from(x))
}

#[test]
fn rfc8785_section_3_2_2_example() {
    let input = r#"{
        "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
        "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
        "literals": [null, true, false]
    }"#;
    assert_eq!(
        canon(input),
        r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
    );
}

#[test]
fn rfc8785_section_3_2_3_sorting_example() {
    let input = r#"{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh",
        "1":"One","\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}"#;
    assert_eq!(
        canon(input),
        "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
         \"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\
         \"😀\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
    );
}

#[test]
fn keys_sort_by_utf16_not_utf8() {
    // UTF-8 puts U+E000 (EE..) before U+10000 (F0..); UTF-16 puts the surrogate pair
    // D800 DC00 before E000.
    let v = json!({"\u{e000}": 1, "\u{10000}": 2});
    assert_eq!(canonical_json(&v), "{\"\u{10000}\":2,\"\u{e000}\":1}");
}

#[test]
fn no_whitespace_and_nested_keys_sorted() {
    let text = "{ \"b\" : [ 1 , { \"z\" : null , \"a\" : true } ] ,\n\t\"a\" : { } , \"c\" : [ ] }";
    assert_eq!(
        canon(text),
        r#"{"a":{},"b":[1,{"a":true,"z":null}],"c":[]}"#
    );
}

#[test]
fn string_escapes() {
    let v = json!("q\" b\\ \u{8}\u{c}\n\r\t \u{0}\u{1f}\u{7f} /é😀");
    assert_eq!(
        canonical_json(&v),
        "\"q\\\" b\\\\ \\b\\f\\n\\r\\t \\u0000\\u001f\u{7f} /é😀\""
    );
}

#[test]
fn integers_and_integral_floats() {
    assert_eq!(canon("4850"), "4850");
    assert_eq!(canon("4850.0"), "4850");
    assert_eq!(canon("4.85e3"), "4850");
    assert_eq!(canon("-0.0"), "0");
    assert_eq!(canon("-0"), "0");
    assert_eq!(canon("-17"), "-17");
    assert_eq!(canon("18446744073709551615"), "18446744073709551615");
    assert_eq!(canon("-9223372036854775808"), "-9223372036854775808");
    // Beyond u64, serde_json (without arbitrary_precision) hands over an f64.
    assert_eq!(canon("100000000000000000000"), "100000000000000000000");
    assert_eq!(canon("1000000000000000000000"), "1e+21");
}

#[test]
fn rfc8785_number_examples() {
    assert_eq!(canon("333333333.33333329"), "333333333.3333333");
    assert_eq!(canon("1E30"), "1e+30");
    assert_eq!(canon("4.50"), "4.5");
    assert_eq!(canon("2e-3"), "0.002");
    assert_eq!(canon("0.000001"), "0.000001");
    assert_eq!(canon("1e-7"), "1e-7");
    assert_eq!(canon("1.5e-7"), "1.5e-7");
    assert_eq!(canon("123.456"), "123.456");
    assert_eq!(canon("1e21"), "1e+21");
}

#[test]
fn rfc8785_appendix_b_ieee_vectors() {
    let vectors: [(u64, &str); 24] = [
        (0x0000000000000000, "0"),
        (0x8000000000000000, "0"),
        (0x0000000000000001, "5e-324"),
        (0x8000000000000001, "-5e-324"),
        (0x7fefffffffffffff, "1.7976931348623157e+308"),
        (0xffefffffffffffff, "-1.7976931348623157e+308"),
        (0x4340000000000000, "9007199254740992"),
        (0xc340000000000000, "-9007199254740992"),
        (0x4430000000000000, "295147905179352830000"),
        (0x44b52d02c7e14af5, "9.999999999999997e+22"),
        (0x44b52d02c7e14af6, "1e+23"),
        (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
        (0x444b1ae4d6e2ef4e, "999999999999999700000"),
        (0x444b1ae4d6e2ef4f, "999999999999999900000"),
        (0x444b1ae4d6e2ef50, "1e+21"),
        (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
        (0x3eb0c6f7a0b5ed8d, "0.000001"),
        (0x41b3de4355555553, "333333333.3333332"),
        (0x41b3de4355555554, "333333333.33333325"),
        (0x41b3de4355555555, "333333333.3333333"),
        (0x41b3de4355555556, "333333333.3333334"),
        (0x41b3de4355555557, "333333333.33333343"),
        (0xbecbf647612f3696, "-0.0000033333333333333333"),
        (0x43143ff3c1cb0959, "1424953923781206.2"),
    ];
    for (bits, expected) in vectors {
        assert_eq!(canon_f64(f64::from_bits(bits)), expected, "{bits:#018x}");
    }
}
