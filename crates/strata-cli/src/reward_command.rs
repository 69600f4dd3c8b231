//! GRPO's rewards from a command: each generation batch's completions go to a shell
//! command as JSON lines on its standard input — the prompt record's fields with
//! `"completion"`, the text generated (for a conversation's prompt, a list of one assistant
//! message, as TRL hands conversational completions to reward functions) — and it writes
//! one reward per line: a number, or `null` (or `nan`) where it can give none.
//!
//! Owns running the command and reading its answer. Must not train.
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use strata::data::{PromptSet, Tokenizer};
use strata::run::grpo::{RewardFn, Sample};

/// The reward of `command` (run by `sh -c`) for completions of `prompts`' records, their
/// tokens turned to text by `tokenizer` (special tokens left out).
pub fn command_reward(command: String, prompts: Arc<PromptSet>, tokenizer: Arc<Tokenizer>) -> RewardFn {
    Arc::new(move |samples: &[Sample<'_>]| -> strata::Result<Vec<f64>> {
        let fail = |why: String| strata::Error::Data(format!("--reward-command {command:?}: {why}"));
        let mut input = String::new();
        for s in samples {
            let ids: Vec<u32> = s.completion.iter().map(|&t| t as u32).collect();
            let text = tokenizer.decode_text(&ids)?;
            let mut record = prompts.record(s.record).clone();
            let completion = match record.get("prompt") {
                Some(serde_json::Value::Array(_)) => serde_json::json!([{"role": "assistant", "content": text}]),
                _ => serde_json::Value::String(text),
            };
            record.insert("completion".into(), completion);
            input.push_str(&serde_json::Value::Object(record).to_string());
            input.push('\n');
        }
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(&command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| fail(format!("cannot start it ({e})")))?;
        // Written from a thread: a command that answers while still reading cannot block us.
        let mut stdin = child.stdin.take().ok_or_else(|| fail("no standard input".into()))?;
        let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
        let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
        // A command that exits before reading everything closes the pipe: its status says why.
        let written = writer.join().map_err(|_| fail("the writer failed".into()))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(fail(format!("{} ({})", out.status, stderr.trim().lines().last().unwrap_or(""))));
        }
        written.map_err(|e| fail(format!("writing its input: {e}")))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let rewards = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(i, line)| match line.trim() {
                "null" | "nan" | "NaN" | "None" => Ok(f64::NAN),
                value => value.parse::<f64>().map_err(|_| fail(format!("line {}: {value:?} is not a reward", i + 1))),
            })
            .collect::<strata::Result<Vec<f64>>>()?;
        if rewards.len() != samples.len() {
            return Err(fail(format!("it wrote {} rewards for {} completions", rewards.len(), samples.len())));
        }
        Ok(rewards)
    })
}
