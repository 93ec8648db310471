//! GBNF (llama.cpp's and xgrammar's EBNF, which vLLM's `guided_grammar` takes) rewritten in
//! llguidance's Lark syntax: `name ::= ...` rules become `name: ...`, `root` becomes
//! `start`, character classes become regex terminals, and string literals are re-quoted.
//! Sequences, alternatives, groups and the `* + ? {m,n}` repetitions keep their meaning.

/// The Lark text of a GBNF grammar, or what is wrong with it.
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let mut p = Gbnf { s: src.as_bytes(), at: 0 };
    let mut out = String::new();
    let mut has_root = false;
    p.skip_space(true);
    while p.at < p.s.len() {
        let name = p.name().ok_or_else(|| p.error("a rule name"))?;
        has_root |= name == "root";
        p.skip_space(true);
        if !p.eat("::=") {
            return Err(p.error("`::=`"));
        }
        out.push_str(&rule_name(&name));
        out.push_str(": ");
        p.alternatives(&mut out, 0)?;
        out.push('\n');
        p.skip_space(true);
    }
    if !has_root {
        return Err("a GBNF grammar needs a `root` rule".into());
    }
    Ok(out)
}

/// A GBNF rule name as a Lark rule name (lower case, `-` as `_`, `root` as `start`),
/// prefixed so that no two names collide and none is a Lark keyword.
fn rule_name(name: &str) -> String {
    if name == "root" {
        return "start".into();
    }
    let mut s = String::from("g_");
    for c in name.chars() {
        match c {
            'a'..='z' | '0'..='9' | '_' => s.push(c),
            '-' => s.push_str("__"),
            'A'..='Z' => {
                s.push_str("_u");
                s.push(c.to_ascii_lowercase());
            }
            _ => s.push_str(&format!("_x{:x}", c as u32)),
        }
    }
    s
}

struct Gbnf<'a> {
    s: &'a [u8],
    at: usize,
}

impl Gbnf<'_> {
    fn error(&self, wanted: &str) -> String {
        let line = self.s[..self.at.min(self.s.len())].iter().filter(|&&b| b == b'\n').count() + 1;
        format!("GBNF grammar, line {line}: expected {wanted}")
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn eat(&mut self, t: &str) -> bool {
        if self.s[self.at..].starts_with(t.as_bytes()) {
            self.at += t.len();
            true
        } else {
            false
        }
    }

    /// Skips spaces and `#` comments; newlines too when `newlines` (inside a rule a
    /// newline ends it unless the next line goes on with an operator or a group is open).
    fn skip_space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' | b'\r' => self.at += 1,
                b'\n' if newlines => self.at += 1,
                b'#' => {
                    while self.peek().is_some_and(|c| c != b'\n') {
                        self.at += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_') {
            self.at += 1;
        }
        (self.at > start).then(|| String::from_utf8_lossy(&self.s[start..self.at]).into_owned())
    }

    /// Whether the text from here starts a new rule (`name ::=`).
    fn at_rule_start(&self) -> bool {
        let mut q = Gbnf { s: self.s, at: self.at };
        q.name().is_some() && {
            q.skip_space(false);
            q.eat("::=")
        }
    }

    /// `seq | seq | ...` up to the end of the rule (depth 0) or the closing parenthesis.
    fn alternatives(&mut self, out: &mut String, depth: usize) -> Result<(), String> {
        loop {
            self.sequence(out, depth)?;
            self.skip_space(depth > 0);
            if self.eat("|") {
                out.push_str(" | ");
                continue;
            }
            return Ok(());
        }
    }

    fn sequence(&mut self, out: &mut String, depth: usize) -> Result<(), String> {
        let mut items = 0;
        loop {
            self.skip_space(depth > 0);
            // A newline at depth 0 continues the rule only when the next line does not
            // start a new rule.
            if depth == 0 && self.peek() == Some(b'\n') {
                let save = self.at;
                self.skip_space(true);
                if self.at >= self.s.len() || self.at_rule_start() {
                    self.at = save;
                    break;
                }
                continue;
            }
            if matches!(self.peek(), None | Some(b'|') | Some(b')')) {
                break;
            }
            if items > 0 {
                out.push(' ');
            }
            match self.peek() {
                None | Some(b'|') | Some(b')') => unreachable!("checked above"),
                Some(b'"') => self.literal(out)?,
                Some(b'[') => self.class(out)?,
                Some(b'(') => {
                    self.at += 1;
                    out.push('(');
                    self.alternatives(out, depth + 1)?;
                    self.skip_space(true);
                    if !self.eat(")") {
                        return Err(self.error("`)`"));
                    }
                    out.push(')');
                }
                Some(b'.') => {
                    self.at += 1;
                    out.push_str("/(?s:.)/");
                }
                Some(c) if c.is_ascii_alphanumeric() || c == b'-' || c == b'_' => {
                    let name = self.name().expect("a name starts here");
                    out.push_str(&rule_name(&name));
                }
                Some(_) => return Err(self.error("a string, a character class, a group or a rule name")),
            }
            self.repetition(out)?;
            items += 1;
        }
        if items == 0 {
            out.push_str("\"\"");
        }
        Ok(())
    }

    fn repetition(&mut self, out: &mut String) -> Result<(), String> {
        match self.peek() {
            Some(c @ (b'*' | b'+' | b'?')) => {
                self.at += 1;
                out.push(c as char);
            }
            Some(b'{') => {
                let end =
                    self.s[self.at..].iter().position(|&b| b == b'}').ok_or_else(|| self.error("`}`"))?;
                let body = String::from_utf8_lossy(&self.s[self.at + 1..self.at + end]).replace(' ', "");
                let ok = !body.is_empty()
                    && body.split(',').count() <= 2
                    && body.split(',').all(|p| p.chars().all(|c| c.is_ascii_digit()));
                if !ok || body.starts_with(',') {
                    return Err(self.error("a repetition `{m}`, `{m,}` or `{m,n}`"));
                }
                out.push_str(&format!("{{{body}}}"));
                self.at += end + 1;
            }
            _ => {}
        }
        Ok(())
    }

    /// A GBNF escape after `\`: the character it stands for.
    fn escape(&mut self) -> Result<char, String> {
        let c = self.peek().ok_or_else(|| self.error("an escape"))?;
        self.at += 1;
        let hex = |p: &mut Self, n: usize| -> Result<char, String> {
            let digits = p.s.get(p.at..p.at + n).ok_or_else(|| p.error("hex digits"))?;
            let v = u32::from_str_radix(&String::from_utf8_lossy(digits), 16)
                .map_err(|_| p.error("hex digits"))?;
            p.at += n;
            char::from_u32(v).ok_or_else(|| p.error("a valid character"))
        };
        Ok(match c {
            b'n' => '\n',
            b't' => '\t',
            b'r' => '\r',
            b'x' => hex(self, 2)?,
            b'u' => hex(self, 4)?,
            b'U' => hex(self, 8)?,
            other => other as char,
        })
    }

    /// The next character of a literal or class (UTF-8 aware).
    fn char(&mut self) -> Result<char, String> {
        let rest = std::str::from_utf8(&self.s[self.at..]).map_err(|_| self.error("UTF-8 text"))?;
        let c = rest.chars().next().ok_or_else(|| self.error("a character"))?;
        self.at += c.len_utf8();
        Ok(c)
    }

    fn literal(&mut self, out: &mut String) -> Result<(), String> {
        self.at += 1;
        let mut text = String::new();
        loop {
            match self.peek() {
                None => return Err(self.error("the closing `\"`")),
                Some(b'"') => {
                    self.at += 1;
                    break;
                }
                Some(b'\\') => {
                    self.at += 1;
                    text.push(self.escape()?);
                }
                Some(_) => text.push(self.char()?),
            }
        }
        out.push_str(&serde_json::to_string(&text).expect("a string serializes"));
        Ok(())
    }

    fn class(&mut self, out: &mut String) -> Result<(), String> {
        self.at += 1;
        let mut rx = String::from("[");
        if self.eat("^") {
            rx.push('^');
        }
        loop {
            match self.peek() {
                None => return Err(self.error("the closing `]`")),
                Some(b']') => {
                    self.at += 1;
                    break;
                }
                Some(b'\\') => {
                    self.at += 1;
                    push_class_char(&mut rx, self.escape()?);
                }
                Some(b'-') => {
                    self.at += 1;
                    rx.push('-');
                }
                Some(_) => {
                    let c = self.char()?;
                    push_class_char(&mut rx, c);
                }
            }
        }
        rx.push(']');
        out.push('/');
        out.push_str(&rx);
        out.push('/');
        Ok(())
    }
}

/// A character inside a regex class, escaped where the regex or the `/.../` literal would
/// read it otherwise.
fn push_class_char(rx: &mut String, c: char) {
    match c {
        '\\' | ']' | '[' | '^' | '-' | '/' | '&' | '~' => {
            rx.push('\\');
            rx.push(c);
        }
        '\n' => rx.push_str("\\n"),
        '\t' => rx.push_str("\\t"),
        '\r' => rx.push_str("\\r"),
        c if (c as u32) < 0x20 => rx.push_str(&format!("\\x{{{:x}}}", c as u32)),
        c => rx.push(c),
    }
}
