//! The Hermes tool-call format (Qwen2.5/Qwen3, verl's default `multi_turn.format`): each call is
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the assistant's text.

use serde_json::Value;

pub const START: &str = "<tool_call>";
pub const END: &str = "</tool_call>";

/// One parsed call: the function name and its arguments (a JSON object, or whatever the model wrote there).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

/// The calls in `text`, in order. A block whose body is not `{"name": string, "arguments": ...}` JSON is
/// skipped, as verl's parser does; arguments given as a JSON string are parsed when they hold JSON.
pub fn parse(text: &str) -> Vec<ToolCall> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(START) {
        let after = &rest[start + START.len()..];
        let Some(end) = after.find(END) else { break };
        if let Some(call) = decode(after[..end].trim()) {
            calls.push(call);
        } else {
            tracing::debug!(body = %after[..end].trim(), "undecodable tool call skipped");
        }
        rest = &after[end + END.len()..];
    }
    calls
}

fn decode(body: &str) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(body).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments").cloned().unwrap_or(Value::Object(Default::default())) {
        Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
        other => other,
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_well_formed_block_is_a_call_in_order() {
        let text = "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2+2\"}}\n</tool_call>\n\
                    <tool_call>{\"name\": \"python\", \"arguments\": \"{\\\"code\\\": \\\"print(1)\\\"}\"}</tool_call>";
        let calls = parse(text);
        assert_eq!(
            calls,
            vec![
                ToolCall { name: "calculator".into(), arguments: json!({"expression": "2+2"}) },
                ToolCall { name: "python".into(), arguments: json!({"code": "print(1)"}) },
            ]
        );
    }

    #[test]
    fn malformed_and_unterminated_blocks_are_skipped() {
        assert!(parse("no calls here").is_empty());
        assert!(parse("<tool_call>{not json}</tool_call>").is_empty());
        assert!(parse("<tool_call>{\"arguments\": {}}</tool_call>").is_empty(), "a call needs a name");
        assert!(parse("<tool_call>{\"name\": \"calculator\"").is_empty(), "unterminated");
        let calls = parse("<tool_call>bad</tool_call><tool_call>{\"name\": \"x\"}</tool_call>");
        assert_eq!(calls, vec![ToolCall { name: "x".into(), arguments: json!({}) }]);
    }
}
