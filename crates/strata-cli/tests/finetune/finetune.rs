//! Fine-tuning data end to end: example files (prompt and completion, conversations through
//! a chat template) learn only what they should, and the step's loss weighs every learned
//! token of the global batch alike, however the batch is split into micro-batches, ranks
//! and pipeline stages.
use crate::common;
use crate::TENSOR_AND_SEQUENCE;

use crate::common::{assert_fails_with, assert_follows, reports, stderr, strata, strata_env, Run};
use std::path::{Path, PathBuf};
use std::process::Command;
use strata::data::chat::ChatTemplate;
use strata::data::Tokenizer;

/// The model, and the step's shape and optimizer, of every run here.
const MODEL: &str = "--model gpt --layers 2 --heads 2 --dim 32 --seed 3";
const RUN: &str =
    "--batch-size 32 --max-length 48 --schedule constant --threads 1 --lr 0.003 --log-every 1000 --grad-clip 0";

fn words(flags: &str) -> Vec<&str> {
    flags.split_whitespace().collect()
}

/// 96 prompt-and-completion records of different lengths: sums written out, with prompts of
/// 10 to 40 bytes and completions of 2 to 12, so micro-batches hold very different numbers
/// of learned tokens.
pub(crate) fn example_file(dir: &Path) -> PathBuf {
    let path = dir.join("sums.jsonl");
    let mut state = 12345u64;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let lines: Vec<String> = (0..96)
        .map(|_| {
            let terms: Vec<u64> = (0..2 + next(6)).map(|_| next(100)).collect();
            let prompt = terms.iter().map(u64::to_string).collect::<Vec<_>>().join("+") + "=";
            let completion = format!("{}{}", terms.iter().sum::<u64>(), ".".repeat(next(10) as usize));
            serde_json::json!({"prompt": prompt, "completion": completion}).to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// `strata train` on the example file with `extra` flags (for 6 steps unless they say).
fn train(dir: &Path, name: &str, extra: &[&str]) -> Run {
    let data = example_file(dir);
    let (w, m) = (dir.join(format!("{name}.st")), dir.join(format!("{name}.jsonl")));
    let files =
        ["--data", data.to_str().unwrap(), "--save-weights", w.to_str().unwrap(), "--metrics", m.to_str().unwrap()];
    let steps: &[&str] = if extra.contains(&"--steps") { &[] } else { &["--steps", "6"] };
    let args = [&["train"][..], &words(MODEL), &words(RUN), &files, steps, extra].concat();
    let cache = dir.join("cache");
    let o = strata_env(&args, &[("STRATA_CACHE", cache.to_str().unwrap())]);
    assert!(o.status.success(), "{name} {extra:?}:\n{}", stderr(&o));
    (w, m)
}

/// One process, the whole batch of 32 rows (one example each, or packed) in one
/// micro-batch: trained once per test binary.
fn one_batch(packed: bool) -> Run {
    let name = if packed { "one-packed" } else { "one" };
    let flags: &[&str] = if packed { &["--pack", "true"] } else { &[] };
    let dir = common::shared_dir(name, |dir| {
        train(dir, "one", flags);
    });
    (dir.join("one.st"), dir.join("one.jsonl"))
}

/// Rows (packed or not) split by `extra` reach the losses and weights of one batch of 32,
/// and report the same learned tokens per step.
fn same_as_one_batch(packed: bool, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let what = format!("packed {packed}, {extra:?}");
    let flags: &[&str] = if packed { &["--pack", "true"] } else { &[] };
    let run = train(dir.path(), "run", &[flags, extra].concat());
    let one = one_batch(packed);
    // Losses to 1e-6; weights to 2e-6: the split layouts sum in other orders (a context
    // ring's blocks run the fused kernel where one process runs the composite), and AdamW
    // carries fp32's rounding of the smallest gradients to ~1e-6 of the weights in 6 steps.
    assert_follows(&one, &run, &what, 1e-6, 2e-6);
    let learned = |m: &Path| reports(m).iter().map(|r| r["supervised_tokens"].as_u64().unwrap()).collect::<Vec<_>>();
    assert_eq!(learned(&one.1), learned(&run.1), "{what}: learned tokens per step");
}

const PIPELINE: &str = r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {"schedule": "1f1b"}]]"#;

/// Context parallelism: the ring (each rank an early and a late quarter of every row), with
/// recomputed blocks; the all-to-all beside fsdp, tensor and sequence parallel beside the
/// ring, and the ring in two pipeline stages, each over four ranks.
const RING: &str = r#"[["context_parallel", {"size": 2}], ["checkpoint", ["GptBlock"]]]"#;
const ALL_TO_ALL_FSDP: &str = r#"[["context_parallel", {"size": 2, "kind": "all_to_all"}], "fsdp"]"#;
const RING_TENSOR_AND_SEQUENCE: &str = r#"[["parallel_mode", [[["tensor", 2], ["context", 2]], null]],
    ["tensor_parallel", {"sequence_parallel": true}], "context_parallel"]"#;
const RING_PIPELINE: &str = r#"[["parallel_mode", [[["context", 2], ["pipeline", 2]], null]],
    ["pipeline_parallel", {"schedule": "1f1b"}], "context_parallel"]"#;

/// One test per layout, unpacked and packed.
macro_rules! same_as_one_batch {
    ($($case:ident: $packed:expr, [$($flag:expr),*];)*) => {$(
        #[test]
        fn $case() {
            same_as_one_batch($packed, &[$($flag),*]);
        }
    )*};
}

same_as_one_batch! {
    eight_by_accumulation_4_is_one_batch_of_32: false, ["--accumulation", "4"];
    four_zero2_ranks_of_8_are_one_batch_of_32: false, ["--nproc", "4", "--strategy", r#"["zero2"]"#];
    four_fsdp_ranks_of_8_are_one_batch_of_32: false, ["--nproc", "4", "--strategy", r#"["fsdp"]"#];
    two_pipeline_stages_of_4_micro_batches_are_one_batch_of_32: false, ["--nproc", "2", "--accumulation", "4", "--strategy", PIPELINE];
    packed_rows_by_accumulation_4_are_one_batch: true, ["--accumulation", "4"];
    packed_rows_on_four_fsdp_ranks_are_one_batch: true, ["--nproc", "4", "--strategy", r#"["fsdp"]"#];
    packed_rows_in_two_pipeline_stages_are_one_batch: true, ["--nproc", "2", "--accumulation", "4", "--strategy", PIPELINE];
    packed_rows_under_tensor_and_sequence_parallel_are_one_batch: true, ["--nproc", "2", "--strategy", TENSOR_AND_SEQUENCE];
    packed_rows_split_over_a_context_ring_are_one_batch: true, ["--nproc", "2", "--strategy", RING];
    packed_rows_over_all_to_all_context_and_fsdp_ranks_are_one_batch: true, ["--nproc", "4", "--strategy", ALL_TO_ALL_FSDP];
    packed_rows_over_tensor_sequence_and_context_ranks_are_one_batch: true, ["--nproc", "4", "--strategy", RING_TENSOR_AND_SEQUENCE];
    packed_rows_over_context_ranks_in_two_pipeline_stages_are_one_batch: true, ["--nproc", "4", "--accumulation", "4", "--strategy", RING_PIPELINE];
}

/// Rows packed by best fit (TRL's `bfd`) train as one batch of them however the batch is
/// split, and are other rows than those packed in order; the strategy asks for --pack.
#[test]
fn best_fit_packed_rows_by_accumulation_4_are_one_batch() {
    let dir = tempfile::tempdir().unwrap();
    let best_fit = ["--pack", "true", "--packing-strategy", "bfd"];
    let one = train(dir.path(), "best-fit", &best_fit);
    let split = train(dir.path(), "best-fit-split", &[&best_fit[..], &["--accumulation", "4"]].concat());
    assert_follows(&one, &split, "best-fit rows by accumulation 4", 1e-6, 2e-6);
    let first_loss = |run: &Run| reports(&run.1)[0]["loss"].as_f64().unwrap();
    assert_ne!(first_loss(&one), first_loss(&one_batch(true)), "best-fit rows are the in-order rows");
    let data = example_file(dir.path());
    let o = strata(&["train", "--data", data.to_str().unwrap(), "--packing-strategy", "bfd"]);
    assert_fails_with(&o, "--packing-strategy fills packed rows: give --pack true");
}

/// `--chat-template-kwargs` reaches every rendering of a run's conversations (here a
/// template that writes a system line when asked): the examples grow by that line each;
/// what is not a JSON object is refused.
#[test]
fn chat_template_arguments_reach_the_run_s_conversations() {
    let dir = tempfile::tempdir().unwrap();
    let file = conversation_file(dir.path(), "c.jsonl", &sum_conversations(8, 3));
    let template = dir.path().join("t.jinja");
    std::fs::write(
        &template,
        "{% if system_line %}<sys>{{ system_line }}</sys>\n{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    let tokens = |extra: &[&str]| {
        let base = ["train", "--model", "llama", "--layers", "1", "--dim", "16", "--heads", "2", "--ctx", "96"];
        let data = ["--data", file.to_str().unwrap(), "--chat-template", template.to_str().unwrap(), "--steps", "1"];
        let o = strata_env(
            &[&base[..], &data, &["--batch-size", "2"], extra].concat(),
            &[("STRATA_CACHE", dir.path().join("cache").to_str().unwrap())],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        let log = stderr(&o);
        let at = log.find(" tokens=").unwrap_or_else(|| panic!("no token count: {log}"));
        log[at + 8..].split_whitespace().next().unwrap().parse::<usize>().unwrap()
    };
    let (plain, given) = (tokens(&[]), tokens(&["--chat-template-kwargs", r#"{"system_line": "Be brief."}"#]));
    // "<sys>Be brief.</sys>\n" in bytes, in each of the 8 conversations.
    assert_eq!(given, plain + 8 * 21, "{plain} then {given}");
    let o = strata(&["train", "--data", file.to_str().unwrap(), "--chat-template-kwargs", "[1]"]);
    assert_fails_with(&o, "--chat-template-kwargs must be a JSON object, not [1]");
}

/// Rows of one example each, padded, split over a context ring: a rank's late pieces often
/// hold padding alone and learn nothing. Under SGD the weights are one batch's to 1e-7
/// (AdamW would normalise the near-zero gradients some features take from a few positions,
/// carrying the pieces' rounding to ~4e-6 of the weights).
#[test]
fn padded_rows_split_over_a_context_ring_are_one_batch() {
    let dir = tempfile::tempdir().unwrap();
    let sgd = ["--optimizer", "sgd", "--lr", "0.5"];
    let one = train(dir.path(), "one", &sgd);
    let ring = train(dir.path(), "ring", &[&sgd[..], &["--nproc", "2", "--strategy", RING]].concat());
    assert_follows(&one, &ring, "padded rows on a context ring", 1e-6, 1e-7);
    let learned = |m: &Path| reports(m).iter().map(|r| r["supervised_tokens"].as_u64().unwrap()).collect::<Vec<_>>();
    assert_eq!(learned(&one.1), learned(&ring.1), "learned tokens per step");
}

/// Dropout's masks fall at positions counted from a row's start, which a ring's two runs
/// per rank do not share: refused before the first step, naming the cure.
#[test]
fn dropout_over_a_context_ring_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = example_file(dir.path());
    let split = ["--steps", "1", "--nproc", "2", "--strategy", RING, "--dropout", "0.1"];
    let o = strata(&[&["train"][..], &words(MODEL), &words(RUN), &["--data", data.to_str().unwrap()], &split].concat());
    assert_fails_with(
        &o,
        "context_parallel: the model's dropout is not drawn over a piece of the rows: set --dropout 0",
    );
}

#[test]
fn packing_fills_rows_with_several_examples() {
    let (packed, one) = (reports(&one_batch(true).1), reports(&one_batch(false).1));
    // These examples run 10 to 33 tokens, rows 48: about two to a row, so a step's 32 rows
    // learn well over 1.5 times the tokens of 32 examples alone.
    let learned = |r: &serde_json::Value| r["supervised_tokens"].as_u64().unwrap() as f64;
    assert!(learned(&packed[0]) > 1.5 * learned(&one[0]), "{} against {}", learned(&packed[0]), learned(&one[0]));
}

#[test]
fn learned_tokens_are_counted() {
    let one = one_batch(false);
    let first = &reports(&one.1)[0];
    let learned = first["supervised_tokens"].as_u64().unwrap();
    // Completions of 1 to 12 bytes are all that is learned, 32 per step: far fewer than
    // the batch's positions, yet some in every row.
    assert!((32..32 * 13).contains(&learned), "{learned}");
    assert!(first["tokens"].as_u64().unwrap() > learned);
}

/// Conversations in `dir/name`, one per line.
fn conversation_file(dir: &Path, name: &str, conversations: &[serde_json::Value]) -> PathBuf {
    let path = dir.join(name);
    let lines: Vec<String> = conversations.iter().map(|c| serde_json::json!({ "messages": c }).to_string()).collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// A tokenizer folder of a template style, made by `transformers` (scripts/chat_reference.py).
fn tokenizer_folder(python: &Path, dir: &Path, style: &str) -> PathBuf {
    let out = dir.join(format!("tok-{style}"));
    let o = Command::new(python)
        .args([reference_script().as_str(), "tokenizer", "--style", style, "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    out
}

fn reference_script() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/chat_reference.py").display().to_string()
}

fn said(role: &str, content: &str) -> serde_json::Value {
    serde_json::json!({"role": role, "content": content})
}

/// Sums asked and answered: `count` conversations from `seed`.
fn sum_conversations(count: usize, seed: u64) -> Vec<serde_json::Value> {
    let words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"];
    let mut state = seed;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) % n) as usize
    };
    (0..count)
        .map(|_| {
            let (a, b) = (next(10), next(10));
            serde_json::json!([
                said("user", &format!("What is {} plus {}?", words[a], words[b])),
                said("assistant", &format!("It is {}.", a + b))
            ])
        })
        .collect()
}

#[test]
fn chat_templates_render_and_tokenize_as_transformers_does() {
    let Some(python) = common::venv_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let conversations = [
        serde_json::json!([said("user", "What is two plus three?"), said("assistant", "It is 5.")]),
        serde_json::json!([
            said("system", "Be brief."),
            said("user", " What is one plus one? "),
            said("assistant", " 2. "),
            said("user", "And four plus five?"),
            said("assistant", "It is 9.")
        ]),
        serde_json::json!([said("user", "Check this."), said("tool", "  {\"sum\": 7}  "), said("assistant", "Seven.")]),
    ];
    // Messages as agents' datasets hold them: null keys (dropped), reasoning under another
    // name (given under both), a tool call without content.
    let agent = serde_json::json!([
        {"role": "user", "content": "Add two and three.", "tool_calls": null},
        {"role": "assistant", "reasoning": "Use the tool.", "content": null, "tool_calls": [{"name": "add"}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "reasoning_content": "Done.", "content": "It is 5."}
    ]);
    let file = conversation_file(dir.path(), "c.jsonl", &conversations);
    let agents = [conversations.to_vec(), vec![agent]].concat();
    let agent_file = conversation_file(dir.path(), "agents.jsonl", &agents);
    let cases = [
        ("chatml", &conversations[..], &file),
        ("headers", &conversations[..], &file),
        ("inst", &conversations[..], &file),
        ("tools", &agents[..], &agent_file),
        ("named", &conversations[..], &file),
    ];
    // Every style's tokenizer folder and renders from one reference process.
    let pairs: Vec<String> = cases.iter().map(|(style, _, file)| format!("{style}={}", file.display())).collect();
    let o = Command::new(&python)
        .args([reference_script().as_str(), "cases", "--out", dir.path().to_str().unwrap()])
        .args(&pairs)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    for (style, conversations, _) in cases {
        let folder = dir.path().join(format!("tok-{style}"));
        let template = ChatTemplate::from_model_dir(&folder).unwrap().expect("the folder has a chat template");
        let tokenizer = Tokenizer::from_file(&folder.join("tokenizer.json")).unwrap();
        let rendered = std::fs::read_to_string(dir.path().join(format!("render-{style}.jsonl"))).unwrap();
        let references: Vec<serde_json::Value> = rendered.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let refusal = std::fs::read_to_string(dir.path().join(format!("render-{style}.error"))).unwrap_or_default();
        for (k, messages) in conversations.iter().enumerate() {
            let messages = messages.as_array().unwrap();
            let Some(reference) = references.get(k) else {
                // transformers refused it (the inst style takes no system or tool turn): so must we.
                let err = template.render(messages, false).unwrap_err().to_string();
                assert!(refusal.contains("roles") && err.contains("roles"), "{style} {k}: {err} ({refusal})");
                break;
            };
            for (key, prompt) in [("whole", false), ("prompt", true)] {
                let text = template.render(messages, prompt).unwrap();
                assert_eq!(text, reference[key]["text"].as_str().unwrap(), "{style} conversation {k} {key}");
                let ids = tokenizer.encode_with_starts(vec![text], false).unwrap().remove(0).0;
                let want: Vec<u32> = serde_json::from_value(reference[key]["ids"].clone()).unwrap();
                assert_eq!(ids, want, "{style} conversation {k} {key}: ids");
            }
        }
    }
}

/// Instruction-tunes a 2-layer LLaMA on 256 sum conversations (ChatML, a byte-level BPE)
/// with `extra` flags for 80 steps, then asks it as a user of the template from its last
/// checkpoint, and evaluates that checkpoint on the validation conversations (the run's own
/// last validation loss): the validation losses on answers, the answer, the run's
/// arguments and the tokenized cache's folder.
fn instruction_tune(dir: &Path, extra: &[&str]) -> (Vec<f64>, String, Vec<String>, PathBuf) {
    let python = common::venv_python().expect("checked by the caller");
    let folder = tokenizer_folder(&python, dir, "chatml");
    let train = conversation_file(dir, "train.jsonl", &sum_conversations(256, 1));
    let val = conversation_file(dir, "val.jsonl", &sum_conversations(32, 2));
    let (metrics, ckpt) = (dir.join("m.jsonl"), dir.join("ckpt"));
    let shape = "train --model llama --layers 2 --heads 4 --dim 64 --ctx 64 --seed 1 --threads 1";
    let run = "--steps 80 --batch-size 16 --eval-every 20";
    let (tokenizer, template) = (folder.join("tokenizer.json"), folder.join("chat_template.jinja"));
    let files = [
        ("--data", &train),
        ("--val-data", &val),
        ("--tokenizer", &tokenizer),
        ("--chat-template", &template),
        ("--metrics", &metrics),
        ("--save-checkpoint", &ckpt),
    ];
    let files: Vec<&str> = files.iter().flat_map(|(flag, path)| [*flag, path.to_str().unwrap()]).collect();
    let args: Vec<String> =
        [words(shape), words(run), files, extra.to_vec()].concat().into_iter().map(String::from).collect();
    let cache = dir.join("cache");
    let o =
        strata_env(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[("STRATA_CACHE", cache.to_str().unwrap())]);
    assert!(o.status.success(), "{}", stderr(&o));
    let log = stderr(&o);
    assert!(log.contains("records=256 examples=256 truncated=0"), "{log}");
    let val_losses: Vec<f64> = reports(&metrics).iter().filter_map(|r| r["val_loss"].as_f64()).collect();
    eprintln!("{extra:?}: validation loss on answers: {val_losses:?}");
    assert_eq!(val_losses.len(), 4);
    let ask = [("--resume", &ckpt), ("--tokenizer", &tokenizer), ("--chat-template", &template)];
    let ask: Vec<&str> = ask.iter().flat_map(|(flag, path)| [*flag, path.to_str().unwrap()]).collect();
    let question = ["generate", "--chat", "--prompt", "What is two plus three?", "--max-new-tokens", "16"];
    let o = strata(&[&question[..], &ask].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let answer = String::from_utf8_lossy(&o.stdout).trim().to_string();
    eprintln!("{extra:?}: answer: {answer:?}");
    // `strata eval` reads the chat file as training did: the run's last validation loss.
    let eval = ["eval", "--val-data", val.to_str().unwrap(), "--ctx", "64", "--batch-size", "16", "--json"];
    let o = strata(&[&eval[..], &ask].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let evaluated = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["val_loss"].as_f64().unwrap();
    assert!((evaluated - val_losses[3]).abs() < 1e-5, "strata eval {evaluated}, the run's {}", val_losses[3]);
    (val_losses, answer, args, cache)
}

/// The answers ("It is N.<|im_end|>") are learned: the validation loss on them falls by
/// more than half, and asked as a user of the template the model answers in the template's
/// words and stops at its end token.
fn assert_answers_in_the_template(val_losses: &[f64], answer: &str) {
    assert!(val_losses[3] < 0.5 * val_losses[0], "{val_losses:?}");
    assert!(answer.starts_with("It is ") && answer.ends_with('.') && answer.len() <= 10, "{answer:?}");
}

#[test]
fn an_instruction_tuned_model_learns_to_answer_in_the_template() {
    if common::venv_python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (val_losses, answer, args, cache) = instruction_tune(dir.path(), &["--lr", "0.003"]);
    assert_answers_in_the_template(&val_losses, &answer);
    // The second run reads the cache.
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let again = strata_env(&[&args[..], &["--steps", "1"]].concat(), &[("STRATA_CACHE", cache.to_str().unwrap())]);
    assert!(stderr(&again).contains("cached=true"), "{}", stderr(&again));
}

/// The same with LoRA adapters on every linear layer of the model (its embedding and head
/// trained whole, as a new chat vocabulary needs): the answers are learned too, and the
/// checkpoint, which holds the adapters, answers in the template.
#[test]
fn lora_adapters_learn_to_answer_in_the_template() {
    if common::venv_python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lora = r#"[["lora", {"r": 16, "alpha": 32, "target_modules": "all-linear", "modules_to_save": ["embed_tokens", "lm_head"]}]]"#;
    let (val_losses, answer, _, _) = instruction_tune(dir.path(), &["--lr", "0.003", "--strategy", lora]);
    assert_answers_in_the_template(&val_losses, &answer);
}

/// `strata train` on a file of `lines` (with the chatml template) fails with `expected`,
/// naming the file, and writes nothing.
fn refused(lines: &[&str], extra: &[&str], expected: &str) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("bad.jsonl");
    std::fs::write(&data, lines.join("\n")).unwrap();
    let template = dir.path().join("t.jinja");
    std::fs::write(&template, CHATML).unwrap();
    let metrics = dir.path().join("m.jsonl");
    let args = [
        &["train", "--data", data.to_str().unwrap(), "--chat-template", template.to_str().unwrap()][..],
        &["--steps", "1", "--batch-size", "1", "--metrics", metrics.to_str().unwrap()],
        extra,
    ]
    .concat();
    let cache = dir.path().join("cache");
    let o = strata_env(&args, &[("STRATA_CACHE", cache.to_str().unwrap())]);
    assert_fails_with(&o, expected);
    assert!(stderr(&o).contains("bad.jsonl"), "the file is named: {}", stderr(&o));
    assert!(!metrics.exists(), "a refused run wrote its metrics");
}

const CHATML: &str = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('a system turn comes first') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

#[test]
fn bad_example_files_are_refused_in_one_line_naming_file_and_line() {
    let good = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#;
    refused(&[good, "{not json"], &[], "bad.jsonl:2: not JSON");
    refused(
        &[good, r#"{"question": "x"}"#],
        &[],
        r#"bad.jsonl:2: a record needs "text", "prompt" and "completion", or "messages""#,
    );
    refused(
        &[r#"{"messages": [{"role": 3, "content": "hi"}]}"#],
        &[],
        r#"bad.jsonl:1: message 1 of "messages" is not an object with a string "role""#,
    );
    let late_system = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]}"#;
    refused(&[good, late_system], &[], "bad.jsonl:2: the chat template failed: a system turn comes first");
    // Every example longer than the most length, left out: nothing to train on.
    refused(
        &[good],
        &["--max-length", "8", "--drop-long", "true"],
        "no example is left to train on (1 records: 1 longer than 8 tokens",
    );
}

#[test]
fn a_template_that_does_not_parse_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = conversation_file(dir.path(), "d.jsonl", &sum_conversations(4, 3));
    let template = dir.path().join("t.jinja");
    std::fs::write(&template, "{% for m in messages %}{{ m.content }").unwrap();
    let o = strata(&[
        "train",
        "--data",
        data.to_str().unwrap(),
        "--chat-template",
        template.to_str().unwrap(),
        "--steps",
        "1",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("t.jinja does not parse"), "{}", stderr(&o));
}

#[test]
fn long_examples_are_truncated_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d.jsonl");
    let lines: Vec<String> =
        (0..8).map(|i| serde_json::json!({"prompt": "p", "completion": "x".repeat(4 + 8 * i)}).to_string()).collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let cache = dir.path().join("cache");
    let o = strata_env(
        &["train", "--data", data.to_str().unwrap(), "--max-length", "24", "--steps", "1", "--batch-size", "4"],
        &[("STRATA_CACHE", cache.to_str().unwrap())],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // Completions of 4, 12, ..., 60 bytes after a 1-byte prompt: those of 28 and more cut.
    assert!(stderr(&o).contains("records=8 examples=8 truncated=5 dropped_long=0"), "{}", stderr(&o));
    // And said where a user looks, with the flag that sets the length.
    let warned = "5 of 8 examples of {} were cut to --max-length 24 tokens: their ends are not learned";
    assert!(stderr(&o).contains(&warned.replace("{}", data.to_str().unwrap())), "{}", stderr(&o));
}

#[test]
fn a_resumed_run_continues_the_epoch_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    // 96 examples in batches of 32: epochs of 3 steps, so step 4 is inside the second.
    let whole = train(dir.path(), "whole", &["--steps", "8"]);
    let ckpt = dir.path().join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    train(dir.path(), "first", &["--steps", "4", "--save-checkpoint", ckpt, "--checkpoint-every", "4"]);
    let resumed = train(dir.path(), "resumed", &["--steps", "8", "--save-checkpoint", ckpt, "--resume", "auto"]);
    let gap = common::global_gap(&whole.0, &resumed.0);
    assert_eq!(gap, 0.0, "the resumed run's weights differ by {gap:e}");
}

/// A resume whose seed and batch size differ from the checkpoint's is refused in one line
/// naming each and what it changes. Asked to restart the data, the run reads the data from
/// its start in its own order while the step count continues; stopped on the way and
/// resumed plainly, it continues that order exactly (the same weights as not stopping).
#[test]
fn a_resume_names_what_differs_and_restarts_the_data_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let path = |name: &str| d.join(name).to_str().unwrap().to_string();
    let (first, restarted) = (path("first"), path("restarted"));
    train(d, "first", &["--steps", "4", "--save-checkpoint", &first]);
    let data = example_file(d);
    let (model, run) = (MODEL.replace("--seed 3", "--seed 5"), RUN.replace("--batch-size 32", "--batch-size 16"));
    let other = |name: &str, extra: &[&str]| {
        let files = ["--data", data.to_str().unwrap(), "--save-weights", &path(&format!("{name}.st"))];
        let args = [&["train"][..], &files, &words(&model), &words(&run), extra].concat();
        strata_env(&args, &[("STRATA_CACHE", &path("cache"))])
    };
    let o = other("refused", &["--steps", "6", "--resume", &first]);
    assert_fails_with(
        &o,
        "seed 5 (saved: 3) draws another order of the rows and other dropout masks; batch size 16 (saved: 32) puts \
         other rows into step 4",
    );
    assert_eq!(stderr(&o).lines().filter(|l| l.starts_with("error")).count(), 1, "{}", stderr(&o));
    let runs: [(&str, &[&str]); 3] = [
        ("whole", &["--steps", "8", "--resume", &first, "--restart-data", "true"]),
        ("part", &["--steps", "6", "--resume", &first, "--restart-data", "true", "--save-checkpoint", &restarted]),
        ("rest", &["--steps", "8", "--resume", "auto", "--save-checkpoint", &restarted]),
    ];
    for (name, extra) in runs {
        let o = other(name, extra);
        assert!(o.status.success(), "{name}:\n{}", stderr(&o));
    }
    let gap = common::global_gap(Path::new(&path("whole.st")), Path::new(&path("rest.st")));
    assert_eq!(gap, 0.0, "the run restarted, stopped and resumed differs by {gap:e}");
}
