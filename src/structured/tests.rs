use super::gbnf_to_lark;

#[test]
fn gbnf_rules_become_lark_rules_with_the_same_language() {
    let lark = gbnf_to_lark(
        r#"# a yes/no answer, then digits
root ::= answer " " num-list
answer ::= "yes" | "no"
num-list ::= [0-9]+ ("," [0-9]{1,3})*
  | "none"
"#,
    )
    .unwrap();
    assert_eq!(
        lark,
        "start: g_answer \" \" g_num__list\n\
         g_answer: \"yes\" | \"no\"\n\
         g_num__list: /[0-9]/+ (\",\" /[0-9]/{1,3})* | \"none\"\n"
    );
}

#[test]
fn gbnf_escapes_and_negated_classes_survive() {
    let lark = gbnf_to_lark(r#"root ::= "\"q\"\n" [^"\\/] "\x41""#).unwrap();
    assert_eq!(lark, "start: \"\\\"q\\\"\\n\" /[^\"\\\\\\/]/ \"A\"\n");
}

#[test]
fn malformed_gbnf_names_the_line_and_what_was_expected() {
    assert_eq!(
        gbnf_to_lark("root ::= \"a\"\nx ::= (\"b\"").unwrap_err(),
        "GBNF grammar, line 2: expected `)`"
    );
    assert_eq!(gbnf_to_lark("answer ::= \"a\"").unwrap_err(), "a GBNF grammar needs a `root` rule");
    assert!(gbnf_to_lark("root := \"a\"").unwrap_err().contains("`::=`"));
}
