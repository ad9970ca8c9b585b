//! `calculator`: evaluates an arithmetic expression. Pure Rust, no subprocess: numbers, `+ - * / // % ^ **`,
//! parentheses, unary signs, `pi`, `e` and the functions `sqrt abs exp ln log log10 log2 sin cos tan floor ceil
//! round min max pow`.

use futures::future::BoxFuture;
use serde_json::{json, Value};

use super::{Tool, ToolError, ToolOutput};

/// Longest expression accepted, and deepest nesting: a model can write anything.
const MAX_LEN: usize = 2000;
const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, Copy, Default)]
pub struct Calculator;

impl Tool for Calculator {
    fn name(&self) -> &str {
        "calculator"
    }

    fn schema(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression, e.g. \"(3 + 4) * 2 ^ 10 / sqrt(2)\".",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "the expression"}},
                    "required": ["expression"],
                },
            },
        })
    }

    fn call(&self, arguments: Value) -> BoxFuture<'_, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let expression = match &arguments {
                Value::Object(map) => map.get("expression").and_then(Value::as_str),
                Value::String(s) => Some(s.as_str()),
                _ => None,
            }
            .ok_or_else(|| ToolError::Arguments("expected {\"expression\": \"...\"}".into()))?;
            let value = evaluate(expression).map_err(ToolError::Execution)?;
            Ok(ToolOutput::text(format_number(value)))
        })
    }
}

/// An integer-valued result prints without a fraction (`12`, not `12.0`).
fn format_number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

/// Evaluates `expression`; errors name what is wrong and where.
pub fn evaluate(expression: &str) -> Result<f64, String> {
    if expression.len() > MAX_LEN {
        return Err(format!("expression longer than {MAX_LEN} characters"));
    }
    let tokens = tokenize(expression)?;
    let mut parser = Parser { tokens, pos: 0, depth: 0 };
    let value = parser.expr()?;
    if let Some(t) = parser.tokens.get(parser.pos) {
        return Err(format!("unexpected {t:?} at token {}", parser.pos + 1));
    }
    if !value.is_finite() {
        return Err(format!("the result is not a finite number ({value})"));
    }
    Ok(value)
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Number(f64),
    Ident(String),
    Op(&'static str),
    Open,
    Close,
    Comma,
}

fn tokenize(s: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '0'..='9' | '.' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.' || chars[i] == '_') {
                    i += 1;
                }
                // exponent: 1e-3
                if i < chars.len() && (chars[i] == 'e' || chars[i] == 'E') {
                    let mut j = i + 1;
                    if j < chars.len() && (chars[j] == '+' || chars[j] == '-') {
                        j += 1;
                    }
                    if j < chars.len() && chars[j].is_ascii_digit() {
                        i = j;
                        while i < chars.len() && chars[i].is_ascii_digit() {
                            i += 1;
                        }
                    }
                }
                let text: String = chars[start..i].iter().filter(|&&c| c != '_').collect();
                let value = text.parse::<f64>().map_err(|_| format!("bad number {text:?}"))?;
                out.push(Token::Number(value));
            }
            c if c.is_alphabetic() => {
                let start = i;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                out.push(Token::Ident(chars[start..i].iter().collect::<String>().to_lowercase()));
            }
            '(' => {
                out.push(Token::Open);
                i += 1;
            }
            ')' => {
                out.push(Token::Close);
                i += 1;
            }
            ',' => {
                out.push(Token::Comma);
                i += 1;
            }
            _ => {
                let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
                let op = match two.as_str() {
                    "**" => Some("^"),
                    "//" => Some("//"),
                    _ => None,
                };
                if let Some(op) = op {
                    out.push(Token::Op(op));
                    i += 2;
                    continue;
                }
                let op = match c {
                    '+' => "+",
                    '-' | '−' => "-",
                    '*' | '×' => "*",
                    '/' | '÷' => "/",
                    '%' => "%",
                    '^' => "^",
                    other => return Err(format!("unexpected character {other:?}")),
                };
                out.push(Token::Op(op));
                i += 1;
            }
        }
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn peek_op(&self) -> Option<&'static str> {
        match self.tokens.get(self.pos) {
            Some(Token::Op(op)) => Some(op),
            _ => None,
        }
    }

    fn expr(&mut self) -> Result<f64, String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH}"));
        }
        let mut value = self.term()?;
        while let Some(op @ ("+" | "-")) = self.peek_op() {
            self.pos += 1;
            let rhs = self.term()?;
            value = if op == "+" { value + rhs } else { value - rhs };
        }
        self.depth -= 1;
        Ok(value)
    }

    fn term(&mut self) -> Result<f64, String> {
        let mut value = self.unary()?;
        while let Some(op @ ("*" | "/" | "//" | "%")) = self.peek_op() {
            self.pos += 1;
            let rhs = self.unary()?;
            if op != "*" && rhs == 0.0 {
                return Err("division by zero".into());
            }
            value = match op {
                "*" => value * rhs,
                "/" => value / rhs,
                "//" => (value / rhs).floor(),
                _ => value - rhs * (value / rhs).floor(),
            };
        }
        Ok(value)
    }

    fn unary(&mut self) -> Result<f64, String> {
        match self.peek_op() {
            Some("-") => {
                self.pos += 1;
                Ok(-self.unary()?)
            }
            Some("+") => {
                self.pos += 1;
                self.unary()
            }
            _ => self.power(),
        }
    }

    /// Right-associative, binding tighter than a unary minus on its left (`-2^2` = -4).
    fn power(&mut self) -> Result<f64, String> {
        let base = self.primary()?;
        if self.peek_op() == Some("^") {
            self.pos += 1;
            let exponent = self.unary()?;
            return Ok(base.powf(exponent));
        }
        Ok(base)
    }

    fn primary(&mut self) -> Result<f64, String> {
        let token = self.tokens.get(self.pos).cloned().ok_or("the expression ends too early")?;
        self.pos += 1;
        match token {
            Token::Number(v) => Ok(v),
            Token::Open => {
                let v = self.expr()?;
                self.expect_close()?;
                Ok(v)
            }
            Token::Ident(name) => {
                if self.tokens.get(self.pos) != Some(&Token::Open) {
                    return match name.as_str() {
                        "pi" => Ok(std::f64::consts::PI),
                        "e" => Ok(std::f64::consts::E),
                        other => Err(format!("unknown name {other:?}")),
                    };
                }
                self.pos += 1;
                let mut args = vec![self.expr()?];
                while self.tokens.get(self.pos) == Some(&Token::Comma) {
                    self.pos += 1;
                    args.push(self.expr()?);
                }
                self.expect_close()?;
                apply(&name, &args)
            }
            other => Err(format!("unexpected {other:?}")),
        }
    }

    fn expect_close(&mut self) -> Result<(), String> {
        if self.tokens.get(self.pos) == Some(&Token::Close) {
            self.pos += 1;
            Ok(())
        } else {
            Err("missing `)`".into())
        }
    }
}

fn apply(name: &str, args: &[f64]) -> Result<f64, String> {
    let one = |f: fn(f64) -> f64| -> Result<f64, String> {
        match args {
            [x] => Ok(f(*x)),
            _ => Err(format!("{name}() takes one argument, got {}", args.len())),
        }
    };
    match name {
        "sqrt" => match args {
            [x] if *x < 0.0 => Err("sqrt of a negative number".into()),
            _ => one(f64::sqrt),
        },
        "abs" => one(f64::abs),
        "exp" => one(f64::exp),
        "ln" | "log" if args.len() == 1 => match args[0] {
            x if x <= 0.0 => Err(format!("{name} of a non-positive number")),
            _ => one(f64::ln),
        },
        "log" => match args {
            [x, base] if *x > 0.0 && *base > 0.0 && *base != 1.0 => Ok(x.ln() / base.ln()),
            _ => Err("log(x, base) needs x > 0 and a positive base other than 1".into()),
        },
        "log10" => one(f64::log10),
        "log2" => one(f64::log2),
        "sin" => one(f64::sin),
        "cos" => one(f64::cos),
        "tan" => one(f64::tan),
        "floor" => one(f64::floor),
        "ceil" => one(f64::ceil),
        "round" => one(f64::round),
        "min" | "max" if !args.is_empty() => {
            let init = if name == "min" { f64::INFINITY } else { f64::NEG_INFINITY };
            Ok(args.iter().fold(init, |a, &b| if name == "min" { a.min(b) } else { a.max(b) }))
        }
        "pow" => match args {
            [x, y] => Ok(x.powf(*y)),
            _ => Err("pow(x, y) takes two arguments".into()),
        },
        other => Err(format!("unknown function {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_associativity_and_functions_follow_school_math() {
        let cases = [
            ("1 + 2 * 3", 7.0),
            ("(1 + 2) * 3", 9.0),
            ("2 ^ 3 ^ 2", 512.0),
            ("2 ** 10", 1024.0),
            ("-2 ^ 2", -4.0),
            ("7 // 2", 3.0),
            ("-7 % 3", 2.0),
            ("sqrt(16) + abs(-3)", 7.0),
            ("max(1, 5, 3) - min(4, 2)", 3.0),
            ("log(8, 2)", 3.0),
            ("1e3 / 4", 250.0),
            ("1_000 * 2", 2000.0),
        ];
        for (expression, expected) in cases {
            let got = evaluate(expression).unwrap();
            assert!((got - expected).abs() < 1e-9, "{expression} = {got}, expected {expected}");
        }
        assert!((evaluate("pi").unwrap() - std::f64::consts::PI).abs() < 1e-12);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        for bad in ["1 / 0", "1 +", "(1 + 2", "sqrt(-1)", "foo(1)", "2 $ 3", "", "1 2", "ln(0)", "10 ^ 400"] {
            assert!(evaluate(bad).is_err(), "{bad:?} should fail");
        }
        let deep = "(".repeat(500) + "1" + &")".repeat(500);
        assert!(evaluate(&deep).is_err());
        assert!(evaluate(&"1+".repeat(2000)).is_err());
    }

    #[test]
    fn integer_results_print_without_a_fraction() {
        assert_eq!(format_number(12.0), "12");
        assert_eq!(format_number(0.5), "0.5");
    }
}
